"""The Python sandbox's kernel filter (seccomp-bpf): the system calls its child may not make, refused by the
kernel whatever the code does in the interpreter, root or not.

Refused with EPERM:
- creating a process: fork, vfork, clone without CLONE_THREAD (threads stay possible), execve, execveat
  (clone3 answers ENOSYS, which makes the C library fall back to clone for threads: its flags sit in
  memory the filter cannot read);
- signals to other processes: kill, rt_sigqueueinfo, tgkill and rt_tgsigqueueinfo are allowed only with
  the sandbox's own pid (or, for kill, 0: its own process group, which is itself); tkill and
  pidfd_send_signal always refused;
- tracing and reading or writing other processes' memory: ptrace, process_vm_readv, process_vm_writev;
- raising limits: setrlimit, prlimit64 with a new limit (reading one stays possible);
- namespaces and mounts: unshare, setns, mount, umount2, pivot_root, chroot and the new mount API;
- the machine's state: reboot, kexec, kernel modules, swap.
A call from another ABI (x32 on x86-64, or a foreign architecture) kills the process.

Loaded by path in the sandbox child (which runs with `python -I` and cannot import hybridflow) and
imported by the tests. Linux on x86-64 and arm64 only; elsewhere `install` raises OSError, and the child
refuses to run code (process creation must never rest on the interpreter alone).
"""

from __future__ import annotations

import ctypes
import os
import platform

# (AUDIT_ARCH_*, {name: number}) per machine; arm64 has no fork or vfork.
_ARCHES = {
    "x86_64": (0xC000003E, dict(
        fork=57, vfork=58, clone=56, clone3=435, execve=59, execveat=322, kill=62, tkill=200, tgkill=234,
        rt_sigqueueinfo=129, rt_tgsigqueueinfo=297, pidfd_send_signal=424, ptrace=101, process_vm_readv=310,
        process_vm_writev=311, setrlimit=160, prlimit64=302, unshare=272, setns=308, mount=165, umount2=166,
        pivot_root=155, chroot=161, open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432,
        fspick=433, reboot=169, kexec_load=246, kexec_file_load=320, init_module=175, finit_module=313,
        delete_module=176, swapon=167, swapoff=168)),
    "aarch64": (0xC00000B7, dict(
        clone=220, clone3=435, execve=221, execveat=281, kill=129, tkill=130, tgkill=131, rt_sigqueueinfo=138,
        rt_tgsigqueueinfo=240, pidfd_send_signal=424, ptrace=117, process_vm_readv=270, process_vm_writev=271,
        setrlimit=164, prlimit64=261, unshare=97, setns=268, mount=40, umount2=39, pivot_root=41, chroot=51,
        open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433, reboot=142,
        kexec_load=104, kexec_file_load=294, init_module=105, finit_module=273, delete_module=106, swapon=224,
        swapoff=225)),
}
_ARCHES["arm64"] = _ARCHES["aarch64"]
_ALWAYS_REFUSED = ("fork", "vfork", "execve", "execveat", "tkill", "pidfd_send_signal", "ptrace", "process_vm_readv",
                   "process_vm_writev", "setrlimit", "unshare", "setns", "mount", "umount2", "pivot_root", "chroot",
                   "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "reboot", "kexec_load",
                   "kexec_file_load", "init_module", "finit_module", "delete_module", "swapon", "swapoff")
_OWN_PID_ONLY = ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")  # the first argument is the target

_LD_W_ABS, _JEQ_K, _JSET_K, _JGE_K, _RET_K = 0x20, 0x15, 0x45, 0x35, 0x06  # classic BPF opcodes
_NR, _ARCH, _ARG0, _ARG2, _ARG2_HIGH = 0, 4, 16, 32, 36  # offsets in struct seccomp_data (little-endian)
_ALLOW, _KILL_PROCESS = 0x7FFF0000, 0x80000000
_EPERM, _ENOSYS = 0x00050000 | 1, 0x00050000 | 38  # SECCOMP_RET_ERRNO | errno
_CLONE_THREAD, _X32_BIT = 0x00010000, 0x40000000
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_Filter))]


def program(machine: str, pid: int) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions for `machine` and the sandbox's `pid`."""
    if machine not in _ARCHES:
        raise OSError(f"the sandbox's seccomp filter knows x86_64 and aarch64, not {machine!r}")
    arch, numbers = _ARCHES[machine]
    out = [(_LD_W_ABS, 0, 0, _ARCH), (_JEQ_K, 1, 0, arch), (_RET_K, 0, 0, _KILL_PROCESS), (_LD_W_ABS, 0, 0, _NR)]
    if machine == "x86_64":  # x32 calls carry this bit and have numbers of their own
        out += [(_JGE_K, 0, 1, _X32_BIT), (_RET_K, 0, 0, _KILL_PROCESS)]
    for name in _ALWAYS_REFUSED:
        if name in numbers:
            out += [(_JEQ_K, 0, 1, numbers[name]), (_RET_K, 0, 0, _EPERM)]
    out += [(_JEQ_K, 0, 1, numbers["clone3"]), (_RET_K, 0, 0, _ENOSYS)]
    # Each block below starts with the syscall number in the accumulator and either returns or falls
    # through to the next with it reloaded.
    out += [(_JEQ_K, 0, 4, numbers["clone"]), (_LD_W_ABS, 0, 0, _ARG0), (_JSET_K, 0, 1, _CLONE_THREAD),
            (_RET_K, 0, 0, _ALLOW), (_RET_K, 0, 0, _EPERM)]
    out += [(_JEQ_K, 0, 6, numbers["prlimit64"]), (_LD_W_ABS, 0, 0, _ARG2), (_JEQ_K, 0, 2, 0),
            (_LD_W_ABS, 0, 0, _ARG2_HIGH), (_JEQ_K, 1, 0, 0), (_RET_K, 0, 0, _EPERM), (_RET_K, 0, 0, _ALLOW)]
    for name in _OWN_PID_ONLY:  # compares the low 32 bits: pid_t is an int
        zero_ok = 1 if name == "kill" else 0
        out += [(_JEQ_K, 0, 4 + zero_ok, numbers[name]), (_LD_W_ABS, 0, 0, _ARG0),
                (_JEQ_K, 1 + zero_ok, 0, pid & 0xFFFFFFFF)]
        if zero_ok:
            out += [(_JEQ_K, 1, 0, 0)]
        out += [(_RET_K, 0, 0, _EPERM), (_RET_K, 0, 0, _ALLOW)]
    return out + [(_RET_K, 0, 0, _ALLOW)]


def install() -> None:
    """Installs the filter on the calling process (all its threads: call it before starting any); raises
    OSError when the kernel refuses it."""
    libc = ctypes.CDLL(None, use_errno=True)
    instructions = program(platform.machine(), os.getpid())
    filters = (_Filter * len(instructions))(*[_Filter(*i) for i in instructions])
    prog = _Program(len(instructions), filters)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
            libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"the kernel refused the sandbox's seccomp filter: {os.strerror(error)}")

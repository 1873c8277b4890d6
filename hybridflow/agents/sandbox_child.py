"""The child side of the Python sandbox: run as a script (`python -I sandbox_child.py SCRATCH LIMITS`,
the code on stdin) by `hybridflow.agents.sandbox`, never imported by the framework.

Before the user's code runs, in this order:
1. resource limits: address space (memory), CPU seconds, file size, open files, no core dumps, and no
   new processes or threads (RLIMIT_NPROC);
2. a private network namespace (`unshare(CLONE_NEWUSER | CLONE_NEWNET)`): no interface but a down
   loopback, so nothing can be reached (skipped where the kernel refuses it);
3. Landlock (Linux >= 5.13): the file system is read-only and execute-only under the Python
   installation and the system library directories, read-write under the scratch directory, and
   closed everywhere else; on ABI >= 4 TCP bind/connect are refused, on ABI >= 6 signals and abstract
   unix sockets cannot leave the sandbox (skipped where the kernel lacks it);
4. an audit hook (PEP 578, always there): refuses sockets, process creation, signals, ctypes, heap
   walking (`gc.get_objects`), raising limits, and any file access outside the same allowed places
   (resolving symlinks and `..`), and refuses imports of socket, ssl, ctypes and subprocess.
The first line written to stdout is a JSON header naming the layers that are active; then the code
runs with the scratch directory as its working directory, HOME and TMPDIR; an exception prints the
traceback of the user's frames only.
"""

import json
import os
import resource
import sys
import traceback

_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
_DENIED_EVENTS = ("socket.", "ctypes.", "subprocess.", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn",
                  "os.spawn", "os.system", "os.kill", "os.killpg", "signal.pthread_kill", "pty.spawn",
                  "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames",
                  "resource.setrlimit", "resource.prlimit", "urllib.Request", "http.client.", "ftplib.",
                  "smtplib.", "poplib.", "imaplib.", "nntplib.", "telnetlib.", "webbrowser.", "os.startfile")
_DENIED_IMPORTS = ("socket", "_socket", "ssl", "_ssl", "ctypes", "_ctypes", "subprocess", "_posixsubprocess",
                   "multiprocessing", "_multiprocessing")
_READ_EVENTS = ("os.listdir", "os.scandir", "glob.glob", "glob.glob/2", "os.fwalk", "pathlib.Path.glob",
                "pathlib.Path.rglob")
_WRITE_EVENTS = ("os.chdir", "os.chmod", "os.chown", "os.mkdir", "os.remove", "os.rename", "os.rmdir",
                 "os.symlink", "os.link", "os.truncate", "os.utime", "os.setxattr", "os.removexattr",
                 "os.mkfifo", "os.mknod", "shutil.", "tempfile.")
_SYSTEM_LIBS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib", "/etc/ld.so.cache")


def limit_resources(limits: dict) -> None:
    memory = int(limits["memory_mb"]) * 2**20
    seconds = int(limits["cpu_s"])
    for which, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, seconds),
                         (resource.RLIMIT_FSIZE, int(limits["file_mb"]) * 2**20), (resource.RLIMIT_NOFILE, 64),
                         (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, 0)):
        resource.setrlimit(which, (value, value))


def kernel_isolation(scratch: str, readable: list) -> list:
    """Steps 2 and 3 of the module docstring; returns the names of the layers the kernel granted."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    layers = []
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) == 0 or libc.unshare(_CLONE_NEWNET) == 0:
        layers.append("netns")
    abi = libc.syscall(444, None, 0, 1)  # landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)
    if abi < 1:
        return layers
    fs_all = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0) | (1 << 15 if abi >= 5 else 0)
    attr = (ctypes.c_uint64 * 3)(fs_all, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = libc.syscall(444, ctypes.byref(attr), size, 0)
    if ruleset < 0:
        return layers

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    execute, read_file, read_dir, write_file = 1, 4, 8, 2
    for path, rights in [(p, execute | read_file | read_dir) for p in readable] + \
                        [(scratch, fs_all), ("/dev/null", read_file | write_file)]:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        if not os.path.isdir(path):
            rights &= execute | read_file | write_file | (1 << 14 if abi >= 3 else 0)
        libc.syscall(445, ruleset, 1, ctypes.byref(PathBeneath(rights, fd)), 0)
        os.close(fd)
    if libc.prctl(38, 1, 0, 0, 0) == 0 and libc.syscall(446, ruleset, 0) == 0:  # PR_SET_NO_NEW_PRIVS
        layers.append(f"landlock-v{abi}")
    os.close(ruleset)
    return layers


def install_guard(scratch: str, readable: list) -> None:
    """Step 4. The hook closes over its own copies of the functions it uses, so rebinding `os.path`
    and friends from the sandboxed code does not change what it checks."""
    fsdecode, join, normpath, readlink, lstat, getcwd = (os.fsdecode, os.path.join, os.path.normpath,
                                                         os.readlink, os.lstat, os.getcwd)
    islink = __import__("stat").S_ISLNK
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    roots = tuple(readable)

    def resolve(path) -> str:
        path = normpath(join(getcwd(), fsdecode(path)))
        for _ in range(40):  # follow symlinks component by component, as the kernel would
            parts, current = path.split("/")[1:], ""
            for i, part in enumerate(parts):
                candidate = current + "/" + part
                try:
                    link = islink(lstat(candidate).st_mode)
                except OSError:
                    return path
                if link:
                    path = normpath(join(current or "/", fsdecode(readlink(candidate)), *parts[i + 1:]))
                    break
                current = candidate
            else:
                return path
        raise PermissionError("sandbox: too many levels of symbolic links")

    def inside(path: str, bases) -> bool:
        return any(path == b or path.startswith(b.rstrip("/") + "/") for b in bases)

    def check(event: str, path, write: bool) -> None:
        if isinstance(path, int) or path is None:
            return
        real = resolve(path)
        if inside(real, (scratch,)) or real == "/dev/null" or not write and inside(real, roots):
            return
        raise PermissionError(f"sandbox: {event} of {fsdecode(path)!r} is outside the scratch directory")

    def hook(event: str, args: tuple) -> None:
        if event.startswith(_DENIED_EVENTS):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0].split(".")[0] in _DENIED_IMPORTS:
            raise ImportError(f"sandbox: importing {args[0]} is not allowed")
        if event == "open":
            mode, flags = args[1] or "", args[2] or 0
            check(event, args[0], any(c in mode for c in "wax+") or bool(flags & write_flags))
        elif event in _READ_EVENTS:
            check(event, args[0], False)
        elif event.startswith(_WRITE_EVENTS):
            for arg in args:
                if isinstance(arg, (str, bytes, os.PathLike)):
                    check(event, arg, True)

    sys.addaudithook(hook)


def main() -> None:
    scratch, limits = os.path.realpath(sys.argv[1]), json.loads(sys.argv[2])
    code = sys.stdin.read()
    readable = sorted({os.path.realpath(p) for p in [sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path]
                       if p and os.path.exists(p)} | {p for p in _SYSTEM_LIBS if os.path.exists(p)})
    limit_resources(limits)
    layers = kernel_isolation(scratch, readable)
    for name in [m for m in sys.modules if m.split(".")[0] in _DENIED_IMPORTS]:
        del sys.modules[name]
    os.chdir(scratch)
    sys.dont_write_bytecode = True
    install_guard(scratch, readable)
    print(json.dumps({"layers": ["rlimits", *layers, "audit"]}), flush=True)
    try:
        exec(compile(code, "<tool>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException as error:  # the user's traceback, without this file's frames
        frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename != __file__]
        lines = ["Traceback (most recent call last):\n", *traceback.format_list(frames)] if frames else []
        sys.stderr.write("".join(lines + traceback.format_exception_only(type(error), error)))
        sys.exit(1)

if __name__ == "__main__":
    main()

"""The child side of the Python sandbox: run as a script (`python -I sandbox_child.py SCRATCH LIMITS`,
the code on stdin) by `hybridflow.agents.tools.sandbox`, never imported by the framework.

Before the user's code runs, in this order:
1. resource limits: address space (memory), CPU seconds, file size, open files, no core dumps, and no
   new processes or threads (RLIMIT_NPROC, which binds every user but root);
2. it dies with the process that started it (a parent-death signal);
3. a private network namespace (`unshare(CLONE_NEWUSER | CLONE_NEWNET)`): no interface but a down
   loopback, so nothing can be reached (skipped where the kernel refuses it);
4. Landlock (Linux >= 5.13): the file system is read-only and execute-only under the Python
   installation and the system library directories, read-write under the scratch directory, and
   closed everywhere else; on ABI >= 4 TCP bind/connect are refused, on ABI >= 6 signals and abstract
   unix sockets cannot leave the sandbox (skipped where the kernel lacks it);
5. a seccomp filter (`sandbox_seccomp.py`, always: the code does not run without it): no new process
   (fork, exec; threads stay possible), no signal to another process, no tracing, no raising a limit,
   no namespace or mount change, for root too;
6. an audit hook (PEP 578, always there): refuses sockets, process creation, signals, ctypes, heap
   walking (`gc.get_objects`), tracing, raising limits, replacing a function's code, and any file access
   outside the same allowed places (resolving symlinks and `..`), and refuses imports of socket, ssl,
   ctypes and subprocess. Its state is out of the code's reach (`make_hook`), but it shares the
   interpreter with the code: the kernel layers are the boundary, the hook gives clear errors early.
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
                  "smtplib.", "poplib.", "imaplib.", "nntplib.", "telnetlib.", "webbrowser.", "os.startfile",
                  "sys.settrace", "sys.setprofile", "sys.monitoring")
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


def kernel_isolation(scratch: str, readable: list, parent: int) -> list:
    """Steps 2 to 5 of the module docstring; returns the names of the layers the kernel granted. Raises
    OSError when the seccomp filter cannot be installed."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, 9, 0, 0, 0) != 0 or os.getppid() != parent:  # PR_SET_PDEATHSIG, SIGKILL
        raise OSError("sandbox: the process that started it is gone")
    seccomp = load_seccomp()  # before Landlock closes the file's directory
    layers = []
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) == 0 or libc.unshare(_CLONE_NEWNET) == 0:
        layers.append("netns")
    abi = libc.syscall(444, None, 0, 1)  # landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)
    if abi >= 1 and landlock(libc, abi, scratch, readable):
        layers.append(f"landlock-v{abi}")
    seccomp.install()
    return layers + ["seccomp"]


def landlock(libc, abi: int, scratch: str, readable: list) -> bool:
    """Step 4 at Landlock ABI `abi`; whether the kernel took the rules."""
    import ctypes

    fs_all = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0) | (1 << 15 if abi >= 5 else 0)
    attr = (ctypes.c_uint64 * 3)(fs_all, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = libc.syscall(444, ctypes.byref(attr), size, 0)
    if ruleset < 0:
        return False

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
    granted = libc.prctl(38, 1, 0, 0, 0) == 0 and libc.syscall(446, ruleset, 0) == 0  # PR_SET_NO_NEW_PRIVS
    os.close(ruleset)
    return granted


def load_seccomp():
    """Step 5's module, `sandbox_seccomp.py` beside this file (loaded by path: `-I` keeps hybridflow off
    sys.path)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_seccomp.py")
    spec = importlib.util.spec_from_file_location("sandbox_seccomp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_hook(scratch: str, readable: list):
    """Step 5's hook. Its state is bound as default arguments of the hook and its helpers: no module
    globals (which the code could reach through `sys._getframe(...).f_globals`), no closure cells (which a
    frame's locals proxy can write), no name looked up when it runs (builtins can be rebound). It never
    runs the code's own methods (a str subclass's `split`, an object's `__fspath__`): paths are read from
    exact str / bytes copies and pathlib's cached string, so no sandboxed code runs while a hook call
    holds its state. Replacing a function's code or defaults is refused, so the helpers the tracebacks of
    its refusals show cannot be altered either."""
    import pathlib
    import stat
    import types

    def text(value, _str=str, _bytes=bytes, _type=type, _isinstance=isinstance, _all=slice(None),
             _copy=str.__getitem__, _copy_bytes=bytes.__getitem__, _decode=bytes.decode,
             _encoding=sys.getfilesystemencoding(), _pure=pathlib.PurePosixPath, _path=pathlib.PosixPath,
             _cached=pathlib.PurePath.__dict__["_str"].__get__, _AttributeError=AttributeError):
        """`value` as an exact str, calling none of its methods; None for anything but str, bytes, pathlib."""
        kind = _type(value)
        if kind is _str:
            return value
        if kind is _pure or kind is _path:  # `open(path)` passes it on after `os.fspath` cached its string
            try:
                value = _cached(value)
            except _AttributeError:
                return None
        if _isinstance(value, _str):
            return _copy(value, _all)
        if _isinstance(value, _bytes):
            return _decode(_copy_bytes(value, _all), _encoding, "surrogateescape")
        return None

    def normal(path, _cwd=os.getcwd):
        """`path` made absolute, its `.`, `..` and repeated slashes resolved by its text alone."""
        parts = []
        for part in (path if path[:1] == "/" else _cwd() + "/" + path).split("/"):
            if part == "..":
                if parts:
                    parts.pop()
            elif part and part != ".":
                parts.append(part)
        return "/" + "/".join(parts)

    def resolve(path, _normal=normal, _lstat=os.lstat, _readlink=os.readlink, _islink=stat.S_ISLNK, _range=range,
                _enumerate=enumerate, _OSError=OSError, _PermissionError=PermissionError):
        """`path` with its symlinks followed component by component, as the kernel would."""
        path = _normal(path)
        for _ in _range(40):
            parts, current = path.split("/")[1:], ""
            for i, part in _enumerate(parts):
                candidate = current + "/" + part
                try:
                    link = _islink(_lstat(candidate).st_mode)
                except _OSError:
                    return path
                if link:
                    target = _readlink(candidate)
                    base = target if target[:1] == "/" else current + "/" + target
                    path = _normal(base + "/" + "/".join(parts[i + 1:]))
                    break
                current = candidate
            else:
                return path
        raise _PermissionError("sandbox: too many levels of symbolic links")

    def inside(path, bases):
        for base in bases:
            if path == base or path.startswith(base.rstrip("/") + "/"):
                return True
        return False

    def check(event, value, write, _text=text, _resolve=resolve, _inside=inside, _scratch=(scratch,),
              _roots=tuple(readable), _PermissionError=PermissionError):
        path = _text(value)
        if path is None:
            raise _PermissionError(f"sandbox: {event} needs a str, bytes or pathlib path")
        real = _resolve(path)
        if _inside(real, _scratch) or real == "/dev/null" or not write and _inside(real, _roots):
            return
        raise _PermissionError(f"sandbox: {event} of {path!r} is outside the scratch directory")

    def hook(event, args, _text=text, _check=check, _denied=_DENIED_EVENTS, _imports=_DENIED_IMPORTS,
             _reads=_READ_EVENTS, _writes=_WRITE_EVENTS, _flags=os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC
             | os.O_APPEND, _type=type, _len=len, _int=int, _float=float, _tuple=tuple,
             _function=types.FunctionType, _PermissionError=PermissionError, _ImportError=ImportError):
        event = _text(event)
        if event is None or event.startswith(_denied):
            raise _PermissionError(f"sandbox: {event} is not allowed")
        if event == "object.__setattr__" or event == "object.__delattr__":
            if _len(args) and _type(args[0]) is _function:
                raise _PermissionError("sandbox: changing a function's code or defaults is not allowed")
        elif event == "import":
            name = _text(args[0]) if _len(args) else None
            if name is None or name.split(".")[0] in _imports:
                raise _ImportError(f"sandbox: importing {name} is not allowed")
        elif event == "open" and _len(args) == 3:
            mode, flags = _text(args[1]) or "", args[2]
            write = _type(flags) is _int and flags & _flags != 0
            for c in "wax+":
                if c in mode:
                    write = True
            _check(event, args[0], write)
        elif event in _reads and _len(args):
            _check(event, args[0], False)
        elif event.startswith(_writes):
            for arg in args:
                kind = _type(arg)
                if not (arg is None or kind is _int or kind is _float or kind is _tuple):
                    _check(event, arg, True)

    return hook


def main() -> None:
    scratch, limits = os.path.realpath(sys.argv[1]), json.loads(sys.argv[2])
    code = sys.stdin.read()
    readable = sorted({os.path.realpath(p) for p in [sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path]
                       if p and os.path.exists(p)} | {p for p in _SYSTEM_LIBS if os.path.exists(p)})
    limit_resources(limits)
    try:
        layers = kernel_isolation(scratch, readable, int(limits["parent"]))
    except OSError as error:  # no code runs without the seccomp filter
        print(json.dumps({"layers": []}), flush=True)
        print(f"sandbox: not started: {error}", flush=True)
        sys.exit(1)
    for name in [m for m in sys.modules if m.split(".")[0] in _DENIED_IMPORTS]:
        del sys.modules[name]
    os.chdir(scratch)
    sys.dont_write_bytecode = True
    sys.addaudithook(make_hook(scratch, readable))
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

"""The Python executor's sandbox against hostile code: infinite loops, huge outputs, file-system
escapes, network, new processes, memory and file bombs. Each is stopped, and the run that follows
still works."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from hybridflow.agents.tools.parsing import ToolCall
from hybridflow.agents.tools.sandbox import PythonTool, SandboxLimits, run_python
from hybridflow.agents.tools.tool import Scratch, ToolContext
from hybridflow.agents.tools.toolset import ToolSet

LIMITS = SandboxLimits(timeout_s=2.0, memory_mb=256, file_mb=1, max_output_bytes=2000)


def run(code: str, scratch, limits: SandboxLimits = LIMITS):
    return asyncio.run(run_python(code, scratch, limits))


def test_normal_code_runs_in_its_scratch_directory(tmp_path):
    result = run("import math, json\nprint(json.dumps([math.factorial(10), 2 ** 0.5]))", tmp_path)
    assert result.exit_code == 0 and result.output == "[3628800, 1.4142135623730951]\n"
    assert result.layers[0] == "rlimits" and result.layers[-1] == "audit"
    assert run("open('notes.txt', 'w').write('kept')", tmp_path).exit_code == 0
    assert run("import os; print(os.getcwd() == os.environ['HOME'], open('notes.txt').read())",
               tmp_path).output == "True kept\n"  # files stay for the next call of the episode
    assert (tmp_path / "notes.txt").read_text() == "kept"
    code = "import pathlib\npathlib.Path('p.txt').write_text('via pathlib')\nprint(pathlib.Path('p.txt').read_text())"
    assert run(code, tmp_path).output == "via pathlib\n"


@pytest.mark.parametrize("code", ["while True: pass", "import time\nwhile True: time.sleep(0.01)",
                                  "import os\nos.close(1); os.close(2)\nwhile True: pass"])
def test_infinite_loops_are_killed_at_the_time_limit(tmp_path, code):
    start = time.perf_counter()
    result = run(code, tmp_path)
    assert result.timed_out and result.exit_code is None
    assert time.perf_counter() - start < LIMITS.timeout_s + 3


@pytest.mark.parametrize("code", ["print('x' * 10 ** 8)", "while True: print('y' * 1000)",
                                  "import sys\nwhile True: sys.stderr.write('z' * 4096)",
                                  # the unread output fills the pipe's buffer, which pauses it; the exit
                                  # is seen only once the pipe is read to its end
                                  "import sys, time\nsys.stdout.write('w' * 10 ** 7)\nsys.stdout.flush()\n"
                                  "time.sleep(60)"])
def test_huge_outputs_are_cut_and_the_writer_killed(tmp_path, code):
    start = time.perf_counter()
    result = run(code, tmp_path)
    assert result.truncated and len(result.output) == LIMITS.max_output_bytes
    assert time.perf_counter() - start < LIMITS.timeout_s


@pytest.mark.parametrize("code", [
    "print(open('/etc/passwd').read())",
    "print(open('../../../../../../etc/hostname').read())",
    "import os; os.symlink('/etc/passwd', 'link'); print(open('link').read())",
    "import os; os.symlink('/', 'root'); print(os.listdir('root/etc'))",
    "import os; print(os.listdir('/'))",
    "import os; os.chdir('/'); print(os.listdir('.'))",
    "open('/tmp/hybridflow-sandbox-escape', 'w').write('out')",
    "import os; open(os.__file__, 'a').write('# tampered')",
    "import pathlib; print(pathlib.Path('/etc/passwd').read_text())",
    "import shutil; shutil.copyfile('/etc/passwd', 'copy')",
])
def test_file_system_escapes_are_refused(tmp_path, code):
    result = run(code, tmp_path)
    assert result.exit_code == 1 and "PermissionError" in result.output
    assert "root:" not in result.output
    assert not os.path.exists("/tmp/hybridflow-sandbox-escape")


@pytest.mark.parametrize("code,error", [
    ("import socket", "ImportError: sandbox: importing socket"),
    ("import _socket", "ImportError: sandbox: importing _socket"),
    ("import urllib.request; urllib.request.urlopen('http://example.com')", "ImportError"),
    ("import ctypes", "ImportError: sandbox: importing ctypes"),
    ("import subprocess", "ImportError: sandbox: importing subprocess"),
    ("import os; os.system('echo escaped')", "PermissionError: sandbox: os.system"),
    ("import os; os.fork()", "PermissionError: sandbox: os.fork"),
    ("import os; os.execv('/bin/sh', ['sh'])", "PermissionError: sandbox: os.exec"),
    ("import os, signal; os.kill(os.getppid(), signal.SIGKILL)", "PermissionError: sandbox: os.kill"),
    ("import gc; gc.get_objects()", "PermissionError: sandbox: gc.get_objects"),
    ("import resource; resource.setrlimit(resource.RLIMIT_AS, (-1, -1))", "PermissionError"),
])
def test_network_processes_and_escape_hatches_are_refused(tmp_path, code, error):
    result = run(code, tmp_path)
    assert result.exit_code == 1 and error in result.output and "escaped" not in result.output.replace(error, "")


def test_memory_and_file_bombs_fail_inside_the_sandbox(tmp_path):
    assert "MemoryError" in run("x = bytearray(2 * 1024 ** 3)", tmp_path).output
    result = run("f = open('big', 'wb')\nfor _ in range(64): f.write(b'0' * 2 ** 20)", tmp_path)
    assert result.exit_code != 0 and (tmp_path / "big").stat().st_size <= 2 ** 20
    assert run("print('still fine')", tmp_path).output == "still fine\n"


# the bytes cases allow many files, so which bound a fast disk reaches first between two checks is not a race
@pytest.mark.parametrize("code,files,over", [
    ("import itertools\nfor i in itertools.count(): open(f'f{i}', 'w').close()", 40, "more than 40 files"),
    ("import itertools\nfor i in itertools.count(): open(f'f{i}', 'wb').write(b'0' * (2 ** 20 - 1))", 100000,
     "MiB of files"),
    ("for i in range(3): open(f'f{i}', 'wb').write(b'0' * (2 ** 20 - 1))", 40, "MiB of files"),  # over as it ends
])
def test_the_scratch_directory_is_bounded_in_files_and_bytes(code, files, over):
    tool = ToolSet([{"name": "python", "kwargs": {"timeout_s": 5, "file_mb": 1, "scratch_mb": 2,
                                                  "scratch_files": files}}])
    scratch = Scratch()
    context = tool.contexts({}, scratch)["python"]
    try:
        start = time.perf_counter()
        result = asyncio.run(tool.run(ToolCall("python", {"code": code}), context, 10.0))
        assert time.perf_counter() - start < 4  # killed when over, long before the time limit
        assert result.error and "[stopped: the scratch directory held " in result.text and over in result.text
        assert result.text.endswith("; its files were removed]") and os.listdir(scratch.path) == []
        again = asyncio.run(tool.run(ToolCall("python", {"code": "open('a', 'w').write('kept'); print('ok')"}),
                                     context, 10.0))
        assert again.text == "ok\n" and not again.error and os.listdir(scratch.path) == ["a"]
    finally:
        scratch.cleanup()


def test_python_tool_reports_errors_and_limits(tmp_path):
    tool = PythonTool(timeout_s=1.0)
    scratch = Scratch()
    context = ToolContext({}, {}, scratch)
    try:
        ok = asyncio.run(tool.call({"code": "print(6 * 7)"}, context))
        assert ok.text == "42\n" and not ok.error
        failed = asyncio.run(tool.call({"code": "1 / 0"}, context))
        assert failed.error and failed.text.endswith("ZeroDivisionError: division by zero\n")
        assert '"<tool>", line 1' in failed.text and "sandbox_child" not in failed.text
        slow = asyncio.run(tool.call({"code": "while True: pass"}, context))
        assert slow.error and "[stopped: still running after 1 s]" in slow.text
        loud = asyncio.run(PythonTool(max_output_bytes=64).call({"code": "print('a' * 1000)"}, context))
        assert loud.text.endswith("[output cut at 64 bytes]") and loud.text.startswith("a" * 64)
        path = scratch.path
    finally:
        scratch.cleanup()
    assert not os.path.exists(path)
    with pytest.raises(ValueError, match="timeout_s=0 is invalid"):
        PythonTool(timeout_s=0)
    with pytest.raises(ValueError, match="scratch_files=0 is invalid"):
        PythonTool(scratch_files=0)


def sandbox_processes(scratch) -> list[int]:
    """Pids of live processes whose HOME is `scratch`: the sandbox's and whatever it started."""
    marker = f"HOME={os.path.realpath(scratch)}".encode() + b"\0"
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read():
                    found.append(int(pid))
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found


FORK_BOMBS = [
    # the earlier bypass: the hook's deny list reached through the caller's globals, then forks that
    # leave the process group
    "import sys, os, time\nsys._getframe(1).f_globals['_DENIED_EVENTS'] = ('x',)\n"
    "for _ in range(5):\n    if os.fork() == 0:\n        os.setsid()\n        if os.fork() == 0:\n"
    "            time.sleep(60)\n        os._exit(0)\nprint('forked')",
    "import os, time\npid = os.fork()\nif pid == 0:\n    os.setsid(); time.sleep(60)\nprint('forked')",
    "import os\nos.execv('/bin/sleep', ['sleep', '60'])",
    "import _posixsubprocess",
    "import threading, time\nts = [threading.Thread(target=time.sleep, args=(0.1,)) for _ in range(4)]\n"
    "[t.start() for t in ts]; [t.join() for t in ts]\nprint('threads ok')",
]


@pytest.mark.parametrize("code", FORK_BOMBS)
def test_no_process_outlives_the_call_even_for_root(tmp_path, code):
    result = run(code, tmp_path)
    assert "forked" not in result.output
    if "threads" in code:  # threads are not processes: they still work
        assert result.output == "threads ok\n", result.output
    else:
        assert result.exit_code == 1 and ("PermissionError" in result.output or "ImportError" in result.output)
    assert "seccomp" in result.layers
    time.sleep(0.2)  # a fork that escaped would be running by now
    assert sandbox_processes(tmp_path) == []


SECCOMP_PROBE = """
import ctypes, importlib.util, json, os, resource, subprocess, sys, threading
spec = importlib.util.spec_from_file_location("sandbox_seccomp", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.install()
libc = ctypes.CDLL(None, use_errno=True)


def unshare(flags):
    if libc.unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), "unshare")


attempts = {
    "fork": os.fork, "exec": lambda: os.execv("/bin/true", ["true"]),
    "subprocess": lambda: subprocess.run(["/bin/true"]),
    "posix_spawn": lambda: os.posix_spawn("/bin/true", ["true"], {}),
    "signal the parent": lambda: os.kill(os.getppid(), 0), "signal every process": lambda: os.kill(-1, 0),
    "raise a limit": lambda: resource.setrlimit(resource.RLIMIT_NOFILE, resource.getrlimit(resource.RLIMIT_NOFILE)),
    "unshare": lambda: unshare(0x20000),  # CLONE_NEWNS
    "signal itself": lambda: os.kill(os.getpid(), 0), "read a limit": lambda: resource.getrlimit(resource.RLIMIT_AS),
    "thread": lambda: [t.start() or t.join() for t in [threading.Thread(target=lambda: None)]],
}
outcome = {}
for name, attempt in attempts.items():
    try:
        attempt()
        outcome[name] = "allowed"
    except OSError as e:
        outcome[name] = e.errno
    except ValueError:  # what the resource module makes of EPERM
        outcome[name] = "ValueError"
print(json.dumps(outcome))
"""


def test_the_seccomp_filter_refuses_processes_signals_and_limits_on_its_own(tmp_path):
    """The kernel layer alone, with no audit hook: what code that escaped the interpreter could still do."""
    import errno
    import json
    import subprocess
    import sys

    from hybridflow.agents.tools import sandbox_seccomp

    probe = tmp_path / "probe.py"
    probe.write_text(SECCOMP_PROBE)
    done = subprocess.run([sys.executable, "-I", str(probe), sandbox_seccomp.__file__], capture_output=True,
                          text=True, timeout=60)
    outcome = json.loads(done.stdout)
    refused = ["fork", "exec", "subprocess", "posix_spawn", "signal the parent", "signal every process", "unshare"]
    assert {name: outcome[name] for name in refused} == {name: errno.EPERM for name in refused}, done.stderr
    assert outcome["raise a limit"] == "ValueError"
    assert outcome["signal itself"] == outcome["read a limit"] == outcome["thread"] == "allowed"


def test_the_hook_keeps_its_state_out_of_reach(tmp_path):
    """The hook reads no global or closure cell, and runs none of the code's methods."""
    import builtins
    import pathlib
    import types

    from hybridflow.agents.tools import sandbox_child

    hook = sandbox_child.make_hook(str(tmp_path), ["/usr/lib"])
    functions, todo = [], [hook]
    while todo:
        fn = todo.pop()
        if fn in functions:
            continue
        functions.append(fn)
        todo += [d for d in fn.__defaults__ or () if isinstance(d, types.FunctionType)]
    assert sorted(fn.__name__ for fn in functions) == ["check", "hook", "inside", "normal", "resolve", "text"]
    for fn in functions:
        assert fn.__code__.co_freevars == ()
        assert not set(fn.__code__.co_names) & (set(vars(builtins)) | set(vars(sandbox_child))), fn.__name__
    called = []

    class Sly(str):
        def split(self, *args):
            called.append("split")
            return ["json"]

        def startswith(self, *args):
            called.append("startswith")
            return False

    class Path:
        def __fspath__(self):
            called.append("__fspath__")
            return str(tmp_path / "fine")

    with pytest.raises(ImportError, match="importing socket"):
        hook("import", (Sly("socket"),))
    with pytest.raises(PermissionError, match="outside the scratch"):
        hook("open", (Sly("/etc/passwd"), "r", 0))
    with pytest.raises(PermissionError, match="needs a str, bytes or pathlib path"):
        hook("open", (Path(), "r", 0))
    with pytest.raises(PermissionError, match="os.fork is not allowed"):
        hook(Sly("os.fork"), ())
    assert called == []
    path = pathlib.Path(str(tmp_path / "x.txt"))
    os.fspath(path)  # as open() does before the event
    hook("open", (path, "w", 0))
    hook("open", (b"/usr/lib/python3", "r", 0))


@pytest.mark.parametrize("code", [
    "import sys\ng = sys._getframe(1).f_globals\ng['_DENIED_IMPORTS'] = g['_DENIED_EVENTS'] = ()\nimport socket",
    "try:\n    open('/etc/passwd')\nexcept PermissionError as e:\n    tb = e.__traceback__\nwhile tb:\n"
    "    for value in list(tb.tb_frame.f_locals.values()):\n        if hasattr(value, '__defaults__'):\n"
    "            value.__defaults__ = None\n    tb = tb.tb_next\nimport socket",
    "import sys\nsys.settrace(lambda *a: None)",
])
def test_tampering_with_the_hook_from_inside_fails(tmp_path, code):
    result = run(code, tmp_path)
    assert result.exit_code == 1 and ("ImportError: sandbox" in result.output or "PermissionError: sandbox"
                                      in result.output), result.output

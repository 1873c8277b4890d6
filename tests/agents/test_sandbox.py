"""The Python executor's sandbox against hostile code: infinite loops, huge outputs, file-system
escapes, network, new processes, memory and file bombs. Each is stopped, and the run that follows
still works."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from hybridflow.agents.sandbox import PythonTool, SandboxLimits, run_python
from hybridflow.agents.tools import Scratch, ToolContext

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

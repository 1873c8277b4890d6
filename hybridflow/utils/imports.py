"""Loading a user's object named in the config: from a Python file, `path/to/file.py:Name` (reward
functions, environment classes, tools), with errors that name the file, the name and what is there. A file
whose module-level code runs longer than `SLOW_IMPORT_S` is named in a warning while it runs, so a start-up
stuck in user code (a download, a lock, a loop) says where it is stuck. Or, with `load_from_module`, from an
installed package by import path (`package.module:Name` or `package.module.Name`)."""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import logging
import sys
import threading
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SLOW_IMPORT_S = 30.0


def load_from_file(spec: str, what: str, kind: str = "function", key: str = "") -> Any:
    """The object `Name` of `path/to/file.py:Name` (the path relative to the working directory, or absolute).

    what: what the object is for, in errors ("reward", "environment"); kind: "function" or "class";
    key: the config key that named the spec. The file is executed on every call, as a module of its own
    (registered in `sys.modules`, so dataclasses and pickling by reference work inside it).
    """
    path_str, _, name = spec.rpartition(":")
    if not path_str or not name:
        raise ValueError(f"{what} {kind} spec {spec!r} must look like 'path/to/file.py:{kind}_name'")
    path = Path(path_str).expanduser().resolve()
    where = f"{key}={spec!r}" if key else repr(spec)
    if not path.is_file():
        raise FileNotFoundError(f"{what} file {path_str!r} does not exist (from {where})")
    module_name = f"hybridflow_user_{what}_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"cannot import {what} file {path} (is it a .py file?)")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    message = "still importing %s file %s (%s) after %g s: its module-level code is running; the run waits for it"
    watch = threading.Timer(SLOW_IMPORT_S, logger.warning, (message, what, path, where, SLOW_IMPORT_S))
    watch.daemon = True
    watch.start()
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    finally:
        watch.cancel()
    if not hasattr(module, name):
        candidates = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                      and getattr(v, "__module__", None) == module_name]
        hint = difflib.get_close_matches(name, candidates, n=1)
        raise AttributeError(f"{what} file {path_str} has no {kind} {name!r}"
                             + (f"; did you mean {hint[0]!r}?" if hint else "")
                             + f" Defined there: {candidates}")
    return getattr(module, name)


def load_from_module(spec: str, what: str, key: str = "") -> Any:
    """The object named by an import path: ``package.module:name`` or ``package.module.name`` (e.g.
    ``trl.rewards.accuracy_reward``, ``verl.utils.reward_score.gsm8k.compute_score``).

    what: what the object is for, in errors ("reward function"); key: the config key that named it. Raises
    ImportError naming the module that cannot be imported, or AttributeError naming what the module has.
    """
    module_name, sep, name = spec.partition(":")
    if not sep:
        module_name, _, name = spec.rpartition(".")
    where = f"{key}={spec!r}" if key else repr(spec)
    if not module_name or not name or "." in name:
        raise ValueError(f"{what} {where} must be an import path ('package.module:name' or "
                         f"'package.module.name') or a file ('path/to/file.py:name')")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"{what} {where}: cannot import module {module_name!r} ({e}); install the package that "
                          f"provides it, or name a file as 'path/to/file.py:name'") from None
    if not hasattr(module, name):
        public = [n for n in dir(module) if not n.startswith("_")]
        hint = difflib.get_close_matches(name, public, n=1)
        raise AttributeError(f"{what} {where}: module {module_name!r} has no {name!r}"
                             + (f"; did you mean {hint[0]!r}?" if hint else ""))
    return getattr(module, name)

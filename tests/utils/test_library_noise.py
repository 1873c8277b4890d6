"""`hybridflow.utils.library_noise`: importing hybridflow drops torchao's kernel-loading failures on a machine
without CUDA and PyTorch's Enum pytree deprecation notice, and nothing else those loggers say."""

from __future__ import annotations

import logging

import hybridflow  # noqa: F401  (installs the filters)
from hybridflow.utils import library_noise

FAILED = "Failed to load /site/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load this library"
PYTREE = "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile"


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _emit() -> list[str]:
    """What reaches a handler on the loggers themselves (filters run before handlers and propagation)."""
    collect = _Collect()
    loggers = [logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")]
    for logger in loggers:
        logger.addHandler(collect)
    try:
        loggers[0].warning(FAILED)
        loggers[0].warning("Skipping import of cpp extensions due to incompatible torch version")
        loggers[1].warning(PYTREE)
        loggers[1].warning("another pytree warning")
    finally:
        for logger in loggers:
            logger.removeHandler(collect)
    return collect.messages


def test_only_the_two_known_lines_are_dropped_and_kernel_failures_stay_where_cuda_is(monkeypatch):
    library_noise.install()  # a second install adds nothing
    for name in ("torchao", "torch.utils._pytree"):
        assert sum(getattr(f, "name", None) == "hybridflow-library-noise" for f in logging.getLogger(name).filters) == 1
    monkeypatch.setattr(library_noise, "_no_cuda", lambda: True)
    assert _emit() == ["Skipping import of cpp extensions due to incompatible torch version",
                             "another pytree warning"]
    monkeypatch.setattr(library_noise, "_no_cuda", lambda: False)
    assert _emit() == [FAILED, "Skipping import of cpp extensions due to incompatible torch version",
                             "another pytree warning"]

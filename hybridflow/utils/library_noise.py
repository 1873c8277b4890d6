"""Quieting two library log lines that say nothing a hybridflow user can act on.

- torchao (which `transformers` imports whenever it is installed) warns "Failed to load .../_C_*.so" for
  each of its CUDA kernel libraries it cannot load. On a machine without CUDA that is every one of them,
  and none is used there, so every command printed four lines that read like errors. Where CUDA is
  available the lines stay: a kernel that fails to load there may matter.
- PyTorch's pytree module warns, once per class, that `register_constant()` on an Enum is deprecated:
  torchao registers its enums that way at import. The notice is for torchao's developers.

`install()` adds one logging filter to each of the two loggers; every other record passes. Idempotent.
"""

from __future__ import annotations

import logging

_FILTER_NAME = "hybridflow-library-noise"


def _no_cuda() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:
        return True


def _torchao_record(record: logging.LogRecord) -> bool:
    """False for a CUDA kernel library torchao failed to load on a machine without CUDA."""
    message = record.getMessage()
    return not (message.startswith("Failed to load") and ".so" in message and _no_cuda())


def _pytree_record(record: logging.LogRecord) -> bool:
    """False for the deprecation notice about registering Enum classes as pytree constants."""
    return "is an Enum subclass and is now natively supported" not in record.getMessage()


def install() -> None:
    """Attach the filters (once) to the `torchao` and `torch.utils._pytree` loggers."""
    for name, check in (("torchao", _torchao_record), ("torch.utils._pytree", _pytree_record)):
        logger = logging.getLogger(name)
        if any(getattr(f, "name", None) == _FILTER_NAME for f in logger.filters):
            continue
        f = logging.Filter(_FILTER_NAME)
        f.filter = check  # type: ignore[method-assign]  # a Filter named for install's check above
        logger.addFilter(f)

"""Every random-number-generator state of one process, captured and restored as plain data.

Covers Python's `random`, NumPy's legacy global generator, torch's CPU generator and, when CUDA has
been initialised, torch's generator on every visible CUDA device. The captured state holds only
tensors, ints, floats, strings and tuples, so `torch.load(..., weights_only=True)` reads it back.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states: {"python", "numpy", "torch", and "cuda" (list, one per device)}."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    assert isinstance(keys, np.ndarray)  # the legacy form is always the tuple
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what `capture_rng_state` returned, so the next random numbers are the same.

    CUDA states are restored device by device; if fewer devices are visible now, the extra saved
    states are skipped with a warning (numbers on those devices cannot repeat).
    """
    missing = [key for key in ("python", "numpy", "torch") if key not in state]
    if missing:
        raise ValueError(f"RNG state lacks {missing}; it must come from capture_rng_state()")
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    np.random.set_state((numpy_state["kind"], numpy_state["keys"].numpy().astype(np.uint32),
                         numpy_state["pos"], numpy_state["has_gauss"], numpy_state["gauss"]))
    torch.set_rng_state(state["torch"])
    cuda_states = state.get("cuda")
    if cuda_states and torch.cuda.is_available():
        visible = torch.cuda.device_count()
        if visible < len(cuda_states):
            warnings.warn(f"checkpoint has CUDA RNG states for {len(cuda_states)} devices, "
                          f"{visible} visible now; the rest are not restored", stacklevel=2)
        for device, device_state in enumerate(cuda_states[:visible]):
            torch.cuda.set_rng_state(device_state, device)

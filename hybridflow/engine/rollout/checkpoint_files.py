"""What the rollout engine reads from a model directory besides its config: the weights, tensor by tensor, as HF
names them (safetensors read lazily, or .bin files), and the ids generation stops at."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch


def checkpoint_tensors(path: str | Path, keep: Callable[[str], bool] | None = None,
                       rename: Callable[[str], str | None] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, CPU tensor) for every tensor in a model directory's safetensors (or .bin) files; with `keep`
    (name -> bool), safetensors files skip the others unread. `rename`: each stored name as the model names it, None
    to leave the tensor out (a published Qwen3.5's vision tower: `lm_class.language_model_name`)."""
    path = Path(path)
    if rename is not None:
        def kept(stored: str) -> bool:
            new = rename(stored)
            return new is not None and (keep is None or keep(new))

        for name, tensor in checkpoint_tensors(path, kept):
            new = rename(name)
            if new is not None:  # (.bin files are read whole, `kept` or not)
                yield new, tensor
        return
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors import safe_open

        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if keep is None or keep(name):
                        yield name, f.get_tensor(name)
        return
    files = sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin weights under {path}")
    for file in files:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()


def eos_ids(config) -> list[int] | None:
    """A (generation) config's `eos_token_id` as a list (it may hold one id or several); None if unset."""
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return None
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def model_stop_ids(path: str | Path, config) -> list[int]:
    """The eos ids of the model's generation config (falling back to its config); [] if none."""
    from transformers import GenerationConfig

    try:
        ids = eos_ids(GenerationConfig.from_pretrained(path))
    except OSError:
        ids = None
    return ids if ids is not None else eos_ids(config) or []

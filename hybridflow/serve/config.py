"""What `hybridflow serve` was started with: `ServeConfig`, checked when built, and `model_map` for `--model`."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from hybridflow.config.model_schema import QUANTIZATIONS


@dataclass
class ServeConfig:
    """What `hybridflow serve` was started with.

    models: served base-model name -> local Hugging Face directory.
    device: where training and sampling run ("cpu", "cuda").
    max_num_seqs: the rollout engine's concurrent sequences.
    max_snapshots: sampler weight snapshots kept in memory (the oldest is dropped first).
    checkpoint_dir: where `save_weights` and `save_weights_external` write (`MODEL_ID/...`).
    merged_exports: `save_weights_external` of a LoRA client writes its merged model, not an adapter directory.
    micro_batch_tokens: the most padded tokens (rows x longest row) a forward_backward pass holds at once; the
        data of waiting requests are packed into micro-batches within it (0: one batch, bounded by memory only).
    quantization: "nf4" stores the bases' projections in 4 bits for LoRA clients (`BaseModels`); "none" keeps fp32.
    session_timeout_s: a session whose client sent no heartbeat for this long is finished and its training clients
        released (`Sessions`); 0: never.
    """

    models: dict[str, Path]
    device: str = "cpu"
    max_num_seqs: int = 64
    max_snapshots: int = 8
    checkpoint_dir: Path = Path("tinker_checkpoints")
    merged_exports: bool = False
    micro_batch_tokens: int = 0
    quantization: str = "none"
    session_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        self.checkpoint_dir = Path(self.checkpoint_dir)  # a str from a caller that is not the CLI
        if self.micro_batch_tokens < 0:
            raise ValueError(f"--micro-batch-tokens={self.micro_batch_tokens} must be >= 0 (0: no limit)")
        if not self.session_timeout_s >= 0:  # NaN fails too
            raise ValueError(f"--session-timeout-s={self.session_timeout_s} must be >= 0 (0: sessions never expire)")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization {self.quantization}: valid: {', '.join(QUANTIZATIONS)}")
        if self.quantization == "nf4" and importlib.util.find_spec("torchao") is None:
            raise ValueError("--quantization nf4 needs torchao: pip install -c constraints.txt -e '.[memory]'")


def model_map(specs: list[str]) -> dict[str, Path]:
    """`--model` values, each `NAME=PATH` or `PATH` (served under the path as written), as name -> directory."""
    models: dict[str, Path] = {}
    for spec in specs:
        name, _, path = spec.rpartition("=")
        name = name or path
        if not path or name in models:
            raise ValueError(f"--model {spec!r}: give NAME=PATH or PATH, each name once (served so far: "
                             f"{sorted(models)})")
        models[name] = Path(path)
    return models

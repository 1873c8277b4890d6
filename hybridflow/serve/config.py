"""What `hybridflow serve` was started with: `ServeConfig`, checked when built, and `model_map` for `--model`."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hybridflow.config.model_schema import QUANTIZATIONS

if TYPE_CHECKING:
    import torch

DTYPES = ("auto", "bf16", "fp32")  # `--sampler-dtype` and `--train-dtype`


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
        data of waiting requests are packed into micro-batches within it (0: one batch, bounded by memory only;
        None: each training client's follows the device, `trainee.auto_micro_batch_tokens` at its creation).
    quantization: "nf4" stores the bases' projections in 4 bits for LoRA clients (`BaseModels`); "none" keeps fp32.
    session_timeout_s: a session whose client sent no heartbeat for this long is finished and its training clients
        released (`Sessions`); 0: never.
    sampler_dtype: the sampling engine's weights and KV cache: "bf16", "fp32", or "auto" (bf16 on CUDA, where the
        engine's flash attention and decode kernels need half precision; fp32 elsewhere, where its log-probs equal
        the fp32 trainer's).
    train_dtype: the training clients' compute precision: "bf16" (forward and backward under bf16 autocast over
        fp32 weights and optimizer state, as `hybridflow train` runs on CUDA), "fp32", or "auto" (bf16 on CUDA, fp32
        elsewhere, where the CPU tests hold the service's log-probs and losses to our fp32 algorithms').
    max_model_len: the sampling engine's tokens per sequence, prompt + sampled (0: the engine's default,
        min(max_position_embeddings, 4096)); its KV cache holds slots of this length, so a shorter one holds more
        sequences in the same memory.
    kv_cache_memory: the fraction of free device memory the sampling engine's KV cache may take when it is built
        (the first sample request of a base); the rest stays for the training clients' weights and activations.
    """

    models: dict[str, Path]
    device: str = "cpu"
    max_num_seqs: int = 64
    max_snapshots: int = 8
    checkpoint_dir: Path = Path("tinker_checkpoints")
    merged_exports: bool = False
    micro_batch_tokens: int | None = None
    quantization: str = "none"
    session_timeout_s: float = 300.0
    sampler_dtype: str = "auto"
    train_dtype: str = "auto"
    max_model_len: int = 0
    kv_cache_memory: float = 0.3

    def __post_init__(self) -> None:
        self.checkpoint_dir = Path(self.checkpoint_dir)  # a str from a caller that is not the CLI
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 0:
            raise ValueError(f"--micro-batch-tokens={self.micro_batch_tokens} must be >= 0 (0: no limit; leave it "
                             f"out to follow the device's free memory)")
        if not self.session_timeout_s >= 0:  # NaN fails too
            raise ValueError(f"--session-timeout-s={self.session_timeout_s} must be >= 0 (0: sessions never expire)")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization {self.quantization}: valid: {', '.join(QUANTIZATIONS)}")
        for flag, value in (("--sampler-dtype", self.sampler_dtype), ("--train-dtype", self.train_dtype)):
            if value not in DTYPES:
                raise ValueError(f"{flag} {value}: valid: {', '.join(DTYPES)}")
        if not 0.0 < self.kv_cache_memory < 1.0:  # NaN fails too
            raise ValueError(f"--kv-cache-memory={self.kv_cache_memory} must be a fraction of free memory in (0, 1)")
        if self.max_model_len < 0:
            raise ValueError(f"--max-model-len={self.max_model_len} must be >= 0 (0: the engine's default)")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs={self.max_num_seqs} must be >= 1")
        if self.quantization == "nf4" and importlib.util.find_spec("torchao") is None:
            raise ValueError("--quantization nf4 needs torchao: pip install -c constraints.txt -e '.[memory]'")

    def sampler_torch_dtype(self) -> torch.dtype:
        """The sampling engine's dtype: `sampler_dtype` with "auto" resolved by the device."""
        return self._torch_dtype(self.sampler_dtype)

    def train_torch_dtype(self) -> torch.dtype:
        """The training clients' compute dtype: `train_dtype` with "auto" resolved by the device."""
        return self._torch_dtype(self.train_dtype)

    def _torch_dtype(self, name: str) -> torch.dtype:
        import torch  # here: the CLI reads this module's choices before any torch import

        if name == "auto":
            name = "bf16" if torch.device(self.device).type == "cuda" else "fp32"
        return torch.bfloat16 if name == "bf16" else torch.float32


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

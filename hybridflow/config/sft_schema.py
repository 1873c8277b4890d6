"""The typed configuration of `hybridflow sft`: chat data, optimisation and the run.

`SFTConfig(model, data, optim, trainer)` is the root the loader takes through `schema=SFTConfig`; the model
and run sections are the RL ones (`ModelConfig`, `RunConfig`), with SFT defaults where they differ.
Cross-key checks are `hybridflow.config.validate.validate_sft`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hybridflow.config.options import opt
from hybridflow.config.model_schema import ModelConfig, OptimConfig
from hybridflow.config.schema import RunConfig

SFT_TRUNCATION_MODES = ("error", "filter", "right")


@dataclass
class SFTDataConfig:
    """Rows to learn from, in TRL's SFT formats (conversations, prompt/completion, plain text; docs/sft.md)."""

    train_files: list[str] = opt([], "training conversation files: one path or a list (parquet or jsonl)")
    val_files: list[str] = opt([], "validation conversation files (val/loss); [] = no validation")
    messages_key: str = opt("messages", "column holding a conversation (a list of {role, content})")
    prompt_key: str = opt("prompt", "without messages_key: column of the prompt (a string, or messages); a dotted "
                                    "path reads a field of a dict column (extra_info.question: verl's gsm8k SFT data)")
    response_key: str = opt("completion", "without messages_key: column of the completion learnt (a string, or "
                                          "messages continuing the prompt's: TRL's prompt/completion)")
    text_key: str = opt("text", "without messages_key or prompt_key: column of plain text learnt whole (TRL's "
                                "language-modeling format)")
    max_length: Optional[int] = opt(1024, "longest conversation in tokens; null = no limit")
    truncation: str = opt("error", "conversations over max_length: refuse, drop, or keep the first tokens",
                          SFT_TRUNCATION_MODES)
    train_batch_size: int = opt(32, "conversations per training step")
    val_batch_size: Optional[int] = opt(None, "conversations per validation forward batch; null = all")
    shuffle: bool = opt(True, "shuffle conversations each epoch (seeded)")
    seed: Optional[int] = opt(None, "shuffling seed; null = trainer.seed")


@dataclass
class SFTOptimConfig(OptimConfig):
    """Optimisation of the model (AdamW, lr schedule, micro-batching and packing)."""

    lr: float = opt(1e-5, "peak learning rate")
    mini_batch_size: Optional[int] = opt(None, "conversations per optimizer step; null = the whole batch")
    micro_batch_size: Optional[int] = opt(None, "conversations per forward per rank; null = all of the rank's")
    max_tokens_per_micro_batch: Optional[int] = opt(None, "token budget per forward (rows packed up to it; "
                                                          "overrides micro_batch_size); null with micro_batch_size "
                                                          "null = sized from the device budget on a GPU, all of the "
                                                          "rank's rows on a CPU")
    passes_per_batch: int = opt(1, "passes over each step's batch (each pass one optimizer step per mini-batch)")


@dataclass
class SFTTrainerConfig(RunConfig):
    """The run: length, seed, outputs, backend, validation, checkpoints and logging."""

    output_dir: str = opt("outputs/sft", "where metrics, checkpoints and the final model (hf/) go")
    val_every: int = opt(0, "compute val/loss every this many steps; 0 = only after the last step")
    val_before_train: bool = opt(False, "compute val/loss once before the first step")


@dataclass
class SFTConfig:
    """Everything `hybridflow sft` reads."""

    model: ModelConfig = opt(ModelConfig, "the model to fine-tune")
    data: SFTDataConfig = opt(SFTDataConfig, "conversation data")
    optim: SFTOptimConfig = opt(SFTOptimConfig, "optimisation")
    trainer: SFTTrainerConfig = opt(SFTTrainerConfig, "the run")

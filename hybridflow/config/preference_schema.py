"""The typed configurations of `hybridflow dpo` (offline preference optimisation of a policy) and `hybridflow rm`
(Bradley–Terry reward-model training): preference pairs, optimisation, the loss, and the run.

`DPOConfig(model, data, optim, dpo, trainer)` and `RewardModelTrainConfig(model, data, optim, rm, trainer)` are
roots the loader takes through `schema=`; the model and run sections are the RL ones. Cross-key checks are
`hybridflow.config.validate.validate_sft` (the same program shape, a pair being two rows) and `preference_problems`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from hybridflow.config.options import opt, registered
from hybridflow.config.model_schema import EngineOptimConfig, ModelConfig
from hybridflow.config.schema import RunConfig

PREFERENCE_TRUNCATION_MODES = ("error", "filter")


@dataclass
class PreferenceDataConfig:
    """Preference pairs (TRL's format: prompt, chosen, rejected; conversational or plain)."""

    train_files: list[str] = opt([], "training pair files: one path or a list (parquet or jsonl)")
    val_files: list[str] = opt([], "validation pair files (val/loss, val/<kind>/margin and accuracy); [] = none")
    prompt_key: str = opt("prompt", "column of the prompt (chat messages or a string)")
    chosen_key: str = opt("chosen", "column of the preferred completion (messages continuing the prompt, or a "
                                    "string)")
    rejected_key: str = opt("rejected", "column of the other completion")
    max_length: Optional[int] = opt(1024, "most tokens of one side of a pair (prompt + completion); null = no "
                                          "limit")
    truncation: str = opt("error", "pairs whose longer side is over max_length: refuse, or drop",
                          PREFERENCE_TRUNCATION_MODES)
    train_batch_size: int = opt(32, "pairs per training step")
    val_batch_size: Optional[int] = opt(None, "pairs per validation forward batch (and per batch of the "
                                              "reference pass); null = all")
    shuffle: bool = opt(True, "shuffle pairs each epoch (seeded)")
    seed: Optional[int] = opt(None, "shuffling seed; null = trainer.seed")


@dataclass
class DPODataConfig(PreferenceDataConfig):
    """Preference pairs (TRL's format: prompt, chosen, rejected; conversational or plain)."""

    apply_chat_template: bool = opt(True, "render pairs with the tokenizer's chat template, as RL prompts are (plain "
                                          "strings become a user and an assistant turn); false: plain text, each "
                                          "completion followed by the eos token")


@dataclass
class PreferenceOptimConfig(EngineOptimConfig):
    """Optimisation of the model (AdamW, lr schedule, micro-batching and packing); a pair's two sequences always
    share a micro-batch."""

    lr: float = opt(1e-6, "peak learning rate")
    mini_batch_size: Optional[int] = opt(None, "pairs per optimizer step; null = the whole batch")
    micro_batch_size: Optional[int] = opt(None, "pairs per forward per rank; null = all of the rank's")
    max_tokens_per_micro_batch: Optional[int] = opt(None, "token budget per forward, both sides of a pair counted "
                                                          "(pairs packed up to it; overrides micro_batch_size); "
                                                          "null with micro_batch_size null = sized from the device "
                                                          "budget on a GPU, all of the rank's pairs on a CPU")
    passes_per_batch: int = opt(1, "passes over each step's batch (each pass one optimizer step per mini-batch)")


@dataclass
class DPOLossConfig:
    """The preference loss and its coefficients."""

    loss_type: str = opt("sigmoid", "sigmoid (DPO), ipo, simpo, orpo, or a loss registered with "
                                    "register_preference_loss; sigmoid and ipo compare with the reference (the "
                                    "starting model, whose log-probs are computed once before training), simpo "
                                    "and orpo need none", registered("PREFERENCE_LOSSES"))
    beta: float = opt(0.1, "beta: the inverse temperature of sigmoid and simpo (SimPO's paper uses 2-2.5), the "
                           "regularisation of ipo (the target margin is 1/(2 beta)), the odds-ratio weight of orpo")
    simpo_gamma: float = opt(0.5, "simpo: the target reward margin gamma")


@dataclass
class RewardModelLossConfig:
    """The Bradley–Terry loss of the reward model."""

    center_coef: float = opt(0.0, "weight of mean((score_chosen + score_rejected)^2), which keeps the scores "
                                  "centred on 0 (TRL's center_rewards_coefficient); 0 = off")


@dataclass
class PreferenceTrainerConfig(RunConfig):
    """The run: length, seed, outputs, backend, validation, checkpoints and logging."""

    output_dir: str = opt("outputs/dpo", "where metrics, checkpoints and the final model (hf/) go")
    val_before_train: bool = opt(False, "validate once before the first step")


@dataclass
class RewardModelTrainerConfig(PreferenceTrainerConfig):
    """The run: length, seed, outputs, backend, validation, checkpoints and logging."""

    output_dir: str = opt("outputs/rm", "where metrics, checkpoints and the final reward model (hf/) go")


@dataclass
class DPOConfig:
    """Everything `hybridflow dpo` reads."""

    model: ModelConfig = opt(ModelConfig, "the policy to train (and the reference it starts as)")
    data: DPODataConfig = opt(DPODataConfig, "preference pairs")
    optim: PreferenceOptimConfig = opt(PreferenceOptimConfig, "optimisation")
    dpo: DPOLossConfig = opt(DPOLossConfig, "the preference loss")
    trainer: PreferenceTrainerConfig = opt(PreferenceTrainerConfig, "the run")


@dataclass
class RewardModelTrainConfig:
    """Everything `hybridflow rm` reads."""

    model: ModelConfig = opt(ModelConfig, "the model to start from (a causal LM; its score head starts fresh)")
    data: PreferenceDataConfig = opt(PreferenceDataConfig, "preference pairs")
    optim: PreferenceOptimConfig = opt(PreferenceOptimConfig, "optimisation")
    rm: RewardModelLossConfig = opt(RewardModelLossConfig, "the reward-model loss")
    trainer: RewardModelTrainerConfig = opt(RewardModelTrainerConfig, "the run")


def preference_problems(cfg: Any) -> list[str]:
    """What `validate_sft` does not check of a `DPOConfig` / `RewardModelTrainConfig`."""
    problems = []
    if hasattr(cfg, "dpo") and cfg.dpo.beta <= 0:
        problems.append(f"dpo.beta={cfg.dpo.beta} must be > 0")
    if hasattr(cfg, "rm"):
        if cfg.rm.center_coef < 0:
            problems.append(f"rm.center_coef={cfg.rm.center_coef} must be >= 0")
        if cfg.optim.lora.rank > 0:
            problems.append(f"optim.lora.rank={cfg.optim.lora.rank}: reward-model training trains every weight "
                            f"(a LoRA reward model could not be exported as a sequence classifier); use 0")
    return problems

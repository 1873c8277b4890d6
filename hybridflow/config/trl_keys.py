"""TRL's config names (`GRPOConfig`, `DPOConfig`, `SFTConfig` and the `TrainingArguments` they extend) and
their hybridflow keys, for the loader's did-you-mean: ``beta=0.04`` is refused with "in hybridflow it is
'actor.kl_loss_coef'" (`hybridflow train`) or "'dpo.beta'" (`hybridflow dpo`), not a spelling neighbour.

`TRL_KEYS` is the one table: for each TRL name, the candidates ``(our key, note)`` in order; the first whose
key the command's config has is the answer, and a candidate whose key is None says why there is none.
"""

from __future__ import annotations

from collections.abc import Collection

Candidate = tuple[str | None, str]

_PER_STEP = ("prompts per step (RL: TRL's completions per generation batch / num_generations, over all GPUs "
             "and accumulation steps)")
_PAIRS_PER_STEP = "rows per step: TRL's per-device batch × gradient_accumulation_steps × GPUs"

TRL_KEYS: dict[str, tuple[Candidate, ...]] = {
    "beta": (("actor.kl_loss_coef", "GRPO's KL coefficient (0: no reference model)"),
             ("dpo.beta", "DPO's temperature of the implicit reward")),
    "num_generations": (("rollout.n", "completions sampled per prompt"),),
    "max_completion_length": (("data.max_response_length", ""),
                              ("data.max_length", "it bounds prompt + completion together")),
    "max_prompt_length": (("data.max_prompt_length", ""),
                          ("data.max_length", "it bounds prompt + completion together")),
    "max_length": (("data.max_length", ""),
                   ("data.max_response_length", "with data.max_prompt_length: RL bounds each part")),
    "max_seq_length": (("data.max_length", "TRL's older name of max_length"),),
    "learning_rate": (("actor.lr", ""), ("optim.lr", "")),
    "per_device_train_batch_size": (("data.train_batch_size", _PER_STEP),),
    "gradient_accumulation_steps": (("data.train_batch_size", _PER_STEP),),
    "generation_batch_size": (("data.train_batch_size", _PER_STEP),),
    "per_device_eval_batch_size": (("data.val_batch_size", ""),),
    "steps_per_generation": (("actor.mini_batch_size", "optimizer steps per batch = "
                                                      "data.train_batch_size / actor.mini_batch_size"),),
    "num_iterations": (("actor.ppo_epochs", "passes over each generation batch"),
                       ("optim.passes_per_batch", "")),
    "num_train_epochs": (("trainer.total_epochs", ""),),
    "max_steps": (("trainer.total_steps", ""),),
    "epsilon": (("actor.clip_low", "the lower clip range"),),
    "epsilon_high": (("actor.clip_high", ""),),
    "loss_type": (("actor.loss_agg", "grpo = seq-mean-token-mean, dapo/bnpo = token-mean, dr_grpo = "
                                     "seq-mean-token-sum-norm with algorithm.norm_adv_by_std=false"),
                  ("dpo.loss_type", "")),
    "scale_rewards": (("algorithm.norm_adv_by_std", "group/true = true, none/false = false"),),
    "importance_sampling_level": (("actor.policy_loss", "sequence = gspo"),),
    "temperature": (("rollout.temperature", ""),),
    "top_p": (("rollout.top_p", ""),),
    "top_k": (("rollout.top_k", ""),),
    "reward_funcs": (("reward.functions", ""),),
    "reward_weights": (("reward.weights", ""),),
    "output_dir": (("trainer.output_dir", ""),),
    "seed": (("trainer.seed", ""),),
    "save_steps": (("trainer.save_every", ""),),
    "save_total_limit": (("trainer.keep_checkpoints", ""),),
    "eval_steps": (("trainer.val_every", "with data.val_files"),),
    "report_to": (("trainer.loggers", "console, jsonl, tensorboard, wandb"),),
    "run_name": (("trainer.experiment_name", ""),),
    "lr_scheduler_type": (("actor.lr_schedule", ""), ("optim.lr_schedule", "")),
    "warmup_steps": (("actor.lr_warmup_steps", ""), ("optim.lr_warmup_steps", "")),
    "weight_decay": (("actor.weight_decay", ""), ("optim.weight_decay", "")),
    "max_grad_norm": (("actor.grad_clip", ""), ("optim.grad_clip", "")),
    "adam_beta1": (("actor.betas", "[beta1, beta2]"), ("optim.betas", "[beta1, beta2]")),
    "adam_beta2": (("actor.betas", "[beta1, beta2]"), ("optim.betas", "[beta1, beta2]")),
    "gradient_checkpointing": (("model.gradient_checkpointing", ""),),
    "bf16": (("model.dtype", "auto = bf16 on a GPU"),),
    "model_name_or_path": (("model.path", ""),),
    "dataset_name": (("data.train_files", "export the dataset to parquet or jsonl first"),),
    "use_vllm": ((None, "rollout uses hybridflow's own engine in the training processes (rollout.engine)"),),
    "logging_steps": ((None, "every step is logged"),),
    "completion_only_loss": ((None, "prompt/completion rows always train on the completion only (docs/sft.md)"),),
    "assistant_only_loss": ((None, "conversations always train on the assistant turns only (docs/sft.md)"),),
    "dataset_text_field": ((None, "a `text` column is read as plain text (docs/sft.md)"),),
}


def trl_hint(key: str, known: Collection[str]) -> str | None:
    """What an unknown `key` is when it is one of TRL's names: ``"TRL's name; in hybridflow it is
    'rollout.n' (...)"``, or why there is none; None when it is not TRL's. A dotted key's last part counts
    when no key of ours ends with it (``actor.learning_rate`` is TRL's; ``actor.temperature`` a misplaced
    ``rollout.temperature``, the spelling did-you-mean's to answer)."""
    leaf = key.rsplit(".", 1)[-1]
    candidates = TRL_KEYS.get(key)
    if candidates is None and not any(k.rsplit(".", 1)[-1] == leaf for k in known):
        candidates = TRL_KEYS.get(leaf)
    if candidates is None:
        return None
    for ours, note in candidates:
        if ours is None or ours in known:
            detail = f" ({note})" if note else ""
            if ours is None:
                return f"TRL's name; hybridflow has no key for it: {note}"
            return f"TRL's name; in hybridflow it is '{ours}'{detail}"
    return f"TRL's name; this command has no equivalent (elsewhere: {', '.join(repr(o) for o, _ in candidates)})"

"""verl's SFT trainer keys (``verl.trainer.fsdp_sft_trainer`` / ``verl.trainer.sft_trainer``) and what each one
is in `hybridflow sft` (`hybridflow.config.sft_schema`): the table `hybridflow migrate` uses for an SFT script,
shaped like `hybridflow.config.verl_keys.VERL_KEYS`.

torchrun's ``--nproc_per_node`` / ``--nnodes`` (verl's SFT takes its world size from them) arrive as the keys
``torchrun.nproc_per_node`` / ``torchrun.nnodes``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridflow.config.verl_keys import VerlKey, loggers, map_values, negative_is_off, resume, same, truthy

SCHEDULES = {"constant": "constant", "cosine": "cosine"}


def _workers(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    per_node = given.get("torchrun.nproc_per_node", given.get("trainer.n_gpus_per_node", 8))
    nodes = given.get("torchrun.nnodes", given.get("trainer.nnodes", 1))
    try:
        return {"trainer.n_workers": int(per_node) * int(nodes)}
    except (TypeError, ValueError):
        raise ValueError(f"processes per node {per_node!r} x nodes {nodes!r} is not a number; set "
                         f"trainer.n_workers") from None


def _messages(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    return {"data.messages_key": given.get("data.multiturn.messages_key", "messages")} if truthy(value) else {}


def _nested(side: str) -> Any:
    """verl's `data.{side}_key` with its `data.{side}_dict_keys` (the fields to walk into a dict column, in order) as one
    dotted path, which our data reads through nested mappings (`Record.require`): `extra_info` with `[question]` is
    `extra_info.question`."""
    def convert(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
        column = given.get(f"data.{side}_key", VERL_SFT_DEFAULTS[f"data.{side}_key"])
        fields = given.get(f"data.{side}_dict_keys") or []
        fields = [fields] if isinstance(fields, str) else list(fields)
        return {f"data.{side}_key": ".".join([str(column), *map(str, fields)])}
    return convert


def _truncation(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    if value not in ("error", "right"):
        raise ValueError(f"truncation={value!r}: hybridflow sft has error, filter, right")
    return {"data.truncation": value}


VERL_SFT_KEYS: dict[str, VerlKey] = {
    **same({k: k for k in ("data.train_files", "data.val_files",
                            "data.max_length", "data.train_batch_size", "optim.lr", "optim.betas",
                            "optim.weight_decay", "optim.min_lr_ratio", "trainer.project_name",
                            "trainer.experiment_name", "trainer.total_epochs", "trainer.seed")}),
    **same({"model.partial_pretrain": "model.path", "model.path": "model.path",
             "model.trust_remote_code": "model.trust_remote_code",
             "model.enable_gradient_checkpointing": "model.gradient_checkpointing",
             "model.lora_rank": ("optim.lora.rank", "0 = no LoRA"), "model.lora_alpha": "optim.lora.alpha",
             "model.target_modules": "optim.lora.target_modules", "optim.clip_grad": "optim.grad_clip",
             "data.micro_batch_size_per_gpu": ("optim.micro_batch_size", "conversations per forward per rank"),
             "data.micro_batch_size": ("optim.micro_batch_size", "conversations per forward per rank"),
             "use_remove_padding": "optim.use_packing", "model.use_remove_padding": "optim.use_packing",
             "trainer.default_local_dir": "trainer.output_dir", "trainer.total_training_steps": "trainer.total_steps",
             "trainer.max_ckpt_to_keep": "trainer.keep_checkpoints"}),
    "optim.warmup_style": VerlKey("optim.lr_schedule", "constant or cosine", map_values("optim.lr_schedule", SCHEDULES)),
    "optim.lr_scheduler": VerlKey("optim.lr_schedule", "constant or cosine", map_values("optim.lr_schedule", SCHEDULES)),
    "optim.lr_scheduler_type": VerlKey("optim.lr_schedule", "constant or cosine",
                                       map_values("optim.lr_schedule", SCHEDULES)),
    "data.messages_key": VerlKey("data.messages_key", "verl's engine SFT trainer: each row's conversation"),
    "optim.lr_warmup_steps_ratio": VerlKey(None, "give the warm-up in optimizer steps: optim.lr_warmup_steps"),
    "data.multiturn.enable": VerlKey("data.messages_key", "True reads each row's conversation from "
                                     "multiturn.messages_key", _messages),
    "data.multiturn.messages_key": VerlKey("data.messages_key", "with multiturn.enable=True", lambda v, g: {}),
    **{f"data.{side}{suffix}": VerlKey(f"data.{side}_key", f"with data.{side}_dict_keys: a dotted path into the "
                                       "dict column", _nested(side))
       for side in ("prompt", "response") for suffix in ("_key", "_dict_keys")},
    "data.truncation": VerlKey("data.truncation", "error or right", _truncation),
    "ulysses_sequence_parallel_size": VerlKey(None, "no sequence parallelism: each rank holds whole sequences"),
    "trainer.logger": VerlKey("trainer.loggers", "console, jsonl, tensorboard and wandb are carried", loggers),
    "trainer.save_freq": VerlKey("trainer.save_every", "-1 becomes 0 (only at the end)",
                                 negative_is_off("trainer.save_every")),
    "trainer.test_freq": VerlKey("trainer.val_every", "-1 becomes 0 (only after the last step)",
                                 negative_is_off("trainer.val_every")),
    "trainer.resume_mode": VerlKey("trainer.resume", "auto, never (disable), or a checkpoint path", resume),
    "trainer.resume_from_path": VerlKey("trainer.resume", "with resume_mode=resume_path", lambda v, g: {}),
    "torchrun.nproc_per_node": VerlKey("trainer.n_workers", "nproc_per_node x nnodes processes", _workers),
    "torchrun.nnodes": VerlKey("trainer.n_workers", "nproc_per_node x nnodes processes", _workers),
    "trainer.n_gpus_per_node": VerlKey("trainer.n_workers", "nproc_per_node x nnodes processes", _workers),
    "trainer.nnodes": VerlKey("trainer.n_workers", "nproc_per_node x nnodes processes", _workers),
}

# verl's SFT defaults that differ from hybridflow sft's: a migrated recipe sets them unless the script does.
# verl's FSDP SFT trainer (`fsdp_sft_trainer`, sft_trainer.yaml), and its engine SFT trainer (`sft_trainer`,
# sft_trainer_engine.yaml), whose rows are conversations under `messages`
VERL_SFT_DEFAULTS = {"data.train_batch_size": 256, "data.micro_batch_size_per_gpu": 4, "trainer.total_epochs": 4,
                     "data.prompt_key": "question", "data.response_key": "answer", "optim.weight_decay": 0.01,
                     "optim.betas": [0.9, 0.95], "optim.lr_scheduler": "cosine"}
VERL_SFT_ENGINE_DEFAULTS = {"data.train_batch_size": 256, "data.micro_batch_size_per_gpu": 4, "trainer.total_epochs": 4,
                            "data.messages_key": "messages", "optim.weight_decay": 0.01, "optim.lr": 1e-3,
                            "optim.lr_scheduler_type": "constant"}

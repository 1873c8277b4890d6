"""Training on preference pairs: `DPOTrainer` (`hybridflow dpo`) and `RewardModelTrainer` (`hybridflow rm`).

    hybridflow dpo --config recipes/preference/dpo.yaml model.path=SFT_MODEL data.train_files=pairs.jsonl
    hybridflow rm --config recipes/preference/reward_model.yaml model.path=MODEL data.train_files=pairs.jsonl

Both read TRL-format pairs (`prompt`, `chosen`, `rejected`: `hybridflow.data.preference_data`) and train one
`PreferenceWorker` group (`hybridflow.workers.preference_worker`) with the FSDP2 `TrainEngine`: a pair's two sequences
share a micro-batch, packed on a GPU like SFT's. Checkpoints, resume, metric sinks and the final Hugging Face
directory under `<trainer.output_dir>/hf` are the SFT trainer's.

- DPO trains the policy on `dpo.loss_type` (sigmoid, ipo, simpo, orpo). The losses that compare with a reference
  get its summed log-probs of every pair, computed once before the first step by the starting model itself
  (`ReferenceLogps`: no second model is held; a LoRA policy's starting model is its base weights) and kept in
  the checkpoints, so a resumed run reads the same values.
- The reward model is the starting model with a one-output score head (`head="score"`), trained with the
  Bradley–Terry loss; `hf/` is a `...ForSequenceClassification` directory, ready for
  `hybridflow train reward.reward_model.path=<that>`.

Validation (`data.val_files`) scores every validation pair with the model and computes the loss and the pair
metrics here, with the same pure functions the workers train on (`hybridflow.algorithms.preference_losses`).
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from hybridflow.algorithms import bradley_terry_loss, compute_preference_loss, preference_needs_reference
from hybridflow.batch import Batch
from hybridflow.config.commands import validate_preference
from hybridflow.controller import Remote
from hybridflow.data.chat import pad_token_id
from hybridflow.data.loader import BatchLoader
from hybridflow.data.preference_data import (PreferenceDataset, collate_policy_pairs, collate_scored_pairs,
                                             encode_policy_pair, encode_scored_pair, pair_tokens)
from hybridflow.tracking.metrics import timer
from hybridflow.trainer.memory import sft_demand
from hybridflow.trainer.role_configs import preference_config
from hybridflow.trainer.single_model import SingleModelTrainer
from hybridflow.workers.preference_worker import PreferenceWorker


class ReferenceLogps:
    """The reference's summed log-probs `[pairs, 2]` (chosen, rejected) of every pair of a dataset, by its
    index; `state_dict` / `load_state_dict` keep them in a checkpoint."""

    def __init__(self, size: int) -> None:
        self.values = torch.full((size, 2), float("nan"))

    @property
    def ready(self) -> bool:
        return not bool(self.values.isnan().any())

    def fill(self, loader: BatchLoader, workers: Remote[PreferenceWorker]) -> None:
        """Scores every pair of `loader` (in file order) with `workers`' current model."""
        for batch in loader:
            values = workers.score_pairs(batch)
            self.values[torch.as_tensor(list(batch["index"]))] = torch.stack([values["chosen"], values["rejected"]], 1)

    def attach(self, batch: Batch) -> Batch:
        """`batch` with `ref_chosen_logps` / `ref_rejected_logps` `[P]` of its pairs."""
        ref = self.values[torch.as_tensor(list(batch["index"]))]
        return batch.union(Batch({"ref_chosen_logps": ref[:, 0].contiguous(),
                                  "ref_rejected_logps": ref[:, 1].contiguous()}))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"values": self.values}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state["values"].shape != self.values.shape:
            raise ValueError(f"the checkpoint's reference log-probs cover {len(state['values'])} pairs, the data "
                             f"{len(self.values)}: the run's data files changed")
        self.values = state["values"]


class PreferenceTrainer(SingleModelTrainer[PreferenceWorker]):
    """What `hybridflow dpo` and `hybridflow rm` share (see the module docstring); a subclass says its head,
    how a pair is tokenized (`encode`) and its validation metrics (`pair_metrics`); its loss section is the worker's
    (`hybridflow.trainer.role_configs.preference_config`)."""

    kind: str  # the metric prefix: "dpo" or "rm"

    def __init__(self, cfg: Any) -> None:
        validate_preference(cfg)
        super().__init__(cfg)

    @classmethod
    @abstractmethod
    def encode(cls, cfg: Any, tokenizer: Any, prompt: Any, chosen: Any, rejected: Any) -> dict[str, list[int]]:
        """A dataset item of one pair (`encode_policy_pair` or `encode_scored_pair` with the run's tokenizer)."""

    @classmethod
    def collate(cls, pad_id: int) -> Callable[[Sequence[Any], int], Batch]:
        """The loaders' collate: a batch of pairs padded with `pad_id`."""
        rows = collate_policy_pairs if cls.model_head == "lm" else collate_scored_pairs
        return lambda items, epoch: rows(items, pad_id, epoch)

    @classmethod
    def in_order(cls, cfg: Any, dataset: PreferenceDataset, batch_size: int) -> BatchLoader:
        """Every pair of `dataset` once, in file order, `data.val_batch_size` at a time (null: `batch_size`)."""
        return BatchLoader(dataset, cfg.data.val_batch_size or batch_size, shuffle=False, drop_last=False,
                           collate=cls.collate(dataset.pad_token_id))

    @classmethod
    def build_loaders(cls, cfg: Any, tokenizer: Any) -> tuple[BatchLoader, BatchLoader | None]:
        data = cfg.data
        seed = data.seed if data.seed is not None else cfg.trainer.seed

        def dataset(files: list[str]) -> PreferenceDataset:
            return PreferenceDataset(files, tokenizer, partial(cls.encode, cfg, tokenizer), data.prompt_key,
                                     data.chosen_key, data.rejected_key, data.max_length, data.truncation)

        train = dataset(data.train_files)
        loader = BatchLoader(train, data.train_batch_size, seed, data.shuffle, collate=cls.collate(train.pad_token_id))
        if not data.val_files:
            return loader, None
        val = dataset(data.val_files)
        return loader, cls.in_order(cfg, val, len(val))

    @property
    def pad_id(self) -> int:
        """What pairs are padded with: the tokenizer's pad id (its eos id when it has none)."""
        return pad_token_id(self.tokenizer)

    def start_workers(self) -> None:
        cfg = self.cfg
        self.start_group(PreferenceWorker, preference_config(cfg, self.model_head, self.pad_id, self.schedule_steps(),
                                                             sft_demand(cfg, self.model_head, rows_per_example=2)))

    def prepare(self, batch: Batch, split: str) -> Batch:
        """What a batch of pairs of `split` (train or val) needs beyond the loader's (DPO: the reference's
        log-probs)."""
        return batch

    def train_step(self, batch: Batch) -> dict[str, float]:
        """Optimizer step(s) on a batch of pairs (`optim.passes_per_batch` x mini-batches)."""
        timings: dict[str, float] = {}
        with timer("step", timings):
            metrics = self.workers.train_batch(self.prepare(batch, "train"))
        metrics["perf/throughput"] = pair_tokens(batch) / timings["step"] / self.n_devices
        metrics["timing_s/step"] = timings["step"]
        self.bad_steps.update(self.step + 1, **{k: metrics[k] for k in ("train/loss", "train/grad_norm")})
        return metrics

    @abstractmethod
    def pair_metrics(self, batch: Batch, chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-pair `loss` and the kind's metrics (`margin`, `accuracy`, ...) `[P]` of scored pairs."""

    def validate(self) -> dict[str, float]:
        """`val/loss` and `val/<kind>/...`: means over the validation pairs."""
        start = time.perf_counter()
        sums: dict[str, float] = {}
        pairs = 0
        for batch in self.validation_batches():
            batch = self.prepare(batch, "val")
            values = self.workers.score_pairs(batch)
            for name, v in self.pair_metrics(batch, values["chosen"], values["rejected"]).items():
                sums[name] = sums.get(name, 0.0) + float(v.double().sum())
            pairs += len(batch)
        metrics = {f"val/{name}" if name == "loss" else f"val/{self.kind}/{name}": v / pairs
                   for name, v in sums.items()}
        metrics["timing_s/val"] = time.perf_counter() - start
        return metrics


def _summary(losses: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor, **more: torch.Tensor
             ) -> dict[str, torch.Tensor]:
    margin = chosen - rejected
    return {"loss": losses, "margin": margin, "accuracy": (margin > 0).float(), **more}


class DPOTrainer(PreferenceTrainer):
    """`hybridflow dpo` (a `DPOConfig`)."""

    model_role, kind = "dpo", "dpo"

    def __init__(self, cfg: Any) -> None:
        self.reference: dict[str, ReferenceLogps] = {}
        super().__init__(cfg)
        try:
            self.fill_reference()
        except BaseException:
            self.close()
            raise

    @classmethod
    def encode(cls, cfg: Any, tokenizer: Any, prompt: Any, chosen: Any, rejected: Any) -> dict[str, list[int]]:
        return encode_policy_pair(prompt, chosen, rejected, tokenizer, cfg.data.apply_chat_template)

    def start_workers(self) -> None:
        """The group, and a place for the reference's log-probs of each dataset when the loss compares with a
        reference (made here, before a resumed checkpoint's values are loaded into it)."""
        if preference_needs_reference(self.cfg.dpo.loss_type):
            self.reference = {"train": ReferenceLogps(len(self.train_loader.dataset))}
            if self.val_loader is not None:
                self.reference["val"] = ReferenceLogps(len(self.val_loader.dataset))
        super().start_workers()

    def checkpointed_state(self) -> dict[str, Any]:
        return {**super().checkpointed_state(), **{f"reference_{k}": v for k, v in self.reference.items()}}

    def fill_reference(self) -> None:
        """The reference log-probs of every pair, by the starting model, unless a resumed checkpoint held them."""
        if not self.reference or all(r.ready for r in self.reference.values()):
            return
        start = time.perf_counter()
        for name, reference in self.reference.items():
            reference.fill(self.in_order(self.cfg, self.train_loader.dataset, self.cfg.data.train_batch_size)
                           if name == "train" else self.validation_batches(), self.workers)
        seconds = time.perf_counter() - start
        print(f"reference log-probs of {sum(len(r.values) for r in self.reference.values())} pairs in {seconds:.1f} s",
              flush=True)
        assert self.tracker is not None  # Trainer.__init__ built it before this runs
        self.tracker.log({"timing_s/reference": seconds}, self.step)

    def prepare(self, batch: Batch, split: str) -> Batch:
        return self.reference[split].attach(batch) if self.reference else batch

    def pair_metrics(self, batch: Batch, chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
        d = self.cfg.dpo
        options: dict[str, Any] = {"beta": d.beta, "simpo_gamma": d.simpo_gamma}
        if "ref_chosen_logps" in batch:
            options.update(ref_chosen_logps=batch["ref_chosen_logps"], ref_rejected_logps=batch["ref_rejected_logps"])
        out = compute_preference_loss(d.loss_type, chosen, rejected, batch["chosen_mask"].sum(-1),
                                      batch["rejected_mask"].sum(-1), **options)
        return _summary(out.losses, out.chosen_rewards, out.rejected_rewards,
                        **{"rewards/chosen": out.chosen_rewards, "rewards/rejected": out.rejected_rewards})


class RewardModelTrainer(PreferenceTrainer):
    """`hybridflow rm` (a `RewardModelTrainConfig`)."""

    model_role, model_head, kind = "reward_model", "score", "rm"

    @classmethod
    def encode(cls, cfg: Any, tokenizer: Any, prompt: Any, chosen: Any, rejected: Any) -> dict[str, list[int]]:
        return encode_scored_pair(prompt, chosen, rejected, tokenizer)

    def pair_metrics(self, batch: Batch, chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
        losses = bradley_terry_loss(chosen, rejected, center_coef=self.cfg.rm.center_coef)
        return _summary(losses, chosen, rejected, **{"score/chosen": chosen, "score/rejected": rejected})


def train_dpo(cfg: Any) -> dict[str, float]:
    """Runs `hybridflow dpo` for a loaded `DPOConfig`; returns the last step's metrics."""
    return DPOTrainer(cfg).fit()


def train_reward_model(cfg: Any) -> dict[str, float]:
    """Runs `hybridflow rm` for a loaded `RewardModelTrainConfig`; returns the last step's metrics."""
    return RewardModelTrainer(cfg).fit()

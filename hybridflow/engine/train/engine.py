"""`TrainEngine`: one model role (policy, reference or critic) sharded with FSDP2 in this process.

The engine owns the model, its optimizer and lr schedule, and the mechanics of a training step:
micro-batching (by row count or by a token budget, the same number of forwards on every rank),
packed or padded forwards that return per-response-token log-probs (+ entropy) or values, backward
with the loss scaled so data-parallel ranks *sum* their gradients, one gradient clip on the global norm
across all shards, and a step that is skipped (and counted) when that norm is not finite. What the loss
is belongs to the caller (`loss_fn`), so the engine knows nothing of PPO.

Inputs are plain `{key: Tensor [B, ...]}` dicts (a `Batch`'s `.tensors`) with `input_ids`,
`attention_mask`, optional `position_ids` (`[B, P+R]`) and `response_mask` (`[B, R]`); a vision-language model's rows
also `pixel_values` / `image_grid_thw` (`vision_forward`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hybridflow.config.model_schema import EngineOptimConfig, FrozenModelConfig, ModelConfig
from hybridflow.engine.budget import count
from hybridflow.engine.train import flops as flops_lib
from hybridflow.engine.train.attention import VARLEN_ATTENTION
from hybridflow.engine.train.collectives import all_reduce
from hybridflow.engine.train.compile import compile_model, resolve_compile
from hybridflow.engine.train.exact import make_exact, recompute_contexts
from hybridflow.engine.train.head import LogProbHead, teacher_targets
from hybridflow.engine.train.loss_context import LossContext, LossFn
from hybridflow.engine.train.lora import apply_lora, frozen_weights
from hybridflow.engine.train.microbatch import (agree_count, count_micro_batches, group_lengths, group_rows,
                                                split_rows, take_rows)
from hybridflow.engine.train.model import load_model, mark_inputs_require_grad, resolve_precision
from hybridflow.engine.train.quantized_base import quantize_base
from hybridflow.engine.train.offload import move_optimizer, move_params
from hybridflow.engine.train.optim import build_optimizer, build_scheduler
from hybridflow.engine.train.packing import build_inputs, to_device
from hybridflow.engine.train.parallel import dp_mesh, full_tensor, shard_model
from hybridflow.engine.train.router_replay import RouterHooks, flat_routes, require_spec
from hybridflow.engine.train.vision_forward import freeze_tower, has_images, vision_kwargs, vision_tower


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class TrainEngine:
    """A Hugging Face model under FSDP2 (when torch.distributed is initialised with more than one rank,
    or, without LoRA, the compute dtype differs from the master weights) on this rank's device, its decoder
    layers compiled where `model.compile` says so (`compile.py`), with LoRA adapters where the trained
    role's `lora.rank` > 0 (`lora.py`: only they train; `adapters` is None without), their frozen base weights in
    4 bits with `model.quantization=nf4` (`quantized_base.py`).

    Args:
        model_cfg: the model's section (`path`, `dtype`, `compile`, `attn_implementation`, `trust_remote_code`;
            a trained model's `ModelConfig` also `master_dtype` and `gradient_checkpointing`: None counts as off).
            A frozen model (a reference, a distillation teacher) may take a `FrozenModelConfig`.
        optim_cfg: the trained role's section (an actor, critic, SFT or preference `EngineOptimConfig`:
            `optimizer`, lr, schedule, `grad_clip`, `lora`, ...), or None for a frozen model.
        head: ``"lm"`` (log-probs), ``"value"`` (critic values) or ``"score"`` (a reward model's, read as values).
        total_steps: optimizer steps the lr schedule spans.
        pack_on_cpu: honour `pack=True` on a CPU device too (by default CPU forwards stay padded).
        seed: seeds what the model directory does not hold (LoRA adapters, a value head), so it starts the same
            in every run and on every rank (`trainer.seed`).
        exact_len: exact mode (`rollout.exact`, an `lm` head): the forward runs the rollout engine's
            batch-invariant ops (`exact.make_exact`), packed on every device, its layers not compiled (where
            `model.compile` resolves on, only the backward formulas and the head's entropy are), for rows of at
            most this many tokens; None = the default forward.
        router: a mixture of experts' router hooks (`router_replay.RouterHooks`: the actor's `rollout.record_routes`,
            `actor.router_replay` and `actor.router_aux_loss_coef`): from the first forward on, a micro-batch's
            `rollout_routes` are replayed (`router.replay`) and compared with the experts used, and
            `router.aux_loss_coef` > 0 adds that multiple of the routers' load-balancing loss to each update's
            loss; None = no hooks.
        images: the rows carry images (`RunFacts.vision`): a Qwen3.5 checkpoint loads with its vision tower
            (`load_model`).
    """

    def __init__(self, model_cfg: FrozenModelConfig, optim_cfg: EngineOptimConfig | None = None, *,
                 head: str = "lm", total_steps: int = 1, device: torch.device | None = None,
                 pack_on_cpu: bool = False, seed: int = 0, exact_len: int | None = None,
                 router: RouterHooks.Config | None = None, images: bool = False) -> None:
        self.device = torch.device(device) if device is not None else _default_device()
        # Packing pays on CUDA (varlen flash attention, no padded work). On a CPU the padded forward
        # is faster (docs/benchmarks.md, "Measurements behind choices in the code"), so `pack` is
        # honoured there only with `pack_on_cpu` (tests use it to check packed == padded); exact mode's
        # attention takes packed rows only.
        self.exact = exact_len is not None
        self.pack_allowed = self.device.type == "cuda" or pack_on_cpu or self.exact
        self.head = head
        self.trainable = optim_cfg is not None
        trained = model_cfg if isinstance(model_cfg, ModelConfig) else None
        if self.trainable and trained is None:
            raise TypeError(f"a trained model takes a ModelConfig (master_dtype, gradient_checkpointing), got "
                            f"{type(model_cfg).__name__}")
        if trained is not None:
            self.precision = resolve_precision(model_cfg.dtype, self.device, self.trainable, trained.master_dtype)
        else:  # a frozen model's weights stay in the compute dtype: it has no master dtype
            self.precision = resolve_precision(model_cfg.dtype, self.device, trainable=False)
        self.distributed = dist.is_initialized()
        self.world_size = dist.get_world_size() if self.distributed else 1
        lora_cfg = optim_cfg.lora if optim_cfg is not None else None
        lora_cfg = lora_cfg if lora_cfg is not None and lora_cfg.rank > 0 else None  # rank 0: no adapters
        lora = lora_cfg is not None
        compile_on = resolve_compile(model_cfg.compile, self.device)
        if model_cfg.path is None:
            raise ValueError("TrainEngine loads its model from model_cfg.path (a Hugging Face model directory or hub "
                             "id); got path=None")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            # with LoRA the frozen weights are loaded, and stay, in the compute dtype; only adapters get a master copy
            model = load_model(model_cfg.path, head, self.precision.param if lora else self.precision.master,
                               model_cfg.attn_implementation, model_cfg.trust_remote_code,
                               self.trainable and trained is not None and bool(trained.gradient_checkpointing),
                               recompute_contexts if self.exact else None, images)
            # a vision-language model's tower stays as loaded unless `model.freeze_vision=false` (`vision_forward`)
            frozen_tower = vision_tower(model) if trained is not None and trained.freeze_vision else None
            self.adapters = apply_lora(model, lora_cfg, head, self.precision.master, skip=frozen_tower) \
                if lora_cfg is not None else None
            if frozen_tower is not None and self.adapters is None:
                freeze_tower(model, frozen_tower)
        self.quantized_params = 0  # base weights stored in 4 bits (`model.quantization=nf4`)
        if trained is not None and trained.quantization == "nf4":
            if self.adapters is None:
                raise ValueError("model.quantization=nf4 stores a LoRA model's frozen base in 4 bits; it needs "
                                 "lora.rank > 0")
            self.quantized_params = quantize_base({n: layer for n, layer in self.adapters.layers.items()
                                                   if not hasattr(layer, "parameter_name")}, self.device,
                                                  self.world_size)
        if exact_len is not None:
            make_exact(model, self.precision.param, exact_len, "inductor" if compile_on else None)
        # One rank: FSDP2 would shard nothing, only add its hooks (a measurable share of a small model's
        # update: docs/benchmarks.md), and with LoRA keep a gathered compute-dtype copy of every layer from
        # forward to backward (the frozen model twice). So one rank keeps a plain module in full precision and
        # with LoRA, whose mixed precision is then autocast's.
        self.sharded = self.distributed and (self.world_size > 1 or (self.precision.mixed and not lora))
        # in place (a module's `to` returns it); the cast: transformers' functools.wraps hides that `to` is a method
        cast(torch.nn.Module, model).to(self.device)
        if self.sharded:
            model = shard_model(model, dp_mesh(self.device), self.precision)
        self.model: torch.nn.Module = model
        # compiled layers fuse the elementwise ops around the invariant ones and change their rounding
        self.compiled = not self.exact and compile_on
        if self.compiled:
            compile_model(model)
            if self.adapters is not None and self.trainable:
                # one compiled graph per pass for every layer, the first included (docs/small_gpus.md)
                mark_inputs_require_grad(model)
        self.lm_head: LogProbHead | None = model.get_output_embeddings() if head == "lm" else None
        self.config = model.config
        self.has_dropout = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
        self.skipped_steps = 0
        self.optimizer_steps = 0  # steps that changed the weights (skipped ones did not)
        self.routing = RouterHooks(model, require_spec(self.config), router) if router is not None else None
        self.optimizer = self.scheduler = None
        if optim_cfg is not None:
            self.grad_clip = optim_cfg.grad_clip
            self.optimizer = build_optimizer(model.parameters(), optim_cfg, self.device)
            self.scheduler = build_scheduler(self.optimizer, optim_cfg, total_steps)
            model.train()
        else:
            model.requires_grad_(False)
            model.eval()

    # ------------------------------------------------------------------ forward
    def _autocast(self):
        if self.sharded or not self.precision.mixed:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.precision.param)

    def forward(self, mb: dict[str, torch.Tensor], temperature: float = 1.0, with_entropy: bool = False,
                pack: bool = True, soft_targets: float | None = None, topk: int = 0
                ) -> tuple[dict[str, torch.Tensor], int]:
        """One forward over micro-batch `mb`. Returns ({"log_probs", ["entropy"]} or {"values"}, each
        float32 `[B, R]` and zero off real response tokens; real tokens in the forward). `soft_targets` (a beta:
        1 reverse KL, 0 forward KL, between the generalized JSD): each response token's divergence between the
        policy and `mb`'s `teacher_topk_ids` at `teacher_topk_log_probs` (`[B, R, k]`: a teacher's top-k, the rest
        of its mass one more outcome) comes back as `topk_kl` (differentiable); `topk` > 0: also the k likeliest tokens of each
        position (`topk_ids` long and `topk_log_probs`, `[B, R, k]`)."""
        images = has_images(mb)
        pack = pack and self.pack_allowed and not images  # vision rows run padded (`vision_forward`)
        width = mb["response_mask"].shape[1] if "response_mask" in mb else mb["responses"].shape[1]
        position_ids = mb["position_ids"].cpu() if "position_ids" in mb else None
        # indices are built on the host (no device syncs), then moved once
        inputs = build_inputs(mb["input_ids"].cpu(), mb["attention_mask"].cpu(), width, position_ids, pack)
        soft = teacher_targets(inputs, mb, self.device) if soft_targets is not None else None
        inputs = inputs.to(self.device)
        if images:
            inputs.kwargs.update(vision_kwargs(self.model, inputs.kwargs["input_ids"], inputs.kwargs["attention_mask"],
                                               mb, self.precision.param))
        if self.routing is not None:
            self.routing.prepare(*flat_routes(mb, inputs.packed, self.device))
        if pack and self.config._attn_implementation != VARLEN_ATTENTION:
            raise ValueError(f"use_packing needs model attn_implementation='sdpa' (packed rows run varlen "
                             f"attention); this model uses {self.config._attn_implementation!r}")
        with self._autocast():
            if self.lm_head is not None:  # head="lm"
                keep, index = inputs.lm_keep()
                with self.lm_head.request(inputs.targets, index, temperature, with_entropy, soft,
                                          1.0 if soft_targets is None else soft_targets, topk) as req:
                    self.model(**inputs.kwargs, logits_to_keep=keep)
                out = req.outputs(inputs.unflatten)
            else:
                scores = self.model(**inputs.kwargs).logits.flatten(0, 1)[:, 0]
                out = {"values": inputs.unflatten(scores[inputs.positions])}
        return out, inputs.num_tokens

    def micro_batch_rows(self, batch: dict[str, torch.Tensor], micro_batch_size: int | None,
                         max_tokens: int | None, row_group: int = 1) -> list[list[int]]:
        """Row indices of each micro-batch; the same number of micro-batches on every rank. Runs of `row_group`
        consecutive rows share a micro-batch (`micro_batch_size` then counts runs)."""
        if batch["input_ids"].shape[0] == 0:
            raise ValueError("this rank got an empty batch; every data-parallel rank needs at least one row")
        lengths = group_lengths(batch["attention_mask"].sum(-1).tolist(), row_group)
        local = count_micro_batches(lengths, micro_batch_size, max_tokens)
        groups = split_rows(lengths, agree_count(local, self.device), by_tokens=max_tokens is not None)
        return groups if row_group == 1 else group_rows(groups, row_group)

    @torch.no_grad()
    def infer(self, batch: dict[str, torch.Tensor], micro_batch_size: int | None = None,
              max_tokens: int | None = None, temperature: float = 1.0, with_entropy: bool = False,
              pack: bool = True, row_group: int = 1, eager: bool = False, topk: int = 0) -> dict[str, torch.Tensor]:
        """Log-probs (+ entropy) or values for every row of `batch`, `[B, R]` float32 on the CPU; dropout
        (a LoRA adapter's, or the model's own) is off for these passes. `row_group`: as `micro_batch_rows`;
        `topk`: as `forward` (`[B, R, k]`).
        `eager`: compiled layers run uncompiled, for a one-off pass (DPO's reference log-probs), which would
        spend far longer compiling a no-grad graph than running (docs/preference.md)."""
        rows = batch["input_ids"].shape[0]
        outs: dict[str, torch.Tensor] = {}
        training = self.model.training
        if self.has_dropout:
            self.model.eval()
        stance = torch.compiler.set_stance("force_eager") if eager and self.compiled else contextlib.nullcontext()
        try:
            with stance:
                for g in self.micro_batch_rows(batch, micro_batch_size, max_tokens, row_group):
                    out, _ = self.forward(take_rows(batch, g), temperature, with_entropy, pack, topk=topk)
                    for k, v in out.items():
                        if k not in outs:
                            outs[k] = torch.zeros(rows, *v.shape[1:], dtype=v.dtype)
                        if g:
                            outs[k][torch.tensor(g)] = v.cpu()
        finally:
            self.model.train(training)
        return outs

    def compile_metrics(self) -> dict[str, float]:
        """`compiled`: 1 when the layers run compiled."""
        return {"compiled": float(self.compiled)}

    # ------------------------------------------------------------------ training
    def train_step(self, batch: dict[str, torch.Tensor], loss_fn: LossFn, micro_batch_size: int | None = None,
                   max_tokens: int | None = None, temperature: float = 1.0, with_entropy: bool = False,
                   pack: bool = True, row_group: int = 1, soft_targets: float | None = None) -> dict[str, float]:
        """One optimizer step over this rank's share of a mini-batch.

        `loss_fn(outputs, micro_batch, ctx) -> (loss, metrics)` returns the micro-batch's share of the
        mini-batch loss (aggregated with `ctx`'s global counts) and per-micro-batch mean metrics. The
        metrics come back averaged over all ranks' response tokens, with `loss` (the summed mini-batch
        loss), `grad_norm` (before clipping), `lr` and `stepped` (0 if the norm was not finite). Runs of
        `row_group` consecutive rows share a micro-batch (a loss that reads them together: preference pairs).
        `soft_targets`: as `forward` (the outputs then hold `topk_kl`).
        """
        optimizer, _ = self._optimizers()
        mask = batch["response_mask"]
        counts = all_reduce(torch.tensor([float(mask.sum()), float((mask.sum(-1) > 0).sum())],
                                         dtype=torch.float64), self.device)
        ctx = LossContext(global_tokens=float(counts[0]), global_seqs=float(counts[1]), dp_size=self.world_size)
        # metric sums stay on the device until the end: no host sync per micro-batch
        sums: dict[str, torch.Tensor] = {}
        total_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        local_tokens = 0.0
        groups = self.micro_batch_rows(batch, micro_batch_size, max_tokens, row_group)
        for i, rows in enumerate(groups):
            self._accumulate_unsharded(last=i == len(groups) - 1)
            mb = take_rows(batch, rows, empty_rows=row_group)
            out, _ = self.forward(mb, temperature, with_entropy, pack, soft_targets)
            loss, metrics = loss_fn(out, {k: to_device(v, self.device) for k, v in mb.items()}, ctx)
            weight = float(mb["response_mask"].sum())
            if self.routing is not None and (aux := self.routing.aux_loss()) is not None:
                # the micro-batch's share of the token-weighted mean over the mini-batch
                loss = loss + self.routing.config.aux_loss_coef * aux * (weight / max(ctx.global_tokens, 1.0))
                metrics = {**metrics, "router/aux_loss": aux.detach()}
            (loss * self.world_size).backward()
            local_tokens += weight
            total_loss += loss.detach()
            for k, v in metrics.items():
                value = torch.as_tensor(v, dtype=torch.float64, device=self.device).detach()
                sums[k] = sums.get(k, 0.0) + value * weight
        keys = sorted(sums)
        local = torch.stack([sums[k] for k in keys] + [torch.tensor(local_tokens, dtype=torch.float64,
                                                                    device=self.device), total_loss])
        reduced = all_reduce(local, self.device)
        tokens = max(float(reduced[-2]), 1.0)
        result = {k: float(reduced[i]) / tokens for i, k in enumerate(keys)}
        result["loss"] = float(reduced[-1])
        lr = float(optimizer.param_groups[0]["lr"])
        norm, stepped = self.clip_and_step()
        result.update(grad_norm=norm, lr=lr, stepped=float(stepped))
        return result

    def _accumulate_unsharded(self, last: bool) -> None:
        """One sharded rank keeps its gathered compute-dtype parameters and its fp32 gradients unsharded
        until the step's last micro-batch: its shards are the whole tensors, so this costs no memory, and
        re-gathering and "reduce-scattering" every micro-batch made a small micro-batch cost about twice its
        GPU time (docs/benchmarks.md). Several ranks reshard and reduce every micro-batch: unsharded fp32
        gradients would cost them ZeRO-3's saving."""
        if self.sharded and self.world_size == 1:
            model = cast(FSDPModule, self.model)  # shard_model's fully_shard made the root an FSDPModule
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)

    def _optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        """The optimizer and its lr schedule; a frozen engine (built without an optimizer section) has none."""
        if self.optimizer is None or self.scheduler is None:
            raise RuntimeError("this engine's model is frozen (built without an optimizer section): it cannot train")
        return self.optimizer, self.scheduler

    def clip_and_step(self) -> tuple[float, bool]:
        """Global gradient norm over all shards (before clipping); clip once to `grad_clip` and step the
        optimizer, or, if the norm is not finite, drop the gradients and count a skipped step."""
        optimizer, scheduler = self._optimizers()
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([cast(torch.Tensor, p.grad) for p in params], norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        finite = bool(torch.isfinite(norm))
        if finite:
            if self.grad_clip:
                torch.nn.utils.clip_grads_with_norm_(params, self.grad_clip, norm)
            optimizer.step()
            self.optimizer_steps += 1
        else:
            self.skipped_steps += 1
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        return float(norm), finite

    # ------------------------------------------------------------------ mixture of experts
    def router_metrics(self) -> dict[str, float]:
        """`RouterHooks.metrics` (a collective) since the last call; {} without router hooks."""
        return self.routing.metrics(self.device) if self.routing is not None else {}

    # ------------------------------------------------------------------ perf, memory, weights
    def trained_params(self) -> int:
        """Parameters the optimizer updates (all of them, or with LoRA the adapters)."""
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def describe(self) -> str:
        """The model's size, for messages: "1.54B parameters (Qwen2ForCausalLM, bfloat16 over float32 weights)",
        with LoRA "..., LoRA rank 32: 18.5M trained", with a 4-bit base "..., 1.31B base weights in NF4"."""
        params = sum(p.numel() for p in self.model.parameters())
        param, master = (str(d).removeprefix("torch.") for d in (self.precision.param, self.precision.master))
        name = type(self.model).__name__.removeprefix("FSDP")
        lora = "" if self.adapters is None else \
            f", LoRA rank {self.adapters.rank}: {count(self.trained_params())} trained"
        if self.quantized_params:
            lora += f", {count(self.quantized_params)} base weights in NF4"
        return f"{count(params)} parameters ({name}, {param} over {master} weights{lora})"

    def perf_metrics(self, seq_lens: list[int], seconds: float, passes: int = 1) -> dict[str, float]:
        """Throughput (real tokens per second per rank) and MFU of `passes` training passes over rows of
        `seq_lens` real tokens (this rank's rows) that took `seconds`."""
        adapters = None if self.adapters is None else self.trained_params()
        flops = flops_lib.train_flops(self.config, seq_lens, adapters) * passes
        out = {"throughput": sum(seq_lens) * passes / max(seconds, 1e-9)}
        mfu = flops_lib.mfu(flops, seconds, self.device)
        if mfu is not None:
            out["mfu"] = mfu
        return out

    def offload(self, params: bool = True, optimizer: bool = True) -> None:
        """Move parameter shards and/or optimizer state to host memory."""
        cpu = torch.device("cpu")
        if params:
            move_params(self.model, cpu)
        if optimizer and self.optimizer is not None:
            move_optimizer(self.optimizer, cpu)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def onload(self, params: bool = True, optimizer: bool = True) -> None:
        """Bring parameter shards and/or optimizer state back to the engine's device."""
        if params:
            move_params(self.model, self.device)
        if optimizer and self.optimizer is not None:
            move_optimizer(self.optimizer, self.device)

    def iter_full_params(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) per parameter, gathered one at a time and cast to `dtype`: never more
        than one full parameter beyond the shards exists at once (before the consumer drops it)."""
        for name, p in self.model.named_parameters():
            t = p.detach()
            yield name, full_tensor(t if dtype is None else t.to(dtype))  # cast the shard first: half the traffic

    def rollout_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of what a rollout engine built from the model directory needs to sample from
        the trained policy, one at a time (a collective: every rank iterates): every parameter, or with LoRA
        only the merged weight W + scale · B·A of each adapted module (nothing else ever changes), from the
        adapters as the forward sees them (rounded to the compute dtype where FSDP2's mixed precision does)."""
        if self.adapters is None:
            return self.iter_full_params(dtype)
        fsdp_cast = self.sharded and self.precision.mixed
        return self.adapters.merged_weights(dtype, self.precision.param if fsdp_cast else None)

    def frozen_weights(self) -> dict[str, torch.Tensor]:
        """{HF name: tensor} of the frozen weights a rollout engine on this device may hold instead of copies
        (`lora.frozen_weights`), with LoRA on one unsharded rank (full training changes every weight; FSDP2
        keeps only shards)."""
        if self.adapters is None or self.sharded:
            raise RuntimeError(f"frozen_weights needs LoRA on one unsharded rank; this engine has "
                               f"{'no adapters' if self.adapters is None else 'sharded weights (FSDP2)'}")
        return frozen_weights(self.model)

    def rollout_weight_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(HF name, shape) of each tensor `rollout_weights` yields, in its order."""
        if self.adapters is not None:
            return self.adapters.merged_shapes()
        return [(name, tuple(p.shape)) for name, p in self.model.named_parameters()]


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """(fn(), seconds), synchronising the device around it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start

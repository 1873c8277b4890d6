"""One training client's model: a Hugging Face causal LM trained in-process, with LoRA adapters or in full.

`Trainee.lora(model, rank, seed, device)` injects rank-`rank` adapters with the training engine's `apply_lora` into a
model whose frozen weights may be shared with other clients (`BaseModels.lora_model`); B starts at 0, so the first
policy is the base model. `Trainee.full(model, device)` trains every weight of its own copy. `forward_backward` computes
each datum's log-probs of its `target_tokens` and, per request, the Tinker loss (`tinker_losses`); several requests of
one client are packed together into micro-batches of at most `micro_batch_tokens` padded tokens (one forward and
backward each), each request getting its own outputs and loss. A forward computes its targets' log-probs with the
training engine's log-prob head (`head.LogProbHead`: chunks of the output projection, so `[tokens, vocabulary]` logits
never exist; architectures that transform their logits after the head, `model.LOGIT_TRANSFORMS`, take the plain logits),
in `compute_dtype`: bf16 runs the forward and backward under autocast over the fp32 weights (mixed precision,
`hybridflow serve --train-dtype`). `optim_step` applies AdamW with the parameters the SDK sent, then clears the
gradients; `state` / `load_state` are the training state `save_weights` / `load_weights` keep (the trained tensors and
the optimizer's moments); `sampler_weights` gives what the sampler loads: for LoRA W + scale · B·A of every adapted
weight (the only tensors that differ from the base directory's), in full every weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.config.model_schema import LoraConfig
from hybridflow.engine.train.head import LogProbHead, install_log_prob_head
from hybridflow.engine.train.lora import Adapters, apply_lora
from hybridflow.engine.train.model import LOGIT_TRANSFORMS
from hybridflow.serve.tinker_losses import check_loss, tinker_loss
from hybridflow.serve.wire import FwdBwdDatum

Outputs = tuple[list[dict[str, torch.Tensor]], dict[str, float]]
# the share of free memory (at a client's creation) a forward_backward's kept activations may take when
# `--micro-batch-tokens` is left to follow the device; the sampling engine's KV cache takes its own share
# (`--kv-cache-memory`), and one forward_backward runs at a time
TRAIN_MEMORY_FRACTION = 0.3


def auto_micro_batch_tokens(config: Any, free_bytes: int, compute_dtype: torch.dtype) -> int:
    """The padded tokens a micro-batch may hold so that what its forward keeps for the backward (no recomputation,
    `ModelShape.activation_bytes` in `compute_dtype`) stays within `TRAIN_MEMORY_FRACTION` of `free_bytes`."""
    from hybridflow.engine.budget.estimate import ModelShape

    per_token = ModelShape.from_config(config).activation_bytes(torch.finfo(compute_dtype).bits // 8, False)
    return max(1, int(TRAIN_MEMORY_FRACTION * free_bytes) // per_token)


@dataclass
class LossRequest:
    """One forward_backward request of a client: its data, loss and loss config."""

    data: list[FwdBwdDatum]
    loss_fn: str
    config: dict[str, float | str]


def _padded(rows: list[Any], width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`rows` (sequences of numbers) as one `[len(rows), width]` tensor, right-padded with 0."""
    out = torch.zeros(len(rows), width, dtype=dtype, device=device)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.as_tensor(row, dtype=dtype)
    return out


class Trainee:
    """A model being trained, its AdamW optimizer and its accumulated gradients."""

    def __init__(self, model: Any, adapters: Adapters | None, device: str | torch.device,
                 micro_batch_tokens: int = 0, compute_dtype: torch.dtype = torch.float32) -> None:
        self.device = torch.device(device)
        self.micro_batch_tokens = micro_batch_tokens
        self.compute_dtype = compute_dtype
        self.model = model
        transforms = any(getattr(model.config, k, None) not in (None, 1, 1.0) for k in LOGIT_TRANSFORMS)
        self.head: LogProbHead | None = None if transforms else install_log_prob_head(model)
        self.adapters = adapters
        self.max_len = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params)

    @classmethod
    def lora(cls, model: Any, rank: int, seed: int | None, device: str | torch.device,
             micro_batch_tokens: int = 0, compute_dtype: torch.dtype = torch.float32) -> Trainee:
        if rank < 1:
            raise ValueError(f"lora_config.rank={rank} must be >= 1 (0 asks for full-parameter training)")
        if seed is not None:
            torch.manual_seed(seed)  # the adapters' A initialisation
        adapters = apply_lora(model, LoraConfig(rank=rank), "lm", torch.float32)
        model.to(device)  # the adapters are made on the CPU
        return cls(model, adapters, device, micro_batch_tokens, compute_dtype)

    @classmethod
    def full(cls, model: Any, device: str | torch.device, micro_batch_tokens: int = 0,
             compute_dtype: torch.dtype = torch.float32) -> Trainee:
        return cls(model, None, device, micro_batch_tokens, compute_dtype)

    @property
    def rank(self) -> int:
        """The adapters' rank; 0 for full-parameter training."""
        return 0 if self.adapters is None else self.adapters.rank

    def check(self, request: LossRequest) -> None:
        """Refuse a request this model cannot run (unknown loss, bad inputs, too long), naming what is valid."""
        if not request.data:
            raise ValueError("forward_backward got no data")
        for i, datum in enumerate(request.data):
            check_loss(request.loss_fn, set(datum.inputs), request.config)
            if "target_tokens" not in datum.inputs:
                raise ValueError(f"data[{i}].loss_fn_inputs lacks target_tokens (one per input token)")
            for name, tensor in datum.inputs.items():
                if tensor.shape != (len(datum.tokens),):
                    raise ValueError(f"data[{i}].loss_fn_inputs[{name!r}] has shape {list(tensor.shape)}; "
                                     f"it must be [{len(datum.tokens)}], one value per input token")
            if self.max_len and len(datum.tokens) > self.max_len:
                raise ValueError(f"data[{i}] has {len(datum.tokens)} tokens, past the model's "
                                 f"max_position_embeddings={self.max_len}")

    def forward_backward(self, requests: list[LossRequest], forward_only: bool) -> list[Outputs]:
        """Per request: per datum {"logprobs": log-probs of its target tokens}, and {"loss:sum": its loss}.
        All requests' data are packed, in order, into micro-batches of at most `micro_batch_tokens` padded tokens
        (rows x the micro-batch's longest row; 0: one batch; a longer row alone); unless `forward_only`, each
        micro-batch backpropagates the sum of its losses, which accumulates the gradients separate calls would.
        Every Tinker loss is a sum of per-datum terms, so a request's loss is the sum of its micro-batches'."""
        rows = [(r, d) for r, request in enumerate(requests) for d in request.data]
        totals = [torch.zeros((), device=self.device) for _ in requests]
        logprobs: list[torch.Tensor] = []
        with torch.set_grad_enabled(not forward_only):
            for micro in self._micro_batches(rows):
                logp, mask = self._logp(micro)
                losses = []
                for r, request in enumerate(requests):
                    mine = [i for i, (owner, _) in enumerate(micro) if owner == r]
                    if not mine:
                        continue
                    inputs = {name: _padded([micro[i][1].inputs[name] for i in mine], logp.shape[1], torch.float32,
                                            self.device) for name in request.data[0].inputs if name != "target_tokens"}
                    loss = tinker_loss(request.loss_fn, logp[mine], mask[mine], inputs, request.config)
                    totals[r] = totals[r] + loss.detach()
                    losses.append(loss)
                if not forward_only:
                    torch.stack(losses).sum().backward()
                logprobs += [logp[i, :len(d.tokens)].detach().cpu() for i, (_, d) in enumerate(micro)]
        results, start = [], 0
        for request, total in zip(requests, totals):
            outputs = [{"logprobs": lp} for lp in logprobs[start:start + len(request.data)]]
            start += len(request.data)
            results.append((outputs, {"loss:sum": float(total)}))
        return results

    def _micro_batches(self, rows: list[tuple[int, FwdBwdDatum]]) -> list[list[tuple[int, FwdBwdDatum]]]:
        """`rows` cut, in order, into runs whose padded size (rows x longest) stays within the token budget."""
        if not self.micro_batch_tokens:
            return [rows]
        batches: list[list[tuple[int, FwdBwdDatum]]] = [[]]
        for row in rows:
            width = max([len(d.tokens) for _, d in batches[-1]] + [len(row[1].tokens)])
            if batches[-1] and (len(batches[-1]) + 1) * width > self.micro_batch_tokens:
                batches.append([])
            batches[-1].append(row)
        return batches

    def _logp(self, rows: list[tuple[int, FwdBwdDatum]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's log-probs of each row's target tokens `[rows, width]` (fp32, 0 at padding), and the mask."""
        lengths = [len(d.tokens) for _, d in rows]
        width = max(lengths)
        mask = torch.tensor([[t < n for t in range(width)] for n in lengths], device=self.device)
        tokens = _padded([d.tokens for _, d in rows], width, torch.long, self.device)
        targets = _padded([d.inputs["target_tokens"] for _, d in rows], width, torch.long, self.device)
        mixed = self.compute_dtype != torch.float32
        with torch.autocast(self.device.type, self.compute_dtype, enabled=mixed):
            if self.head is None:
                logits = self.model(input_ids=tokens, attention_mask=mask.long()).logits.float()
                return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1), mask
            index = mask.flatten().nonzero().squeeze(-1)  # the head's rows: real tokens only
            with self.head.request(targets.flatten()[index], index, 1.0, False) as req:
                self.model(input_ids=tokens, attention_mask=mask.long())
        assert req.log_probs is not None  # the head's forward set it
        return torch.zeros(mask.shape, device=self.device).index_put((mask,), req.log_probs), mask

    def optim_step(self, learning_rate: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                   grad_clip_norm: float) -> dict[str, float]:
        """One AdamW step on the accumulated gradients (clipped to `grad_clip_norm` when > 0), then zero them."""
        for group in self.optimizer.param_groups:
            group.update(lr=learning_rate, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        norm = torch.nn.utils.clip_grad_norm_(self.params, grad_clip_norm if grad_clip_norm > 0 else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm:mean": float(norm)}

    def trained(self) -> dict[str, torch.Tensor]:
        """{name: tensor} of the trained parameters (the adapters, or every weight), copied to the CPU."""
        return {name: p.detach().cpu().clone() for name, p in self.model.named_parameters() if p.requires_grad}

    def state(self) -> dict[str, Any]:
        """The training state `save_weights` keeps: the trained tensors, the optimizer's moments, the rank."""
        return {"rank": self.rank, "trained": self.trained(), "optimizer": self.optimizer.state_dict()}

    def load_state(self, state: dict[str, Any], optimizer: bool) -> None:
        """Put `state` (from `state()`) in place: the trained tensors, and the optimizer's moments when `optimizer`
        (else they start afresh)."""
        if state["rank"] != self.rank:
            kind = "full-parameter" if state["rank"] == 0 else f"rank-{state['rank']} LoRA"
            raise ValueError(f"the checkpoint holds {kind} weights; this training client's are "
                             f"{'full-parameter' if self.rank == 0 else f'rank-{self.rank} LoRA'}; create the client "
                             f"with rank={state['rank']}")
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in state["trained"].items():
                params[name].copy_(tensor)
        self.optimizer = torch.optim.AdamW(self.params)
        if optimizer:
            self.optimizer.load_state_dict(state["optimizer"])
        self.optimizer.zero_grad(set_to_none=True)

    def sampler_weights(self) -> list[tuple[str, torch.Tensor]]:
        """(HF name, tensor) the sampler loads, copied to the CPU (a snapshot): LoRA's merged weights, or every
        weight of a full-parameter model."""
        if self.adapters is None:
            return list(self.trained().items())
        return [(name, t.detach().cpu().clone()) for name, t in self.adapters.merged_weights()]

"""One training client's model: a Hugging Face causal LM with LoRA adapters, trained in-process.

`LoraTrainee(path, rank, seed, device)` loads the base model and injects rank-`rank` adapters with the
training engine's `apply_lora` (B starts at 0: the first policy is the base model). `forward_backward`
computes each datum's log-probs of its `target_tokens`, the Tinker loss (`tinker_losses`) and, unless
forward-only, accumulates its gradient; `optim_step` applies AdamW with the parameters the SDK sent, then
clears the gradients; `state` / `load_state` are the training state `save_weights` / `load_weights` keep
(adapters and optimizer moments); `merged_weights` gives W + scale · B·A of every adapted weight, the only
tensors of the trained policy that differ from the base directory's (what the sampler loads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch

from hybridflow.config.schema import LoraConfig
from hybridflow.engine.train.lora import apply_lora
from hybridflow.serve.tinker_losses import check_loss, tinker_loss
from hybridflow.serve.wire import FwdBwdDatum


class LoraTrainee:
    """A LoRA-adapted model, its AdamW optimizer and its accumulated gradients."""

    def __init__(self, path: str | Path, rank: int, seed: int | None, device: str) -> None:
        from transformers import AutoModelForCausalLM

        if rank < 1:
            raise ValueError(f"lora_config.rank={rank} must be >= 1")
        self.device = torch.device(device)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        if seed is not None:
            torch.manual_seed(seed)  # the adapters' A initialisation
        self.adapters = apply_lora(model, LoraConfig(rank=rank), "lm", torch.float32)
        cast(torch.nn.Module, model).to(self.device)  # transformers types `to` for dtypes only
        self.model = model
        self.max_len = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params)
        self.rank = rank

    def forward_backward(self, data: list[FwdBwdDatum], loss_fn: str, config: dict[str, float | str],
                         forward_only: bool) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        """Per datum {"logprobs": log-probs of its target tokens}, and {"loss:sum": the loss}."""
        if not data:
            raise ValueError("forward_backward got no data")
        for i, datum in enumerate(data):
            check_loss(loss_fn, set(datum.inputs), config)
            if "target_tokens" not in datum.inputs:
                raise ValueError(f"data[{i}].loss_fn_inputs lacks target_tokens (one per input token)")
            for name, tensor in datum.inputs.items():
                if tensor.shape != (len(datum.tokens),):
                    raise ValueError(f"data[{i}].loss_fn_inputs[{name!r}] has shape {list(tensor.shape)}; "
                                     f"it must be [{len(datum.tokens)}], one value per input token")
            if self.max_len and len(datum.tokens) > self.max_len:
                raise ValueError(f"data[{i}] has {len(datum.tokens)} tokens, past the model's "
                                 f"max_position_embeddings={self.max_len}")
        lengths = [len(d.tokens) for d in data]
        width = max(lengths)
        mask = torch.tensor([[t < n for t in range(width)] for n in lengths], device=self.device)

        def padded(rows: list[Any], dtype: torch.dtype) -> torch.Tensor:
            out = torch.zeros(len(rows), width, dtype=dtype, device=self.device)
            for i, row in enumerate(rows):
                out[i, :len(row)] = torch.as_tensor(row, dtype=dtype)
            return out

        tokens = padded([d.tokens for d in data], torch.long)
        inputs = {name: padded([d.inputs[name] for d in data], torch.long if name == "target_tokens" else torch.float32)
                  for name in data[0].inputs}
        with torch.set_grad_enabled(not forward_only):
            logits = self.model(input_ids=tokens, attention_mask=mask.long()).logits.float()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, inputs["target_tokens"].unsqueeze(-1)).squeeze(-1)
            loss = tinker_loss(loss_fn, logp, mask, inputs, config)
            if not forward_only:
                loss.backward()
        outputs = [{"logprobs": logp[i, :n].detach().cpu()} for i, n in enumerate(lengths)]
        return outputs, {"loss:sum": float(loss.detach())}

    def optim_step(self, learning_rate: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                   grad_clip_norm: float) -> dict[str, float]:
        """One AdamW step on the accumulated gradients (clipped to `grad_clip_norm` when > 0), then zero them."""
        for group in self.optimizer.param_groups:
            group.update(lr=learning_rate, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        norm = torch.nn.utils.clip_grad_norm_(self.params, grad_clip_norm if grad_clip_norm > 0 else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm:mean": float(norm)}

    def state(self) -> dict[str, Any]:
        """The training state `save_weights` keeps: the adapters, the optimizer's moments, the rank."""
        adapters = {name: p.detach().cpu().clone() for name, p in self.model.named_parameters() if p.requires_grad}
        return {"rank": self.rank, "adapters": adapters, "optimizer": self.optimizer.state_dict()}

    def load_state(self, state: dict[str, Any], optimizer: bool) -> None:
        """Put `state` (from `state()`) in place: the adapters, and the optimizer's moments when `optimizer` (else
        they start afresh)."""
        if state["rank"] != self.rank:
            raise ValueError(f"the saved adapters have rank {state['rank']}; this training client's have rank "
                             f"{self.rank}; create the client with rank={state['rank']}")
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in state["adapters"].items():
                params[name].copy_(tensor)
        self.optimizer = torch.optim.AdamW(self.params)
        if optimizer:
            self.optimizer.load_state_dict(state["optimizer"])
        self.optimizer.zero_grad(set_to_none=True)

    def merged_weights(self) -> list[tuple[str, torch.Tensor]]:
        """(HF name, W + scale · B·A) of every adapted weight, copied to the CPU (a snapshot)."""
        return [(name, t.detach().cpu().clone()) for name, t in self.adapters.merged_weights()]

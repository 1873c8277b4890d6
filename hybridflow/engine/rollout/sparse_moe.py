"""The sparse MLP of the fast decoder's mixture-of-experts layers (Qwen3-MoE, Mixtral, Qwen2-MoE), with Hugging
Face parameter names, and the record of each token's experts.

A `SparseMoE` block replaces a layer's MLP: `gate` (the router, `mlp.gate.weight` [E, H]) picks each token's
top-k experts with the model's own normalisation (`hybridflow.utils.moe_spec`), `experts` holds their
stacked SwiGLU weights as transformers >= 5 does (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first, and
`mlp.experts.down_proj` [E, H, I]) and runs them as grouped GEMMs (`grouped_gemm.expert_mlp`); Qwen2-MoE adds
a shared expert gated by sigmoid(`shared_expert_gate`). Weights load under either layout: the stacked names
of a trainer's state dict, or the per-expert names of checkpoints on the hub (`experts.{e}.gate_proj` /
`up_proj` / `down_proj`, Mixtral's `block_sparse_moe.experts.{e}.w1` / `w3` / `w2`), each copied in place
into its expert's slice (`expert_target`).

Routes: when the engine records them, each block writes its tokens' expert ids ([T, k] int16, in the
router's top-k order) to its layer's plane of a buffer laid out like the KV cache
(`[sparse layers, (slots + 1) * max_len, k]`), at the same flat (slot, position) indices the K/V go to
(`AttnMeta.write_index`), so a prefill writes a prompt's routes to all n sample slots and a decode step,
inside its CUDA graph, writes each row's at its position.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.engine.rollout.attention import AttnMeta
from hybridflow.engine.rollout.grouped_gemm import expert_mlp
from hybridflow.utils.moe_spec import MoESpec

# hub names of one expert's projection -> (stacked parameter, part)
_EXPERT_PARTS = {"gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
                 "down_proj": ("down_proj", "down"), "w1": ("gate_up_proj", "gate"), "w3": ("gate_up_proj", "up"),
                 "w2": ("down_proj", "down")}
_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight$")


def expert_target(name: str) -> tuple[str, tuple[str, int] | None] | None:
    """The fast model's (parameter name, shard) for a HF name inside a sparse block: Mixtral's
    `block_sparse_moe.` becomes `mlp.`; a per-expert weight becomes its stacked parameter with the shard
    (part, expert); a stacked name or the router stays with no shard. None outside a sparse block."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    match = _PER_EXPERT.search(name)
    if match and match.group(2) in _EXPERT_PARTS:
        param, part = _EXPERT_PARTS[match.group(2)]
        return name[:match.start()] + ".experts." + param, (part, int(match.group(1)))
    if ".mlp.experts." in name or name.endswith(".mlp.gate.weight"):
        return name, None
    return None


class Router(nn.Module):
    """Top-k routing: softmax over the experts in fp32, the k largest, renormalised with `norm_topk_prob`,
    cast to the logits' dtype unless the architecture keeps them in fp32 (Mixtral)."""

    def __init__(self, spec: MoESpec, hidden: int) -> None:
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (routing weights [T, k], expert ids [T, k] int64, largest weight first)."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.spec.weights_in_fp32 else weights.to(logits.dtype)), ids


class Experts(nn.Module):
    """The routed experts' stacked weights; per-expert checkpoint tensors load into their slices."""

    def __init__(self, spec: MoESpec, hidden: int) -> None:
        super().__init__()
        self.num_experts, self.inter = spec.num_experts, spec.expert_intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(spec.num_experts, 2 * self.inter, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(spec.num_experts, hidden, self.inter), requires_grad=False)

    def shard_ids(self, leaf: str) -> list[tuple[str, int]]:
        """The per-expert pieces a full load of parameter `leaf` consists of."""
        parts = ("gate", "up") if leaf == "gate_up_proj" else ("down",)
        return [(part, e) for e in range(self.num_experts) for part in parts]

    def covers(self, leaf: str, shard: tuple[str, int] | None) -> list[tuple[str, int]]:
        """The pieces a tensor loaded as `shard` fills (a stacked tensor: all of them)."""
        return self.shard_ids(leaf) if shard is None else [shard]

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard: tuple[str, int] | None = None) -> None:
        if shard is None:
            target = param.data
        else:
            part, expert = shard
            if not 0 <= expert < self.num_experts:
                raise ValueError(f"expert {expert} is out of range: the model has {self.num_experts} experts")
            target = param.data[expert]
            if part != "down":
                target = target[:self.inter] if part == "gate" else target[self.inter:]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"shape {tuple(tensor.shape)} does not match the expert weight's {tuple(target.shape)}")
        target.copy_(tensor)


class SparseMoE(nn.Module):
    """A sparse layer's MLP: routed experts, plus a gated shared expert (`shared`, Qwen2-MoE)."""

    def __init__(self, spec: MoESpec, hidden: int, act: Callable[[torch.Tensor], torch.Tensor], kernel: str,
                 shared: nn.Module | None = None) -> None:
        super().__init__()
        self.gate = Router(spec, hidden)
        self.experts = Experts(spec, hidden)
        self.act, self.kernel = act, kernel
        if shared is not None:
            self.shared_expert = shared
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.routes: torch.Tensor | None = None  # this layer's plane of the route record, when recording

    def forward(self, x: torch.Tensor, meta: AttnMeta | None = None) -> torch.Tensor:
        weights, ids = self.gate(x)
        if self.routes is not None and meta is not None:
            chosen = ids.to(torch.int16)
            self.routes.index_copy_(0, meta.write_index, chosen if meta.write_rows is None else chosen[meta.write_rows])
        out = expert_mlp(x, weights, ids, self.experts.gate_up_proj, self.experts.down_proj, self.act, self.kernel)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class RouteRecord:
    """Each token's experts per sparse layer, written by the blocks during prefill and decode: int16
    [sparse layers, (slots + 1) * max_len, k], -1 where nothing was written. Allocated once (small beside
    the KV cache: layers x k x 2 bytes per cached token) and kept through sleep / wake, so the CUDA graphs
    that write into it stay valid."""

    def __init__(self, blocks: list[SparseMoE], slots: int, max_len: int, top_k: int, device: torch.device) -> None:
        self.max_len = max_len
        self.buffer = torch.full((len(blocks), slots * max_len, top_k), -1, dtype=torch.int16, device=device)
        for plane, block in zip(self.buffer, blocks):
            block.routes = plane

    def read(self, slots: list[int], lengths: list[int]) -> list[torch.Tensor]:
        """The routes of the first `lengths[i]` positions of slot `slots[i]`: int16 [length, layers, k] on the
        CPU each, read back in one copy."""
        if not slots:
            return []
        width = max(lengths)
        view = self.buffer.view(self.buffer.shape[0], -1, self.max_len, self.buffer.shape[2])
        index = torch.tensor(slots, device=self.buffer.device)
        rows = view[:, index, :width].permute(1, 2, 0, 3).cpu()
        return [row[:length] for row, length in zip(rows, lengths)]

"""Router replay, router agreement and the router's auxiliary loss for a Hugging Face mixture of experts in
the training engine, applied from outside the model code (a forward hook on each sparse layer's router),
as LoRA and parallelism are.

Transformers' sparse blocks call their router (`mlp.gate`), which returns (logits [N, E], routing weights
[N, k], expert ids [N, k]) over the forward's N flattened tokens, and run the experts on those ids and
weights. `RouterHooks` sees each router's output and, given the rollout engine's routes for the forward's
tokens (`rollout_routes`, `prepare`):
- with replay, returns the recorded experts in place of the router's own choice, weighted by
  `replayed_weights` of the router's current logits (so the router still gets gradients); a token without a
  recorded route (padding, a response's last token) keeps its own;
- counts, once per forward (a checkpointed layer's recomputation in the backward replays the same experts
  but is not counted again), how often the experts used, and the router's own top-k, equal the rollout's:
  per (token, sparse layer) and per token over all sparse layers (`metrics`);
- with an auxiliary-loss coefficient, keeps the routers' probabilities and the experts used for
  `aux_loss`, the load-balancing loss of the forward (`algorithms.load_balancing_loss`).
The hook is excluded from `torch.compile` (a graph break at each router): it keeps Python state.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridflow.algorithms import load_balancing_loss, replayed_weights, same_experts
from hybridflow.engine.train.collectives import all_reduce
from hybridflow.engine.train.model import decoder_layers
from hybridflow.engine.train.packing import to_device
from hybridflow.utils.moe_spec import MOE_ARCHITECTURES, MoESpec, moe_spec

ROUTES_KEY = "rollout_routes"
_STATS = ("used_pairs", "used_tokens", "own_pairs", "own_tokens", "pairs", "tokens")


def require_spec(config) -> MoESpec:
    """The config's `MoESpec`, or a ValueError naming the architectures with router hooks."""
    spec = moe_spec(config)
    if spec is None:
        raise ValueError(f"router replay, router statistics and the router aux loss need a mixture of experts of "
                         f"{', '.join(MOE_ARCHITECTURES)}; this model is {config.model_type!r}")
    return spec


def flat_routes(mb: dict[str, torch.Tensor], packed: bool, device: torch.device
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(routes [N, layers, k] int64 on `device` or None, real-token mask [N] or None when every token is real)
    in the order the model flattens the forward's tokens: packed, the real tokens row by row; padded, every
    position of `[B, P+R]`."""
    mask = mb["attention_mask"].bool()
    routes = mb.get(ROUTES_KEY)
    if packed:
        valid = None
        routes = None if routes is None else routes[mask.to(routes.device)]
    else:
        valid = to_device(mask.reshape(-1), device)
        routes = None if routes is None else routes.flatten(0, 1)
    return (None if routes is None else to_device(routes, device).long()), valid


class RouterHooks:
    """The hooks on a model's routers; see the module docstring."""

    @dataclass(frozen=True, kw_only=True, slots=True)
    class Config:
        """What the hooks do, resolved on the controller from the actor's settings
        (`hybridflow.trainer.role_configs`).

        replay: the forwards use the recorded experts (`actor.router_replay=rollout`); False = the router's own
            top-k, compared with the recorded ones.
        aux_loss_coef: weight of the load-balancing loss added to an update's loss (`actor.router_aux_loss_coef`;
            0 = off).
        """

        replay: bool = False
        aux_loss_coef: float = 0.0

    def __init__(self, model: torch.nn.Module, spec: MoESpec, config: RouterHooks.Config) -> None:
        layers = decoder_layers(model)
        self.spec, self.config = spec, config
        self.handles = [layers[i].get_submodule("mlp.gate").register_forward_hook(functools.partial(self._hook, plane))
                        for plane, i in enumerate(spec.sparse_layers)]
        self.routes: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self.seen: set[int] = set()
        self.probs: list[torch.Tensor] = []
        self.used: list[torch.Tensor] = []
        self.counts: torch.Tensor | None = None
        self.token_agree: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def prepare(self, routes: torch.Tensor | None, valid: torch.Tensor | None) -> None:
        """Before a forward: its tokens' recorded routes [N, layers, k] (-1: none; None: no routes) and real-token
        mask [N] (None: all real). They stay set through its backward, where checkpointed layers recompute."""
        self._flush()
        if routes is not None and routes.shape[1:] != (len(self.handles), self.spec.top_k):
            raise ValueError(f"{ROUTES_KEY} has {tuple(routes.shape[1:])} (sparse layers, experts per token) per "
                             f"token; the model has ({len(self.handles)}, {self.spec.top_k})")
        self.routes, self.valid, self.seen, self.probs, self.used = routes, valid, set(), [], []

    @torch.compiler.disable
    def _hook(self, plane: int, module: torch.nn.Module, args: tuple, output: tuple) -> tuple:
        logits, weights, ids = output
        first = plane not in self.seen
        self.seen.add(plane)
        used = ids
        if self.routes is not None:
            if self.routes.shape[0] != ids.shape[0]:
                raise ValueError(f"{ROUTES_KEY} covers {self.routes.shape[0]} tokens but the router saw {ids.shape[0]}")
            recorded = self.routes[:, plane]
            has = recorded[:, 0] >= 0
            if self.config.replay:
                used = torch.where(has[:, None], recorded, ids)
                weights = replayed_weights(logits, used, self.spec.norm_topk_prob, weights.dtype)
            if first:
                self._count(used, ids, recorded, has)
        if first and self.config.aux_loss_coef > 0 and torch.is_grad_enabled():
            self.probs.append(torch.softmax(logits.float(), dim=-1))
            self.used.append(used)
        return logits, weights, used

    def _count(self, used: torch.Tensor, own: torch.Tensor, recorded: torch.Tensor, has: torch.Tensor) -> None:
        used_same, own_same = same_experts(used, recorded) & has, same_experts(own, recorded) & has
        self._add(used_pairs=used_same.sum(), own_pairs=own_same.sum(), pairs=has.sum())
        if self.token_agree is not None:
            used_same, own_same = used_same & self.token_agree[0], own_same & self.token_agree[1]
        self.token_agree = (used_same, own_same, has)

    def _add(self, **values: torch.Tensor) -> None:
        """Adds to the named counts, on the device (no sync)."""
        for name, value in values.items():
            if self.counts is None:
                self.counts = torch.zeros(len(_STATS), dtype=torch.float64, device=value.device)
            self.counts[_STATS.index(name)] += value.double()

    def _flush(self) -> None:
        """Adds the finished forward's per-token agreement to the counts."""
        if self.token_agree is not None:
            used, own, has = self.token_agree
            self._add(used_tokens=used.sum(), own_tokens=own.sum(), tokens=has.sum())
            self.token_agree = None

    def aux_loss(self) -> torch.Tensor | None:
        """The load-balancing loss of the last forward (None without a coefficient or outside autograd)."""
        if not self.probs:
            return None
        return load_balancing_loss(self.probs, self.used, self.spec.num_experts, self.valid)

    def metrics(self, device: torch.device) -> dict[str, float]:
        """Router agreement with the rollout since the last call, over every rank (a collective):
        `router/agreement` (share of (token, sparse layer) routes that used the rollout's experts),
        `router/token_agreement` (share of tokens that did in every sparse layer), and the same for the router's
        own top-k, `router/topk_agreement` and `router/topk_token_agreement` (equal to the first two without
        replay). {} when no forward had routes."""
        self._flush()
        counts = self.counts if self.counts is not None else torch.zeros(len(_STATS), dtype=torch.float64)
        self.counts = None
        total = dict(zip(_STATS, all_reduce(counts.to(device), device, op=dist.ReduceOp.SUM).tolist()))
        if total["pairs"] == 0:
            return {}
        return {"router/agreement": total["used_pairs"] / total["pairs"],
                "router/token_agreement": total["used_tokens"] / total["tokens"],
                "router/topk_agreement": total["own_pairs"] / total["pairs"],
                "router/topk_token_agreement": total["own_tokens"] / total["tokens"]}

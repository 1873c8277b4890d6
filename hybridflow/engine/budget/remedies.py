"""What a refused device plan offers: the config changes that lower a run's memory estimate (`remedies`), each as the
keys=values a user would write and the demand it makes; `planning.plan` re-checks each and names those that fit
(and, last, every memory option at once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from hybridflow.engine.budget.estimate import DeviceDemand, TrainedRole


def remedies(demand: DeviceDemand) -> list[tuple[str, DeviceDemand]]:
    """Config changes that lower the estimate, as (keys=values, the changed demand); the last one takes
    every memory option at once."""
    out = []

    def each(change: Callable[[TrainedRole], dict], label: Callable[[TrainedRole], str]) -> None:
        for i, r in enumerate(demand.trained):
            fields = change(r)
            if fields and replace(r, **fields) != r:
                out.append((label(r), replace(demand, trained=demand.trained[:i] + (replace(r, **fields),)
                                              + demand.trained[i + 1:])))

    each(lambda r: dict(gradient_checkpointing=True), lambda r: f"{r.model_keys}.gradient_checkpointing=true")
    each(lambda r: dict(optimizer="adamw_8bit") if r.optimizer == "adamw" else {},
         lambda r: f"{r.keys}.optimizer=adamw_8bit")
    each(lambda r: dict(optimizer="adamw_cpu_offload") if r.master_bytes == 4 else {},
         lambda r: f"{r.keys}.optimizer=adamw_cpu_offload")
    # a 4-bit base stays on the device (`small_card_checks`): its role is offered no parameter offload
    each(lambda r: dict(param_offload=not r.quantized_params, optimizer_offload=True),
         lambda r: f"{r.keys}.param_offload=true " * (not r.quantized_params) + f"{r.keys}.optimizer_offload=true")
    each(lambda r: dict(master_bytes=2, optimizer="adamw_8bit") if r.compute_bytes == 2 else {},
         lambda r: f"{r.model_keys}.master_dtype=bf16 {r.keys}.optimizer=adamw_8bit")
    if demand.rollout is not None and not demand.rollout.offload_weights:
        out.append(("rollout.offload_weights=true",
                    replace(demand, rollout=replace(demand.rollout, offload_weights=True))))
    if demand.rollout is not None and demand.rollout.cache_stays:
        out.append(("rollout.free_cache_after_generate=true (with rollout.partial, also "
                    "rollout.partial_unfinished=recompute)",
                    replace(demand, rollout=replace(demand.rollout, cache_stays=False))))
    offloadable = [f for f in demand.frozen if f.offload_key and not f.offload]
    for f in offloadable:
        out.append((f"{f.offload_key}=true", replace(demand, frozen=tuple(
            replace(x, offload=True) if x is f else x for x in demand.frozen))))

    def strongest(r: TrainedRole) -> tuple[TrainedRole, str]:
        low = dict(master_bytes=2, optimizer="adamw_8bit") if r.compute_bytes == 2 else dict(
            optimizer="adamw_cpu_offload")
        label = (f"{r.model_keys}.master_dtype=bf16 {r.keys}.optimizer=adamw_8bit" if r.compute_bytes == 2
                 else f"{r.keys}.optimizer=adamw_cpu_offload")
        offload = not r.quantized_params
        return (replace(r, gradient_checkpointing=True, param_offload=offload, optimizer_offload=True, **low),
                f"{r.model_keys}.gradient_checkpointing=true " + f"{r.keys}.param_offload=true " * offload
                + f"{r.keys}.optimizer_offload=true {label}")

    trained = [strongest(r) for r in demand.trained]
    labels = [label for _, label in trained]
    labels += [f"{f.offload_key}=true" for f in offloadable]
    if demand.rollout is not None:
        labels.append("rollout.offload_weights=true")
    out.append((" ".join(labels), replace(
        demand, trained=tuple(r for r, _ in trained),
        frozen=tuple(replace(f, offload=True) if f.offload_key else f for f in demand.frozen),
        rollout=None if demand.rollout is None else replace(demand.rollout, offload_weights=True))))
    return out

"""Planning a device: from a `DeviceDemand` and the memory free at start, the micro-batch token budget and
activation checkpointing of each trained role and the KV cache's bytes (`plan`), or a refusal naming the
model, the estimate and the config keys that would make the run fit (`DoesNotFit`); the plan this
process's roles share (`plan_for_device`); filling in what the config left to the plan (`apply_plan`);
and CUDA out-of-memory errors explained with the plan and the keys to change (`reported_oom`).

The memory a run may use is `cap = min(utilization x total, free at start)` (vLLM's
`gpu_memory_utilization`), or under `trainer.device_memory_gib` that many bytes less what the process holds
outside the allocator (`cap.py`: the allocator is held to them too). Keys left to the plan (checkpointing and the
token budget at None, below; `optimizer="auto"`, `optimizer_offload` and the rollout's `offload_weights` at None)
are chosen here, the cheapest combination that fits (`choices.py`): AdamW and nothing offloaded, else 8-bit AdamW
(torchao), the rollout engine's weights on the CPU while training, the optimizer state on the CPU between uses, in
that order of cost.
A trained role gets `TARGET_TOKENS`-token micro-batches where they fit (bounded memory; compiled layers make them
as fast as one forward), fewer where memory is short, and gradient checkpointing when not even
`MIN_TOKENS_WITHOUT_CHECKPOINTING` tokens (or one full sequence) fit without it, or when the model has fewer
than `HOST_BOUND_PARAMS` parameters (a mixture of experts: active ones; its update is host-bound: longer,
recomputed micro-batches are faster and leaner), whose micro-batches then get `CHECKPOINTED_TARGET_TOKENS`, more
for layers smaller than the 0.5B shape's (`ModelShape.host_bound_tokens`).
The KV cache gets what is left within the cap while generating, at most what its slots need. A cache that
stays allocated through training (`RolloutRole.cache_stays`: partial rollouts keep unfinished samples' keys and
values between steps) gets, unless its size is fixed by a fraction, what the trained roles' updates leave,
so its size falls with the responses' length instead of refusing the run.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import TypeVar

import torch

from hybridflow.config.model_schema import EngineOptimConfig, ModelConfig
from hybridflow.config.schema import RolloutConfig
from hybridflow.engine.budget.cap import (CAP_KEY, allocator_bytes, budget_bytes, budget_source, hold,
                                          hold_allocator, weights_problem)
from hybridflow.engine.budget.choices import default_optimizer, silent_choices
from hybridflow.engine.budget.remedies import remedies
from hybridflow.engine.budget.estimate import (GIB, HEAD_CHUNK_BYTES, HOST_BOUND_PARAMS,
                                               MIN_TOKENS_WITHOUT_CHECKPOINTING, SLACK_BYTES, TARGET_TOKENS,
                                               DeviceDemand, RolloutRole, TrainedRole)


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """(free, total) bytes of an accelerator; None for a CPU (host memory is not budgeted)."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)


@dataclass
class RolePlan:
    """A trained role's micro-batching, checkpointing and optimizer, and its estimated peak while it updates."""

    max_tokens: int
    gradient_checkpointing: bool
    peak_bytes: float
    breakdown: dict[str, float]
    optimizer: str = "adamw"
    optimizer_offload: bool = False


@dataclass
class DevicePlan:
    """What a device's run gets: the budget (`cap_bytes` of `total_bytes`), each trained role's plan (by its
    config section), the KV cache's bytes (None without a rollout engine) and the generation peak."""

    cap_bytes: int
    total_bytes: int
    roles: dict[str, RolePlan] = field(default_factory=dict)
    kv_cache_bytes: int | None = None
    rollout_offload: bool = False  # the rollout engine's weights on the CPU while training
    held_bytes: int | None = None  # the cap this process's allocator is held to (`cap.hold`); None: not held
    generation_peak_bytes: float = 0.0
    generation_breakdown: dict[str, float] = field(default_factory=dict)
    max_prefill_tokens: int | None = None  # the rollout engine's prefill forward (None: the engine's default)

    def describe(self) -> str:
        lines = [f"device budget {_gib(self.cap_bytes)} of {_gib(self.total_bytes)}"]
        for keys, r in self.roles.items():
            lines.append(f"{keys} update: {r.max_tokens:,}-token micro-batches, gradient checkpointing "
                         f"{'on' if r.gradient_checkpointing else 'off'}, {r.optimizer}"
                         f"{', state offloaded between uses' if r.optimizer_offload else ''}, estimated peak "
                         f"{_gib(r.peak_bytes)} ({_items(r.breakdown)})")
        if self.kv_cache_bytes is not None:
            offload = ", rollout weights offloaded while training" if self.rollout_offload else ""
            prefill = f", {self.max_prefill_tokens:,}-token prefill forwards" if self.max_prefill_tokens else ""
            lines.append(f"generation: KV cache {_gib(self.kv_cache_bytes)}{offload}{prefill}, estimated peak "
                         f"{_gib(self.generation_peak_bytes)} ({_items(self.generation_breakdown)})")
        return "; ".join(lines)


class DoesNotFit(ValueError):
    """The run cannot fit the device; the message names the estimate and the keys that would help."""


class DeviceOutOfMemory(torch.OutOfMemoryError):
    """An out-of-memory error during a step, explained (the model, the plan, the keys to change)."""


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if abs(n) >= GIB else f"{n / 2**20:.0f} MiB"


def _items(d: dict[str, float]) -> str:
    return ", ".join(f"{k} {_gib(v)}" for k, v in d.items() if v > 0)


def _role_plan(demand: DeviceDemand, role: TrainedRole, cap: int, kept_kv: int) -> tuple[RolePlan, float, str]:
    """(the role's plan, bytes it is short by (0 if it fits), why); `kept_kv`: a KV cache of fixed size that
    stays through the update."""
    w = demand.world_size
    breakdown = dict(role.update_bytes(w))
    others = sum(r.idle_bytes(w) for r in demand.trained if r is not role)
    others += sum(f.idle_bytes(w) for f in demand.frozen)
    if others:
        breakdown["other models"] = others
    ro = demand.rollout
    if ro is not None and not ro.offload_weights:
        breakdown["rollout weights"] = ro.weight_bytes
    if kept_kv:
        breakdown["KV cache (kept)"] = kept_kv
    fixed = sum(breakdown.values()) + HEAD_CHUNK_BYTES + SLACK_BYTES
    free = cap - fixed
    shape, c, longest = role.shape, role.compute_bytes, demand.longest_sequence
    given = role.max_tokens if role.max_tokens is not None else (
        role.micro_batch_rows * longest if role.micro_batch_rows is not None else None)
    most = {ck: max(0, int((free - role.forward_fixed_bytes(ck)) // shape.activation_bytes(c, ck)))
            for ck in (False, True)}
    host_bound = shape.compute_params < HOST_BOUND_PARAMS
    # without recomputation, at least the given budget (or the floor below which it would pay) must fit
    needed = given if given is not None else max(longest, MIN_TOKENS_WITHOUT_CHECKPOINTING)
    ckpt = role.gradient_checkpointing if role.gradient_checkpointing is not None else \
        host_bound or most[False] < needed
    if given is not None:
        tokens = given
    else:
        target = shape.host_bound_tokens() if ckpt and host_bound else TARGET_TOKENS
        tokens = max(longest, min(target, most[ckpt]))
    activations = tokens * shape.activation_bytes(c, ckpt) + role.forward_fixed_bytes(ckpt)
    short = max(0.0, activations - free)
    if free < 0:
        why = (f"its weights, gradients, optimizer state and workspace alone take {_gib(fixed)} "
               f"({_items(breakdown)}, workspace {_gib(HEAD_CHUNK_BYTES + SLACK_BYTES)})")
    else:
        why = (f"{tokens:,}-token micro-batches need {_gib(activations)} of activations"
               f"{' with gradient checkpointing' if ckpt else ''}, {_gib(free)} is left beside "
               f"{_items(breakdown)}")
    breakdown["activations"] = role.activation_peak(tokens, ckpt)
    return (RolePlan(tokens, ckpt, sum(breakdown.values()), breakdown, role.optimizer, bool(role.optimizer_offload)),
            short, why if short else "")


# the rollout engine's prefill forwards the plan may shrink to when its KV cache holds fewer slots than
# `rollout.max_num_seqs`: their activations are the generation workspace's largest part (1 GiB at 1.5B and 16,384
# tokens), and each GiB they give up holds 36 more 1,024-token sequences of 1.5B's K/V
PREFILL_CHOICES = (8192, 4096, 2048)


def _generation(demand: DeviceDemand, cap: int, free: int, room: float | None = None
                ) -> tuple[int, float, dict[str, float], float, int | None]:
    """(KV cache bytes, peak, breakdown, bytes it is short by, the prefill forward's tokens where the plan shrank
    it) while the rollout engine generates; `room`: the most a cache that stays through training may take beside
    the updates. Where the cache would hold fewer slots than `max_num_seqs`, smaller prefill forwards
    (`PREFILL_CHOICES`) are tried and the one leaving the most cache is taken."""
    ro = _rollout(demand)
    best: tuple[int, float, dict[str, float], float, int | None] = (*_generation_at(demand, cap, free, room), None)
    wanted = (ro.max_num_seqs + 1) * ro.kv_bytes_per_seq()
    if ro.kv_cache_fraction is not None or best[0] >= wanted:
        return best
    for tokens in PREFILL_CHOICES:
        if tokens >= ro.max_prefill_tokens or tokens < ro.max_model_len:  # no smaller workspace
            continue
        smaller = replace(demand, rollout=replace(ro, max_prefill_tokens=tokens))
        out = (*_generation_at(smaller, cap, free, room), tokens)
        if out[0] > best[0]:
            best = out
    return best


def _generation_at(demand: DeviceDemand, cap: int, free: int, room: float | None = None
                   ) -> tuple[int, float, dict[str, float], float]:
    """`_generation`'s figures at the rollout's `max_prefill_tokens`."""
    ro, w = _rollout(demand), demand.world_size
    breakdown = {"trained models": sum(r.idle_bytes(w) for r in demand.trained),
                 "frozen models": sum(f.idle_bytes(w) for f in demand.frozen),
                 "rollout weights": ro.weight_bytes, "generation workspace": ro.workspace_bytes()}
    used = sum(breakdown.values()) + SLACK_BYTES
    per_seq = ro.kv_bytes_per_seq()
    wanted = (ro.max_num_seqs + 1) * per_seq  # the engine's slots plus its scratch slot
    if ro.kv_cache_fraction is not None:
        kv = int(ro.kv_cache_fraction * max(free - used, 0))
    else:
        kv = min(wanted, max(int(cap - used), 0), wanted if room is None else max(int(room), 0))
        if kv < wanted:  # fewer slots than max_num_seqs: only the sequences that run need decode logits
            avail = max(int(cap - used + ro.logits_bytes_per_seq() * ro.max_num_seqs), 0)  # slots and their logits
            slots = max(avail - per_seq, 0) // (per_seq + ro.logits_bytes_per_seq())
            kv = min((min(slots, ro.max_num_seqs) + 1) * per_seq, avail, wanted if room is None else max(int(room), 0))
            breakdown["generation workspace"] = ro.workspace_bytes(max(kv // per_seq - 1, 0))
            used = sum(breakdown.values()) + SLACK_BYTES
    breakdown["KV cache"] = kv
    return kv, used + kv, breakdown, max(0.0, (ro.min_seqs + 1) * per_seq - kv)


def _rollout(demand: DeviceDemand) -> RolloutRole:
    """The demand's rollout engine, which the generation phase's plans need."""
    if demand.rollout is None:
        raise ValueError("the device plan's generation phase needs a rollout engine in the demand")
    return demand.rollout


def _kept_reserve(demand: DeviceDemand, cap: int) -> int:
    """The share of a KV cache kept through training that the updates plan around: what its slots need, at most
    half of what each update leaves beside its weights, gradients, state and workspace, and never so much that
    the update's smallest micro-batch (one sequence, recomputed unless checkpointing is set off) would not fit.
    The updates' micro-batches and the cache compete for the rest; the cache also gets what they leave unused."""
    ro = _rollout(demand)
    reserve = float((ro.max_num_seqs + 1) * ro.kv_bytes_per_seq())
    for role in demand.trained:
        alone = _role_plan(demand, role, cap, 0)[0]
        left = cap - SLACK_BYTES - (alone.peak_bytes - alone.breakdown["activations"])
        smallest = role.activation_peak(demand.longest_sequence, role.gradient_checkpointing is not False)
        reserve = min(reserve, max(0.0, min(left / 2, left - smallest)))
    return int(reserve)


def _check(demand: DeviceDemand, free: int, total: int) -> tuple[DevicePlan, float, list[str]]:
    """(the plan, the largest shortfall in bytes over all phases, what does not fit)."""
    cap = budget_bytes(demand, free, total)
    out = DevicePlan(cap_bytes=cap, total_bytes=total)
    problems, worst = [], 0.0
    ro = demand.rollout
    out.rollout_offload = ro is not None and bool(ro.offload_weights)
    kept = ro is not None and ro.cache_stays
    planned = ro is not None and kept and ro.kv_cache_fraction is None and bool(demand.trained)  # kept, sized here
    reserve = _kept_reserve(demand, cap) if planned else (
        _generation(demand, cap, free)[0] if kept else 0)  # a fraction's fixed size
    for role in demand.trained:
        out.roles[role.keys], short, why = _role_plan(demand, role, cap, reserve)
        if short:
            worst = max(worst, short)
            problems.append(f"{role.keys} update of {role.shape.describe()}: {why}")
    if ro is not None:
        updates = max((r.peak_bytes - reserve for r in out.roles.values()), default=0.0)
        room = cap - SLACK_BYTES - updates if planned else None
        kv, peak, breakdown, short, out.max_prefill_tokens = _generation(demand, cap, free, room)
        out.kv_cache_bytes, out.generation_peak_bytes, out.generation_breakdown = kv, peak, breakdown
        if planned:  # the updates run beside the cache: its share grew by what they left
            for r in out.roles.values():
                r.breakdown["KV cache (kept)"] = kv
                r.peak_bytes += kv - reserve
        if short:
            worst = max(worst, short)
            beside = (f", beside the update's {_gib(updates)}: rollout.free_cache_after_generate=false keeps it "
                      f"through training" if room is not None else "")
            problems.append(f"generation: the KV cache gets {_gib(kv)}, where a prompt's {ro.min_seqs} samples "
                            f"(rollout.n) of {ro.max_model_len:,} tokens and the scratch slot need {_gib(short + kv)} "
                            f"({_items(breakdown)}{beside})")
    return out, worst, problems


def plan(demand: DeviceDemand, free: int, total: int) -> DevicePlan:
    """The plan for a device with `free` of `total` bytes, the keys left to it chosen, or `DoesNotFit` naming what
    would fit."""
    choices = silent_choices(demand)
    for choice in choices:
        out, _, problems = _check(choice, free, total)
        if not problems:
            return out
    demand = choices[-1]  # every choice made: the refusal names what is still short, and the keys beyond them
    shorts = [(label, _check(changed, free, total)[1]) for label, changed in remedies(demand)]
    single = [label for label, short in shorts[:-1] if short == 0]
    (combined, short), = shorts[-1:]
    if single:
        hint = f"it fits with {single[0]}" + (f" (or: {'; '.join(single[1:])})" if len(single) > 1 else "")
    elif short == 0:
        hint = f"it fits with all memory options together: {combined}"
    else:
        more = f" (or a larger {CAP_KEY})" if demand.memory_cap is not None else ""
        hint = (f"it does not fit even with every memory option ({combined}: short by {_gib(short)}): use more "
                f"devices (trainer.n_workers){more}, shorter sequences (data.max_prompt_length, "
                f"data.max_response_length) or a smaller model")
    raise DoesNotFit(f"the run does not fit one device: {'; '.join(problems)}. Budget: {_gib(out.cap_bytes)} "
                     f"({budget_source(demand, total)}, {_gib(free)} free at start); {hint}")


def check_weights_fit(demand: DeviceDemand) -> None:
    """Refuses, before any model loads (the controller calls it with each group's demand), a
    `trainer.device_memory_gib` below the weights' own size."""
    problem = weights_problem(demand)
    if problem is not None:
        raise DoesNotFit(problem)


# plans made in this process, by (demand, device): colocated roles share a device and must share one plan
# made from the memory free before the first of them loaded anything
_PLANS: dict[tuple[DeviceDemand, torch.device], DevicePlan] = {}


def plan_for_device(demand: DeviceDemand | None, device: torch.device) -> DevicePlan | None:
    """`plan` for this process's device (None without a demand, or off an accelerator); the first call
    for a demand measures the free memory and holds the allocator to `trainer.device_memory_gib` (`cap.py`), later
    ones (the colocated roles) get the same plan."""
    if demand is None:
        return None
    key = (demand, torch.device(device))
    if key not in _PLANS:
        memory = device_memory(device)
        if memory is None:
            return None
        problem = hold_allocator(demand, torch.device(device), memory[1])
        if problem is not None:
            raise DoesNotFit(problem)
        _PLANS[key] = plan(demand, *memory)
        _PLANS[key].held_bytes = None if demand.memory_cap is None else allocator_bytes(demand.memory_cap)
    return _PLANS[key]


Section = TypeVar("Section", bound=EngineOptimConfig)


def apply_plan(plan_: DevicePlan | None, keys: str, model_cfg: ModelConfig, role_cfg: Section
               ) -> tuple[ModelConfig, Section]:
    """Copies of a trained role's model and role sections with what was left to the plan filled in:
    `gradient_checkpointing` (None -> the plan's, or off without a plan), `optimizer` (auto -> the plan's, or
    `default_optimizer` without one), `optimizer_offload` (None -> the plan's, or off) and
    `max_tokens_per_micro_batch` (None with no `micro_batch_size` -> the plan's token budget; without a plan the
    whole mini-batch)."""
    role = plan_.roles.get(keys) if plan_ is not None else None
    model_cfg, role_cfg = copy.copy(model_cfg), copy.copy(role_cfg)
    if model_cfg.gradient_checkpointing is None:
        model_cfg.gradient_checkpointing = role.gradient_checkpointing if role is not None else False
    if role_cfg.optimizer == "auto":
        role_cfg.optimizer = role.optimizer if role is not None else default_optimizer(
            2 if model_cfg.master_dtype == "bf16" else 4)
    if role_cfg.optimizer_offload is None:
        role_cfg.optimizer_offload = role.optimizer_offload if role is not None else False
    if role is not None and role_cfg.max_tokens_per_micro_batch is None and role_cfg.micro_batch_size is None:
        role_cfg.max_tokens_per_micro_batch = role.max_tokens
    return model_cfg, role_cfg


def apply_rollout_plan(plan_: DevicePlan | None, rollout_cfg: RolloutConfig) -> RolloutConfig:
    """A copy of the `rollout` section with `offload_weights` filled in where it was left to the plan (None -> the
    plan's, or off without a plan)."""
    rollout_cfg = copy.copy(rollout_cfg)
    if rollout_cfg.offload_weights is None:
        rollout_cfg.offload_weights = plan_.rollout_offload if plan_ is not None else False
    return rollout_cfg


def hold_beside(plan_: DevicePlan | None, device: torch.device, outside: int) -> None:
    """Where the plan holds this process's allocator to a cap: holds it to the cap less the `outside` bytes the
    process holds beyond the allocator now (0: the whole cap again)."""
    if plan_ is not None and plan_.held_bytes is not None:
        hold(device, plan_.held_bytes, plan_.total_bytes, outside)


def memory_keys(keys: str, model_keys: str) -> str:
    """The config keys that lower a trained role's memory, for error messages."""
    return (f"{keys}.max_tokens_per_micro_batch (smaller micro-batches), "
            f"{model_keys}.gradient_checkpointing=true, {keys}.optimizer=adamw_8bit or adamw_cpu_offload, "
            f"{keys}.param_offload / optimizer_offload=true, rollout.offload_weights=true, "
            f"trainer.gpu_memory_utilization (lower: more headroom) or {CAP_KEY} (higher: more memory)")


@contextlib.contextmanager
def reported_oom(what: str, plan_: DevicePlan | None, model: str | None, keys: str) -> Iterator[None]:
    """Turns a CUDA out-of-memory error inside the block into a `DeviceOutOfMemory` that names the phase,
    the model, the plan's estimate, the device's state and the keys to change."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        if isinstance(e, DeviceOutOfMemory):
            raise
        state = ""
        if torch.cuda.is_available():
            state = (f" (allocated {_gib(torch.cuda.memory_allocated())}, reserved "
                     f"{_gib(torch.cuda.memory_reserved())}, peak {_gib(torch.cuda.max_memory_allocated())})")
        model = f" of {model}" if model else ""
        estimate = f" The plan was: {plan_.describe()}." if plan_ is not None else ""
        raise DeviceOutOfMemory(f"{what}{model} ran out of device memory{state}.{estimate} To use less: "
                                f"{keys}. The CUDA error: {str(e).splitlines()[0]}") from None

"""What the device plan chooses where a run's memory keys are silent: the optimizer left `auto` (AdamW, 8-bit AdamW,
or with fp32 master weights the AdamW whose state lives and steps on the CPU), the rollout engine's weights offloaded while training (`rollout.offload_weights` left null) and the
optimizer state offloaded between uses (`optimizer_offload` left null), as the demands to try, cheapest first
(`silent_choices`); `default_optimizer`, what `auto` means where memory does not decide. `planning.plan` takes the
first that fits. (Checkpointing and the micro-batch token budget are chosen inside each role's plan.)
"""

from __future__ import annotations

import importlib.util
import itertools
from dataclasses import replace

from hybridflow.engine.budget.estimate import DeviceDemand


def default_optimizer(master_bytes: int) -> str:
    """What `optimizer=auto` runs where memory does not decide: AdamW, or with bf16 master weights the 8-bit AdamW
    whose stochastic rounding keeps updates below bf16's resolution."""
    return "adamw_8bit" if master_bytes == 2 else "adamw"


# what each choice left to the plan costs a step, in the order the plan prefers them: 8-bit AdamW (its moments
# rounded, no time), the rollout engine's weights to the CPU while training (a copy of the model each way and the
# CUDA graphs captured again), the optimizer state to the CPU between uses (the state each way: for full training
# the largest of the three), the optimizer's state and step on the CPU (the gradients down and the weights up at
# every step, and the update at the CPU's speed: for a LoRA run's few parameters a fraction of a second, for full
# training the slowest)
_CHOICE_COST = {"8-bit AdamW": 1, "rollout weights offloaded": 2, "optimizer state offloaded": 4, "CPU AdamW": 8}


def silent_choices(demand: DeviceDemand) -> list[DeviceDemand]:
    """The demand with what it left to the plan chosen, every combination once, the cheapest first (`_CHOICE_COST`):
    AdamW and nothing offloaded, 8-bit AdamW (where torchao is installed) for the optimizers left `auto`, the
    rollout engine's weights on the CPU while training (`offload_weights` left None), the optimizer state on the
    CPU between uses (`optimizer_offload` left None), and for `auto` optimizers of fp32 master weights (the CPU
    AdamW's own condition) `adamw_cpu_offload`. A combination that changes nothing more is left out."""
    eight_bit = importlib.util.find_spec("torchao") is not None

    def optimizer(master_bytes: int, low_state: bool, on_cpu: bool) -> str:
        if on_cpu and master_bytes == 4:
            return "adamw_cpu_offload"
        return "adamw_8bit" if low_state and eight_bit else default_optimizer(master_bytes)

    def chosen(low_state: bool, weights_off: bool, state_off: bool, on_cpu: bool) -> DeviceDemand:
        trained = tuple(replace(
            r, optimizer=r.optimizer if r.optimizer != "auto" else optimizer(r.master_bytes, low_state, on_cpu),
            optimizer_offload=state_off if r.optimizer_offload is None else r.optimizer_offload)
            for r in demand.trained)
        ro = demand.rollout
        rollout = None if ro is None else replace(
            ro, offload_weights=weights_off if ro.offload_weights is None else ro.offload_weights)
        return replace(demand, trained=trained, rollout=rollout)

    costs = list(_CHOICE_COST.values())
    combinations = sorted(itertools.product((False, True), repeat=len(costs)),
                          key=lambda picked: sum(c for c, on in zip(costs, picked) if on))
    out: list[DeviceDemand] = []
    for picked in combinations:
        choice = chosen(*picked)
        if choice not in out:
            out.append(choice)
    return out

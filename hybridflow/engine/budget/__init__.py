"""Device budgeting: what each part of a run needs on one accelerator, and what that leaves for the
training engine's micro-batches and the rollout engine's KV cache. Both engines consult it.

`estimate` says what each role holds (model sizes, bytes per part); `cap` is `trainer.device_memory_gib` (the
budget and the allocator held to it); `choices` the optimizer and offloads left to the plan; `planning` turns a
device's demand and free memory into micro-batch token budgets, checkpointing, those choices and a KV cache, or
refuses a run that cannot fit.
"""

from hybridflow.engine.budget.estimate import (CHECKPOINTED_TARGET_TOKENS, GIB, NF4_BYTES, STATE_BYTES,
                                               TARGET_TOKENS, DeviceDemand, FrozenRole, ModelShape, RolloutRole,
                                               TrainedRole, count)
from hybridflow.engine.budget.planning import (DeviceOutOfMemory, DevicePlan, DoesNotFit, RolePlan, apply_plan,
                                               apply_rollout_plan, check_weights_fit, device_memory, hold_beside,
                                               memory_keys, plan, plan_for_device, reported_oom)

__all__ = ["CHECKPOINTED_TARGET_TOKENS", "GIB", "NF4_BYTES", "STATE_BYTES", "TARGET_TOKENS", "DeviceDemand",
           "DeviceOutOfMemory", "DevicePlan", "DoesNotFit", "FrozenRole", "ModelShape", "RolePlan", "RolloutRole",
           "TrainedRole", "apply_plan", "apply_rollout_plan", "check_weights_fit", "count", "device_memory",
           "hold_beside", "memory_keys", "plan", "plan_for_device", "reported_oom"]

"""`TeacherWorker`: the teacher of on-policy distillation, a frozen causal LM beside the actor on each device.

The trainer colocates it with the actor (one process per device, `hybridflow.controller.colocate`) when
`teacher.model.path` is set, as the reference model is colocated; it may be larger than the policy, and with
`teacher.param_offload` its weights live on the CPU between calls. It is built from one typed
`TeacherWorker.Config`, resolved on the controller (`hybridflow.trainer.role_configs.teacher_config`). Its forwards
use the actor's micro-batching and packing, filled in by the same device plan as the actor's (the plan counts the
teacher's weights among the device's frozen models). `compute_teacher_log_probs` scores the tokens the policy
sampled, at the temperature they were sampled at, for the per-token reverse KL
(`hybridflow.algorithms.distillation`); `effective_values` reports its compute dtype and compilation.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.batch import Batch
from hybridflow.config.model_schema import FrozenModelConfig, ModelConfig
from hybridflow.config.schema import ActorConfig
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.engine import budget
from hybridflow.workers.base import DTYPE_NAMES, Effective
from hybridflow.workers.reference_model import ReferenceModel, scoring_temperature

TEACHER_MEMORY_KEYS = ("teacher.param_offload=true, actor.max_tokens_per_micro_batch (smaller micro-batches), "
                       "teacher.model.dtype=bf16, trainer.gpu_memory_utilization (lower: more headroom)")


class TeacherWorker(Worker):
    """The distillation teacher on this rank."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """What a teacher worker is built from, resolved on the controller.

        model: the teacher's model section (`teacher.model`).
        actor_model / actor: the actor's `model` and `actor` sections, whose micro-batching and packing the
            teacher's forwards use, as the device plan fills them in for the actor.
        param_offload: keep its weights on the CPU between calls (`teacher.param_offload`).
        memory: this device's demand (the actor's group's, which counts the teacher); None = no planning.
        topk: also return the teacher's k likeliest tokens at each response position (`teacher.topk`; 0: off).
        """

        model: FrozenModelConfig
        actor_model: ModelConfig
        actor: ActorConfig
        param_offload: bool = False
        memory: budget.DeviceDemand | None = None
        topk: int = 0

    def __init__(self, config: TeacherWorker.Config) -> None:
        self.plan = budget.plan_for_device(config.memory, self.device)
        _, batching = budget.apply_plan(self.plan, "actor", config.actor_model, config.actor)
        self.model_cfg, self.topk = config.model, config.topk
        self.teacher = ReferenceModel(config.model, batching, self.device, config.param_offload)

    @register(Dispatch.BROADCAST)
    def effective_values(self) -> Effective:
        """The teacher's compute dtype and compilation where `teacher.model` left them to the device (rank 0's),
        and its device's plan (the actor's)."""
        engine = self.teacher.engine
        values = {"teacher.model.dtype": DTYPE_NAMES.get(str(engine.precision.param), self.model_cfg.dtype),
                  "teacher.model.compile": engine.compiled}
        return Effective(values, None if self.plan is None else self.plan.describe())

    @register(Dispatch.DATA_PARALLEL)
    def compute_teacher_log_probs(self, batch: Batch, temperature: float) -> Batch:
        """Batch{teacher_log_probs [B, R]}: the teacher's log-probs of the response tokens, for rows sampled at
        `temperature` (greedy rows scored at 1); with `topk`, also `teacher_topk_ids` (long) and
        `teacher_topk_log_probs` `[B, R, k]`, its k likeliest tokens at each response position."""
        with budget.reported_oom("teacher log-prob pass", self.plan, self.teacher.engine.describe(),
                                 TEACHER_MEMORY_KEYS):
            out = self.teacher.scores(batch, scoring_temperature(temperature), self.topk)
        return Batch({"teacher_log_probs": out["log_probs"],
                      **({"teacher_topk_ids": out["topk_ids"], "teacher_topk_log_probs": out["topk_log_probs"]}
                         if self.topk else {})})

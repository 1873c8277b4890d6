"""The memory keys end to end: a run planned against a simulated GPU (refused before any model loads when it
cannot fit; micro-batches sized by the plan when it can), and GRPO runs with each memory option."""

from __future__ import annotations

import math

import pytest

from hybridflow.config.loader import load_config
from hybridflow.controller.errors import WorkerError
from hybridflow.engine.budget import planning
from rl_helpers import run

GIB = 2**30


@pytest.fixture
def simulated_gpu(monkeypatch):
    """Plans are made for the CPU device as for a GPU with `free` of `total` bytes."""
    monkeypatch.setattr(planning, "_PLANS", {})

    def use(free: float, total: float = 141 * GIB) -> None:
        monkeypatch.setattr(planning, "device_memory", lambda device: (int(free), int(total)))

    return use


def test_a_run_that_cannot_fit_is_refused_before_any_model_loads(tiny_qwen2, data_dir, tmp_path, simulated_gpu,
                                                                 monkeypatch):
    simulated_gpu(free=3 * GIB)

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the device plan refused the run")

    monkeypatch.setattr("hybridflow.engine.train.engine.load_model", no_loading)
    with pytest.raises(WorkerError) as err:
        run(tiny_qwen2, data_dir, tmp_path)
    msg = str(err.value).splitlines()[0]
    assert "DoesNotFit: the run does not fit one device: actor update of 140.1K parameters (2 layers, hidden 64" in msg
    assert "optimizer state and workspace alone take 3.5 GiB" in msg and "Budget: 3.0 GiB" in msg
    assert "trainer.gpu_memory_utilization=0.9" in msg and "trainer.n_workers" in msg


def test_micro_batches_and_checkpointing_come_from_the_plan(tiny_qwen2, data_dir, tmp_path, simulated_gpu, capsys):
    simulated_gpu(free=80 * GIB)
    rows = run(tiny_qwen2, data_dir, tmp_path, "trainer.gpu_memory_utilization=0.5")
    assert math.isfinite(rows[-1]["actor/pg_loss"])
    out = capsys.readouterr().out
    # a model this small is host-bound: recomputed micro-batches by default, as long as the cap allows (its
    # layers are far smaller than the 0.5B shape's: ModelShape.host_bound_tokens)
    assert "device plan of actor: device budget 70.5 GiB of 141.0 GiB; actor update: 262,144-token micro-batches, " \
           "gradient checkpointing on" in out
    assert "generation: KV cache" in out
    resolved = (tmp_path / "resolved_config.yaml").read_text()
    assert resolved.startswith("# device plan of actor: device budget 70.5 GiB")
    cfg = load_config([], tmp_path / "resolved_config.yaml")
    assert cfg.actor.max_tokens_per_micro_batch == 262_144 and cfg.model.gradient_checkpointing is True


def test_cpu_offloaded_optimizer_trains(tiny_qwen2, data_dir, tmp_path):
    rows = run(tiny_qwen2, data_dir, tmp_path, "actor.optimizer=adamw_cpu_offload")
    assert [r["step"] for r in rows if r["step"] > 0] == [1, 2]
    assert all(math.isfinite(r["actor/grad_norm"]) for r in rows if r["step"] > 0)


def test_large_model_options_train_together(tiny_qwen2, data_dir, tmp_path):
    """bf16 master weights with 8-bit AdamW (`actor.optimizer=auto` chooses it for them), compiled layers,
    rollout weights offloaded between phases, gradient checkpointing: the 14B recipe's keys on a tiny model
    (torch.compile and torchao compile their kernels first: the slowest test of the suite, ~2 min on 2 cores)."""
    pytest.importorskip("torchao")
    reward = tmp_path / "digits.py"  # a reward with signal on a random model, so the step has gradients
    reward.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)\n")
    rows = run(tiny_qwen2, data_dir, tmp_path / "run", f"reward.function={reward}:score", "data.max_response_length=16",
               "model.dtype=bf16", "model.master_dtype=bf16",
               "model.compile=true", "model.gradient_checkpointing=true",  # actor.optimizer follows: adamw_8bit
               "rollout.offload_weights=true", "actor.param_offload=true", "actor.optimizer_offload=true",
               "trainer.val_every=0", "trainer.val_before_train=false")
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["actor/pg_loss"]) and r["actor/grad_norm"] > 0 for r in steps)
    assert load_config([], tmp_path / "run" / "resolved_config.yaml").actor.optimizer == "adamw_8bit"


def test_bf16_master_weights_need_the_stochastically_rounding_optimizer(tiny_qwen2, data_dir, tmp_path):
    from hybridflow.config.validate import ConfigError

    with pytest.raises(ConfigError, match="model.master_dtype=bf16 needs actor.optimizer=adamw_8bit"):
        run(tiny_qwen2, data_dir, tmp_path, "model.master_dtype=bf16", "model.dtype=bf16", "actor.optimizer=adamw")

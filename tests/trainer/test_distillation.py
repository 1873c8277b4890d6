"""On-policy distillation (`teacher.*`) on tiny models: the KL to a fixed teacher falls, the advantage is the task's
plus the weighted reverse KL, what distillation alone leaves out, and the checks on the teacher."""

from __future__ import annotations

import pytest
import torch

from hybridflow import algorithms
from hybridflow.config import ConfigError, load_config, validate
from hybridflow.config.resolved import resolve_facts
from hybridflow.trainer import step_math
from rl_helpers import base_overrides, read_metrics, reward_file, run


@pytest.fixture(scope="module")
def sharpened_student(tiny_qwen2, tmp_path_factory):
    """The tiny model with its final norm's weight x4: the same tokenizer, far more peaked next-token
    distributions, so its reverse KL to the tiny model (the teacher) starts large."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("sharpened_student")
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    with torch.no_grad():
        model.model.norm.weight.mul_(4.0)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_qwen2).save_pretrained(out)
    return out


def distill(teacher, *extra):
    return (f"teacher.model.path={teacher}", "actor.kl_loss_coef=0", "trainer.val_before_train=false",
            "trainer.val_every=0", "data.max_response_length=8", *extra)


def test_distillation_alone_lowers_the_kl_to_a_fixed_teacher(sharpened_student, tiny_qwen2, data_dir, tmp_path):
    # rollout.n=1 and no critic: the estimator does not run without the task reward
    rows = run(sharpened_student, data_dir, tmp_path,
               *distill(tiny_qwen2, "teacher.param_offload=true", "rollout.n=1", "data.train_batch_size=8",
                        "actor.lr=3e-3", "trainer.total_steps=3"), recipe="recipes/distill.yaml")
    kl = [r["teacher/kl"] for r in rows]
    assert kl[0] > 0.3 and kl[-1] < kl[0] / 2
    assert all(r["teacher/log_prob"] < 0 and "timing_s/teacher" in r for r in rows)
    resolved = load_config([], tmp_path / "resolved_config.yaml")  # what the teacher's worker ran with
    assert resolved.teacher.model.dtype == "fp32" and resolved.teacher.model.compile is False
    assert resolved.teacher.model.path == str(tiny_qwen2) and resolved.teacher.param_offload


@pytest.mark.parametrize("beta", [1.0, 0.0])
def test_top_k_distillation_alone_lowers_both_kls(sharpened_student, tiny_qwen2, data_dir, tmp_path, beta):
    # teacher.kl_coef=0: no advantage at all, the KL to the teacher's top 8 (teacher.topk) is the only loss
    rows = run(sharpened_student, data_dir, tmp_path,
               *distill(tiny_qwen2, "teacher.topk=8", "teacher.kl_coef=0", "teacher.topk_coef=1.0", "rollout.n=1",
                        f"teacher.topk_beta={beta}", "data.train_batch_size=8", "actor.lr=1e-3",
                        "trainer.total_steps=4"), recipe="recipes/distill.yaml")
    topk_kl, kl = [r["teacher/topk_kl"] for r in rows], [r["teacher/kl"] for r in rows]
    assert topk_kl[0] > 0.1 and topk_kl[-1] < topk_kl[0] / 10  # over the teacher's top 8 and the rest
    assert kl[-1] < kl[0] / 2  # the sampled tokens' reverse KL follows
    assert all(r["actor/pg_loss"] == 0 for r in rows)


def test_the_advantage_is_the_tasks_plus_the_weighted_reverse_kl(tiny_qwen2, sharpened_student, data_dir, tmp_path,
                                                                 monkeypatch):
    seen = []
    compute_advantages = step_math.compute_advantages

    def spy(batch, cfg, facts):
        metrics = compute_advantages(batch, cfg, facts)
        seen.append(batch)
        return metrics

    monkeypatch.setattr(step_math, "compute_advantages", spy)
    rows = run(tiny_qwen2, data_dir, tmp_path,
               *distill(sharpened_student, "teacher.task_reward=true", "teacher.kl_coef=0.5",
                        "teacher.model.dtype=fp32", "actor.skip_old_log_probs=false", "trainer.total_steps=1",
                        f"reward.function={reward_file(tmp_path)}"), recipe="recipes/distill.yaml")
    batch = seen[0]
    mask = batch["response_mask"]
    task, _ = algorithms.compute_advantages("grpo", batch)
    reverse_kl = batch["old_log_probs"] - batch["teacher_log_probs"]
    torch.testing.assert_close(batch["advantages"], (task - 0.5 * reverse_kl * mask).float())
    assert task.abs().sum() > 0 and (reverse_kl * mask).abs().sum() > 0
    assert rows[0]["teacher/kl"] == pytest.approx(float((reverse_kl * mask).sum() / mask.sum()), rel=1e-5)


def test_distillation_alone_needs_no_critic_group_or_baseline(tiny_qwen2):
    alone = load_config([f"teacher.model.path={tiny_qwen2}", "rollout.n=1", "algorithm.adv_estimator=gae"])
    facts = resolve_facts(alone)
    assert facts.teacher and not facts.task_advantage and not facts.critic and not facts.greedy_baseline
    assert facts.groups == {"actor": 1}  # the teacher shares the actor's processes
    validate(alone, check_paths=False)
    with_task = load_config([f"teacher.model.path={tiny_qwen2}", "teacher.task_reward=true", "rollout.n=1"])
    with pytest.raises(ConfigError, match="algorithm.adv_estimator=grpo compares the responses of one prompt"):
        validate(with_task, check_paths=False)


def test_teacher_checks_name_the_keys(tiny_qwen2, data_dir, tmp_path):
    from hybridflow.utils.tiny_model import build_tokenizer

    other_vocabulary = tmp_path / "bpe"
    build_tokenizer(["hello world, hello there"] * 20).save_pretrained(other_vocabulary)  # with learnt merges
    cfg = load_config(base_overrides(tiny_qwen2, data_dir, tmp_path, f"teacher.model.path={tmp_path}/missing",
                                     "teacher.kl_coef=0", "algorithm.use_kl_in_reward=true"))
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    for text in ("teacher.kl_coef=0.0 must be > 0", "algorithm.use_kl_in_reward=true shapes the task reward",
                 f"teacher.model.path={tmp_path}/missing: no such directory"):
        assert text in str(err.value)
    with pytest.raises(ConfigError, match=r"teacher.topk_beta=1.5 must be in \[0, 1\]"):
        validate(load_config(base_overrides(tiny_qwen2, data_dir, tmp_path, f"teacher.model.path={tiny_qwen2}",
                                            "teacher.topk=4", "teacher.topk_beta=1.5")))
    with pytest.raises(ConfigError, match="teacher.topk=-1 must be >= 0"):
        validate(load_config(base_overrides(tiny_qwen2, data_dir, tmp_path, f"teacher.model.path={tiny_qwen2}",
                                            "teacher.topk=-1")))
    with pytest.raises(ConfigError, match=r"teacher.topk=100000 is more than the teacher's \d+ logits \(vocab_size in "
                                          r".*config.json\): set teacher.topk to at most \d+"):
        validate(load_config(base_overrides(tiny_qwen2, data_dir, tmp_path, f"teacher.model.path={tiny_qwen2}",
                                            "teacher.topk=100000")))
    with pytest.raises(ConfigError, match="teacher.topk=8 distils from a teacher's top-k; set teacher.model.path"):
        validate(load_config(base_overrides(tiny_qwen2, data_dir, tmp_path, "teacher.topk=8")))
    cfg = load_config(base_overrides(tiny_qwen2, data_dir, tmp_path, f"teacher.model.path={tiny_qwen2}",
                                     f"teacher.model.tokenizer_path={other_vocabulary}"))
    with pytest.raises(ConfigError, match=r"teacher.model: the tokenizer at .*bpe \(\d+ tokens\) is not the policy's"):
        validate(cfg)

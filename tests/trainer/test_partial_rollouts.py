"""Partial rollouts and the pipelined separate rollout through `hybridflow train` on a tiny model whose responses
stop after 1 to 16 tokens: unfinished samples are carried into later steps (their tokens' policy versions
recorded, staleness bounded, stale groups dropped and counted), and a run stopped with samples in flight resumes
bitwise equal to the uninterrupted run."""

from __future__ import annotations

import pytest
import torch

from hybridflow.cli import main as cli_main
from hybridflow.config import ConfigError, load_config, validate
from rl_helpers import read_metrics, reward_file
from test_rl_resume_and_backends import comparable

SMALL = ("data.train_batch_size=2", "rollout.n=2", "data.max_prompt_length=256", "data.max_response_length=32",
         "trainer.val_before_train=false", "trainer.val_every=0", "trainer.loggers=[jsonl]", "reward.num_workers=0")
PARTIAL = ("rollout.partial=true",)  # rollout.free_cache_after_generate follows: false (hybridflow.config.follow)
PIPELINE = ("rollout.pipeline=true",)  # rollout.placement follows: separate


def train(model, data_dir, out, *overrides):
    args = [f"model.path={model}", f"data.train_files={data_dir}/train.parquet", *SMALL, *overrides,
            f"reward.function={reward_file(out.parent)}", f"trainer.output_dir={out}"]
    assert cli_main(["train", *args]) == 0
    return read_metrics(out)


def resumed_equals_straight(model, data_dir, tmp_path, *overrides) -> list[dict]:
    """Runs 4 steps straight, and 2 steps then 2 more resumed from the step-2 checkpoint; asserts the resumed
    steps' metrics are those of the straight run exactly; returns the straight run's rows."""
    straight = train(model, data_dir, tmp_path / "straight", "trainer.total_steps=4", "trainer.save_every=2",
                     *overrides)
    train(model, data_dir, tmp_path / "resumed", "trainer.total_steps=2", *overrides)
    resumed = train(model, data_dir, tmp_path / "resumed", "trainer.total_steps=4", *overrides)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for step in (3, 4):
        assert comparable(resumed[step - 1]) == comparable(straight[step - 1]), step
    return straight


def in_flight_at(checkpoint) -> list[dict]:
    """The samples of every group in flight in a checkpoint (rank 0's buffer)."""
    state = torch.load(checkpoint / "controller.pt", weights_only=True)["rollouts"]
    return [s for group in state["partial"][0]["groups"] for s in group["samples"]]


def test_unfinished_samples_carry_over_and_a_resumed_run_equals_the_uninterrupted_one(stopping_qwen2, data_dir,
                                                                                        tmp_path):
    rows = resumed_equals_straight(stopping_qwen2, data_dir, tmp_path, *PARTIAL)
    resolved = (tmp_path / "straight/resolved_config.yaml").read_text()
    assert ("#   rollout.free_cache_after_generate=false: rollout.partial=true with rollout.partial_unfinished=continue "
            "keeps unfinished samples' KV slots") in resolved and "free_cache_after_generate: false" in resolved
    samples = in_flight_at(tmp_path / "resumed/checkpoints/step_00000002")
    assert any(s["finish"] == "" and len(s["tokens"]) for s in samples)  # a sample stopped mid-response
    assert all(len(s["versions"]) == len(s["tokens"]) == len(s["logprobs"]) for s in samples)
    assert all(r["rollout/carried_over"] > 0 for r in rows)
    assert max(r["rollout/staleness_max"] for r in rows) == 1  # trained one version after its first token
    assert max(r["rollout/off_policy_token_share"] for r in rows) > 0
    assert all(r["rollout/dropped"] >= 0 for r in rows)
    assert all(0 < r["perf/gen/batch_occupancy"] <= 1 for r in rows if "perf/gen/batch_occupancy" in r)
    # a decoded token attends over at least its prompt (here 8 tokens or more); the rate is the bytes over wall time
    reads = [(r["perf/gen/mean_context"], r["perf/gen/kv_read_tb_s"]) for r in rows if "perf/gen/mean_context" in r]
    assert reads and all(context > 8 and rate > 0 for context, rate in reads)
    # what generation made covers what was trained (2 prompts x 2 samples a step), and more: the tokens of the
    # samples still in flight after the last step were generated too
    trained = sum(4 * r["response_length/mean"] for r in rows)
    assert sum(r["perf/gen/generated_tokens"] for r in rows) > trained > 0


def test_samples_decoding_on_in_their_kv_slots_are_held_to_the_staleness_bound(stopping_qwen2, data_dir, tmp_path,
                                                                               caplog):
    # no checkpoint or validation suspends them: their tokens' versions stay in the engine until they finish
    with caplog.at_level("WARNING", logger="hybridflow.trainer.rollout_stream"):
        rows = train(stopping_qwen2, data_dir, tmp_path / "out", *PARTIAL, "trainer.total_steps=4",
                     "rollout.partial_stale=drop")
    assert max(r["rollout/staleness_max"] for r in rows) == 1
    assert sum(r["rollout/dropped"] for r in rows) > 0  # the groups that would have trained 2 versions late
    assert not any("rollout/stale_finished" in r for r in rows)
    # a step that drops more than a tenth of its samples is named once, with the keys to change
    warnings = [r.getMessage() for r in caplog.records if "too stale" in r.getMessage()]
    assert len(warnings) == 1 and "rollout.max_staleness=1" in warnings[0]
    assert "set rollout.partial_stale=finish" in warnings[0]
    assert any(r["rollout/dropped"] > 0.1 * (r["rollout/dropped"] + 4) for r in rows)


def test_groups_the_next_step_would_drop_are_finished_and_trained_instead(stopping_qwen2, data_dir, tmp_path):
    # the same run as above with the default rollout.partial_stale=finish: nothing is thrown away
    rows = train(stopping_qwen2, data_dir, tmp_path / "out", *PARTIAL, "trainer.total_steps=4")
    assert max(r["rollout/staleness_max"] for r in rows) == 1
    assert all(r["rollout/dropped"] == 0 for r in rows)
    assert sum(r["rollout/stale_finished"] for r in rows) > 0  # what the drop run above threw away
    assert all(r["timing_s/gen_stale_wait"] >= 0 for r in rows)
    assert all(r["rollout/carried_over"] > 0 for r in rows)


def test_stale_groups_are_dropped_and_counted_when_recomputing(stopping_qwen2, data_dir, tmp_path):
    rows = train(stopping_qwen2, data_dir, tmp_path / "out", *PARTIAL, "trainer.total_steps=3",
                 "rollout.max_staleness=0", "rollout.partial_unfinished=recompute", "rollout.partial_extra_batches=2",
                 "actor.rollout_correction.mode=decoupled", "rollout.partial_stale=drop")
    assert sum(r["rollout/dropped"] for r in rows) > 0
    assert all(r["rollout/staleness_max"] == 0 and r["rollout/off_policy_token_share"] == 0 for r in rows)


def test_validation_between_steps_keeps_the_samples_in_flight(stopping_qwen2, data_dir, tmp_path):
    # validation generates on the same engine: it suspends the samples in flight, which the next step prefills
    rows = train(stopping_qwen2, data_dir, tmp_path / "out", *PARTIAL, "trainer.total_steps=2", "trainer.val_every=1",
                 f"data.val_files={data_dir}/test.parquet")
    assert all("val/reward/mean" in r for r in rows)
    assert all(r["rollout/carried_over"] > 0 for r in rows)
    assert rows[1]["rollout/staleness_max"] == 1 and rows[1]["rollout/off_policy_token_share"] > 0


def test_each_data_parallel_rank_gives_its_share_of_complete_groups(stopping_qwen2, data_dir, tmp_path):
    rows = train(stopping_qwen2, data_dir, tmp_path / "out", *PARTIAL, "trainer.total_steps=1", "trainer.n_workers=2")
    assert [r["step"] for r in rows] == [1] and rows[0]["rollout/carried_over"] > 0
    state = torch.load(tmp_path / "out/checkpoints/step_00000001/controller.pt", weights_only=True)["rollouts"]
    assert [len(rank["groups"]) for rank in state["partial"]] == [1, 1]  # one buffer per rank, one group left each


def test_pipelined_separate_rollout_trains_one_step_off_policy(stopping_qwen2, data_dir, tmp_path):
    rows = train(stopping_qwen2, data_dir, tmp_path / "out", *PIPELINE, "trainer.total_steps=2")
    assert rows[0]["rollout/staleness_max"] == 0  # the first step generates its own batch
    assert rows[1]["rollout/staleness_mean"] == 1 and rows[1]["rollout/off_policy_token_share"] == 1


def test_pipelined_partial_rollouts_resume_exactly(stopping_qwen2, data_dir, tmp_path):
    rows = resumed_equals_straight(stopping_qwen2, data_dir, tmp_path, *PARTIAL, *PIPELINE,
                                   "rollout.partial_unfinished=recompute")
    assert all(r["rollout/staleness_mean"] >= 1 for r in rows[1:])
    assert all(r["rollout/off_policy_token_share"] == 1 for r in rows[1:])


def _problems(*overrides) -> str:
    with pytest.raises(ConfigError) as e:
        validate(load_config(["rollout.n=2", *overrides]), check_paths=False)
    return str(e.value)


def test_what_partial_rollouts_and_pipelining_cannot_run_with_is_refused():
    assert ("rollout.partial_unfinished=continue keeps unfinished samples' KV slots from one step to the next, which "
            "rollout.free_cache_after_generate=true frees") in _problems("rollout.partial=true",
                                                                         "rollout.free_cache_after_generate=true")
    assert "set rollout.placement=separate (unset, it follows; got colocate)" in _problems(
        "rollout.pipeline=true", "rollout.placement=colocate")
    assert "rollout.max_staleness=0 must be >= 1" in _problems("rollout.pipeline=true", "rollout.placement=separate",
                                                               "rollout.max_staleness=0")
    assert ("rollout.partial=true does not run with algorithm.filter_groups.enable=true"
            ) in _problems("rollout.partial=true", "rollout.partial_unfinished=recompute",
                           "algorithm.filter_groups.enable=true")
    assert "rollout.partial=true does not run with agent.runner (multi-turn episodes)" in _problems(
        "rollout.partial=true", "rollout.partial_unfinished=recompute", "agent.runner=agent.py:play")
    assert "rollout.pipeline=true does not run with rollout.exact=true" in _problems(
        "rollout.pipeline=true", "rollout.placement=separate", "rollout.exact=true")
    assert "rollout.partial=true does not run with rollout.engine=hf" in _problems(
        "rollout.partial=true", "rollout.partial_unfinished=recompute", "rollout.engine=hf")
    assert "rollout.partial=true does not run with rollout.record_routes=true" in _problems(
        "rollout.partial=true", "rollout.partial_unfinished=recompute", "rollout.record_routes=true")
    assert ("valid data.train_batch_size: multiples of 4") in _problems(
        "rollout.partial=true", "rollout.partial_unfinished=recompute", "data.train_batch_size=6",
        "trainer.n_workers=4", "actor.mini_batch_size=2")
    assert "rollout.partial_extra_batches=-1 must be >= 0" in _problems("rollout.partial_extra_batches=-1")
    assert ("rollout.partial_extra_batches=2 keeps more prompt batches in flight than rollout.max_staleness=1 lets a "
            "step finish in time") in _problems("rollout.partial=true", "rollout.partial_unfinished=recompute",
                                                "rollout.partial_extra_batches=2")

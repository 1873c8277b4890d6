"""The in-flight buffer of partial rollouts on one engine (CPU, fp32): a step takes the oldest complete groups and
carries the rest, each token keeping the policy version that sampled it; stale groups are dropped whole; a buffer
saved and loaded into a fresh engine goes on exactly as the saved one does; buffers saved by one number of ranks
are dealt out to another."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hybridflow.engine.rollout import RolloutEngine, SamplingParams
from hybridflow.trainer.rollout_stream import redistribute
from hybridflow.workers.partial_rollout import PartialRollouts

# a sixth of the tiny vocabulary stops a sample: lengths spread from 1 to 24
PARAMS = SamplingParams(n=2, temperature=1.0, max_tokens=24, stop_token_ids=list(range(20, 65)))
PROMPTS = [[5 + i, 6, 7, 8 + i] for i in range(6)]


def buffer(path, unfinished="continue"):
    engine = RolloutEngine.from_pretrained(path, max_num_seqs=8, max_model_len=64)
    out = PartialRollouts(engine, unfinished)
    out.add(PROMPTS[:4], [{"uid": f"u{i}"} for i in range(4)], PARAMS.n)
    return out


def seeded(seed):
    return replace(PARAMS, seed=seed)


def lengths(groups):
    return [[len(s.tokens) for s in g.samples] for g in groups]


@pytest.fixture(scope="module")
def model(tiny_qwen2):
    return tiny_qwen2


def test_a_step_takes_the_oldest_complete_groups_and_carries_the_rest(model):
    buf = buffer(model)
    taken, stats = buf.take(2, version=0, params=seeded(1))
    assert len(taken) == 2 and all(g.complete for g in taken) and len(buf.groups) == 2
    assert stats["in_flight"] == 4 and stats["decode_steps"] > 0
    buf.add(PROMPTS[4:], [{"uid": "u4"}, {"uid": "u5"}], PARAMS.n)
    later, _ = buf.take(2, version=1, params=seeded(2))
    orders = [g.order for g in later]
    assert orders == sorted(orders)
    versions = {v for g in taken + later for s in g.samples for v in s.versions}
    assert versions <= {0, 1} and all(len(s.versions) == len(s.tokens) for g in later for s in g.samples)


@pytest.mark.parametrize("unfinished", ["continue", "recompute"])
def test_a_saved_buffer_goes_on_in_a_fresh_engine_exactly_as_the_saved_one(model, unfinished):
    buf = buffer(model, unfinished)
    buf.take(1, version=0, params=seeded(1))
    state = buf.state_dict()
    assert any(s["finish"] == "" and len(s["tokens"]) for g in state["groups"] for s in g["samples"])
    other = buffer(model, unfinished)
    other.load_state_dict(state)
    for b in (buf, other):
        b.add(PROMPTS[4:], [{"uid": "u4"}, {"uid": "u5"}], PARAMS.n)
    mine, _ = buf.take(2, version=1, params=seeded(5))
    theirs, _ = other.take(2, version=1, params=seeded(5))
    assert [[(s.tokens, s.logprobs, s.versions) for s in g.samples] for g in mine] == \
        [[(s.tokens, s.logprobs, s.versions) for s in g.samples] for g in theirs]


def test_stale_groups_are_dropped_whole_and_their_slots_freed(model):
    buf = buffer(model)
    buf.take(1, version=0, params=seeded(1))
    started = [g for g in buf.groups if g.oldest_version == 0]
    assert started
    counts = buf.in_flight(oldest_version=1)
    assert counts == {"groups": 3 - len(started), "dropped": 2 * len(started)}
    assert len(buf.session.scheduler.free_slots) + len(buf.session.batch) == buf.engine.kv.num_slots


def test_a_take_told_what_the_next_step_keeps_finishes_the_older_groups_first(model):
    dropping, finishing = buffer(model), buffer(model)
    for buf in (dropping, finishing):
        buf.take(1, version=0, params=seeded(1))
        buf.add(PROMPTS[4:], [{"uid": "u4"}, {"uid": "u5"}], PARAMS.n)
    started = [g.order for g in finishing.groups if g.oldest_version == 0]
    assert len(started) > 1  # prefilled at version 0 and not taken: the step at version 2 would drop them
    _, plain = dropping.take(1, version=1, params=seeded(2))
    assert "stale_finished" not in plain
    taken, stats = finishing.take(1, version=1, params=seeded(2), finish_before=1)
    assert [g.order for g in taken] == started[:1] and taken[0].complete  # the oldest, waited for and taken first
    # its samples were still running when the take without the bound returned
    assert stats["stale_finished"] == 2 * sum(not g.complete for g in dropping.groups if g.order == started[0]) > 0
    assert stats["stale_wait_s"] > 0
    # a take finishes at most as many as it takes: the next step drops the others
    assert finishing.in_flight(oldest_version=1)["dropped"] == 2 * (len(started) - 1)


def test_buffers_saved_by_two_ranks_are_dealt_to_three():
    states = [{"next_order": 3, "groups": [{"order": 1}, {"order": 2}]}, {"next_order": 2, "groups": [{"order": 1}]}]
    assert redistribute(states, 2) is states
    three = redistribute(states, 3)
    assert [[g["order"] for g in s["groups"]] for s in three] == [[1], [1], [2]]
    assert {s["next_order"] for s in three} == {3}


@pytest.mark.parametrize("pipeline, critic, step, keeps", [
    (False, False, 3, 4 - 1),  # the next step trains at version 4 and keeps max_staleness=1 behind it
    (True, False, 3, 3 + 1 - 1),  # pipelined: the next call generates with version 3's weights, trains at 4
    (False, True, 1, 0 - 1),  # critic warm-up (2 steps): step 2 still trains at version 0
    (False, True, 3, 2 - 1),
])
def test_what_the_next_step_keeps_follows_the_policy_version(pipeline, critic, step, keeps):
    """`RolloutStream._next_keeps`, which `rollout.partial_stale=finish` finishes everything older than."""
    from types import SimpleNamespace

    from hybridflow.trainer.rollout_stream import RolloutStream

    stream = SimpleNamespace(cfg=SimpleNamespace(rollout=SimpleNamespace(pipeline=pipeline, max_staleness=1),
                                                 critic=SimpleNamespace(warmup_steps=2)),
                             facts=SimpleNamespace(critic=critic))
    assert RolloutStream._next_keeps(stream, step) == keeps

"""What partial rollouts need from a session (CPU, fp32): each token records the weight version that sampled
it, a sequence suspended unfinished and prefilled again (prompt + its tokens so far) goes on as if it had never
stopped, queued prompts come back empty with their slots free, and `reseed` makes what follows depend on the
seed alone."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine.rollout import RolloutEngine, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[])


@pytest.fixture(scope="module")
def engine(spread_model):
    return RolloutEngine.from_pretrained(spread_model("qwen2"), max_num_seqs=4, max_model_len=64)


def test_tokens_record_the_weight_version_that_sampled_them(engine):
    session = engine.session(GREEDY)
    (seq,) = session.add([5, 6, 7, 8])
    session.step()  # the prefill: the first token
    session.step()  # 8 decode steps
    engine.weight_version = 7
    try:
        done = session.run()
    finally:
        engine.weight_version = 0
    assert done[seq].versions == [0] * 9 + [7] * 3


def test_a_suspended_sequence_prefilled_again_goes_on_as_if_uninterrupted(engine):
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18], [19, 20, 21]]
    straight = engine.generate(prompts, GREEDY)
    session = engine.session(GREEDY)
    seqs = [session.add(p)[0] for p in prompts]  # 5 prompts on 4 slots: the last one waits
    session.step()
    session.step()
    partial = session.suspend()
    assert not session.has_work and len(session.scheduler.free_slots) == engine.kv.num_slots
    assert partial[seqs[4]].token_ids == [] and partial[seqs[4]].finish_reason == "suspended"
    assert all(len(partial[s].token_ids) == 9 for s in seqs[:4])
    again = engine.session(GREEDY)
    resumed = {again.add(p + partial[s].token_ids, max_tokens=12 - len(partial[s].token_ids))[0]: s
               for p, s in zip(prompts, seqs)}
    for new, completion in again.run().items():
        before = partial[resumed[new]]
        (whole,) = straight[seqs.index(resumed[new])]
        assert before.token_ids + completion.token_ids == whole.token_ids
        torch.testing.assert_close(torch.tensor(before.logprobs + completion.logprobs), torch.tensor(whole.logprobs),
                                   atol=1e-5, rtol=0)


def test_suspending_some_sequences_leaves_the_others_running(engine):
    session = engine.session(GREEDY)
    a, b = session.add([5, 6, 7, 8])[0], session.add([9, 10, 11])[0]
    session.step()
    assert set(session.suspend([a])) == {a}
    done = session.run()
    assert set(done) == {b} and len(done[b].token_ids) == 12
    (n_samples,) = [session.add([1, 2, 3], n=2)]
    with pytest.raises(ValueError, match="prefilled together"):
        session.suspend(n_samples[:1])


def test_reseed_makes_what_follows_depend_on_the_seed_alone(engine):
    params = SamplingParams(temperature=1.0, max_tokens=10, stop_token_ids=[], seed=1)
    first = engine.session(params)
    first.add([5, 6, 7])
    first.run()
    first.reseed(9)
    (a,) = first.add([8, 9, 10, 11], n=2)[:1]
    reseeded = first.run()[a]
    fresh = engine.session(SamplingParams(temperature=1.0, max_tokens=10, stop_token_ids=[], seed=9))
    (b,) = fresh.add([8, 9, 10, 11], n=2)[:1]
    assert fresh.run()[b].token_ids == reseeded.token_ids
    assert fresh.stats["row_steps"] == 2 * 9  # two rows through 9 decode steps


def test_context_steps_count_the_positions_each_decode_step_attends_over(engine):
    """Runs of 8 decode steps between looks: a row whose prompt has L tokens decodes its 11 tokens after the first
    (sampled by the prefill) at contexts L + 1 .. L + 11."""
    session = engine.session(GREEDY)
    session.add([5, 6, 7, 8])
    session.add([9, 10, 11])
    session.run()
    assert session.stats["decode_steps"] == 11
    assert session.stats["context_steps"] == sum(11 * length + 66 for length in (4, 3))
    config = engine.config
    kv_heads = config.num_key_value_heads
    head_dim = config.hidden_size // config.num_attention_heads
    assert engine.kv.token_bytes == 2 * config.num_hidden_layers * kv_heads * head_dim * 4  # fp32 keys and values

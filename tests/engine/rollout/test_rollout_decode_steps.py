"""Several decode steps per host sync (`decode_steps_per_sync`) on CPU: the outputs equal one step per
sync exactly (tokens, counts, finish reasons, log-probs), with rows stopping at different steps inside
a window, length limits, the context cap and held continuations; a finished row records nothing more
and its cache writes stay in its own slot; n samples share one prefill."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine.rollout import RolloutEngine, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [20] * 17, [40, 41], [7] * 30, [100, 200, 3, 4, 5, 6, 7], [9],
           [33, 34, 35, 36] * 3]


def engines(path, **kwargs):
    return [RolloutEngine.from_pretrained(path, decode_steps_per_sync=k, **kwargs) for k in (1, 8)]


def assert_same(one, many):
    assert [[s.token_ids for s in row] for row in many] == [[s.token_ids for s in row] for row in one]
    assert [[s.finish_reason for s in row] for row in many] == [[s.finish_reason for s in row] for row in one]
    for row_one, row_many in zip(one, many):
        for a, b in zip(row_one, row_many):
            torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0)


def test_rows_stopping_inside_a_window_give_what_one_step_per_sync_gives(spread_model):
    one, many = engines(spread_model("qwen2"), max_num_seqs=4, max_model_len=64)
    free = one.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[]))
    # stop ids first met at different steps of different rows (inside the 8-step windows)
    stops = [free[0][0].token_ids[2], free[1][0].token_ids[5], free[3][0].token_ids[11]]
    params = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=stops)
    got = many.generate(PROMPTS, params)
    assert_same(one.generate(PROMPTS, params), got)
    lengths = {len(row[0].token_ids) for row in got}
    assert len(lengths) >= 3 and any(row[0].finish_reason == "stop" for row in got)
    for (ref,), (out,) in zip(free, got):
        cut = next((k + 1 for k, t in enumerate(ref.token_ids) if t in stops), None)
        assert out.token_ids == ref.token_ids[:cut]  # ends at its first stop token, nothing recorded after
        assert len(out.logprobs) == len(out.token_ids)
    assert many.stats["generated_tokens"] == sum(len(row[0].token_ids) for row in got)


def test_length_limits_and_the_context_cap(spread_model):
    one, many = engines(spread_model("llama"), max_num_seqs=4, max_model_len=40)
    for engine in (one, many):
        session = engine.session(SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[]))
        for i, prompt in enumerate(PROMPTS):
            session.add(prompt, max_tokens=1 + (3 * i) % 20)  # prompt [7] * 30 is capped by the context
        engine.ran = session.run()
    assert {seq: c.token_ids for seq, c in many.ran.items()} == {seq: c.token_ids for seq, c in one.ran.items()}
    assert len(many.ran[4].token_ids) == 40 - 30 and many.ran[4].finish_reason == "length"
    assert [len(many.ran[i].token_ids) for i in (0, 1, 2)] == [1, 4, 7]


def test_a_row_past_its_limit_inside_a_window_records_nothing_and_stays_in_its_slot(spread_model):
    """Ask the engine for more steps than a row has left (the session never does, but a stop token has
    the same effect): the row keeps its tokens, its count and its position, and only its own last
    position of the cache is rewritten."""
    engine = RolloutEngine.from_pretrained(spread_model("qwen2"), max_num_seqs=4, max_model_len=32)
    params = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[])
    (expected,), = engine.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, stop_token_ids=[]))
    session = engine.session(params)
    session.add([5, 6, 7], max_tokens=3)
    session.add([8] * 20, max_tokens=10)
    session.step()  # prefill both
    batch = engine.batch
    def untouched():  # slot 0's prompt, slot 0 past its last position, the other slots
        k = engine.kv.k
        return [k[:, 0, :3].clone(), k[:, 0, 3 + 2 + 1:].clone(), k[:, 2:].clone()]

    before = untouched()
    engine.decode(batch, params, session.generator, steps=9)
    assert batch.generated[:2].tolist() == [3, 10] and batch.positions[:2].tolist() == [3 + 2, 20 + 9]
    finished = batch.pop_finished()
    assert finished.slots == [0, 1] and finished.token_ids[0] == expected.token_ids
    torch.testing.assert_close(torch.tensor(finished.logprobs[0]), torch.tensor(expected.logprobs), atol=1e-5,
                               rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(untouched(), before))
    assert len(batch) == 0 and batch.slots.tolist() == [engine.kv.scratch_slot] * 4


def test_held_continuations_keep_their_real_length(spread_model):
    one, many = engines(spread_model("qwen3"), max_num_seqs=4, max_model_len=96)
    free = one.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[]))
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[free[0][0].token_ids[4]])
    results = []
    for engine in (one, many):
        session = engine.session(params, hold=True)
        seqs = [session.add(p)[0] for p in PROMPTS[:4]]
        first = session.run()
        lengths = {seq: session.held[seq].length for seq in seqs}
        for seq in seqs:
            session.extend(seq, [60 + seq, 61], max_tokens=9)
        second = session.run()
        results.append((first, lengths, second))
    (first1, lengths1, second1), (first8, lengths8, second8) = results
    assert lengths8 == lengths1 == {s: len(PROMPTS[s]) + len(first8[s].token_ids) for s in range(4)}
    for seq in range(4):
        assert first8[seq].token_ids == first1[seq].token_ids and second8[seq].token_ids == second1[seq].token_ids
        torch.testing.assert_close(torch.tensor(second8[seq].logprobs), torch.tensor(second1[seq].logprobs),
                                   atol=1e-5, rtol=0)


def test_grpo_shaped_samples_share_one_prefill_per_prompt(spread_model):
    """8 prompts x 4 samples on 16 slots (several prefill forwards): each prompt is prefilled once."""
    engine = RolloutEngine.from_pretrained(spread_model("qwen2"), max_num_seqs=16, max_model_len=64)
    outs = engine.generate(PROMPTS, SamplingParams(n=4, temperature=1.0, max_tokens=6, stop_token_ids=[], seed=0))
    assert engine.stats["prefill_forwards"] >= 2
    assert engine.stats["prefill_tokens"] == sum(len(p) for p in PROMPTS)
    assert engine.stats["generated_tokens"] == 4 * 6 * len(PROMPTS) and all(len(row) == 4 for row in outs)


def test_decode_steps_per_sync_is_checked(spread_model):
    with pytest.raises(ValueError, match="decode_steps_per_sync=0 is invalid"):
        RolloutEngine.from_pretrained(spread_model("qwen2"), max_num_seqs=2, decode_steps_per_sync=0)

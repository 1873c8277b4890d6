"""The hybrid linear-attention families (Qwen3.5, `qwen3_5_text`; Qwen3-Next, `qwen3_next`, its MLPs mixtures of
experts) on the fast engine, on CPU in fp32, every test once per family: what their per-slot recurrent states must
keep (greedy parity, sampled log-probs, continuations and weight sync are in the
parametrized tests of `test_rollout_engine.py` and `test_rollout_session.py`).

- prefill then decode gives the logits one full forward gives (transformers#46190 found them apart), ours and
  transformers';
- rows of different ages decode in one batch, and a slot a finished row gave back starts from zero states;
- a finished row idling in the batch until the host looks does not fold its last token in again;
- a held sequence cut short cannot be continued (its states cannot go back), and says so;
- sleep frees the states with the K/V, wake makes them again;
- exact mode and FP8 weights are refused, naming why, and so is a config whose value heads do not group evenly
  under its key heads.
"""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine.rollout import RolloutEngine, SamplingParams
from hybridflow.engine.rollout.attention import AttnMeta
from hybridflow.engine.rollout.cuda_graphs import decode_forward
from hybridflow.engine.rollout.recurrent_state import StateCache
from tests.engine.rollout.test_rollout_engine import GREEDY, full_logits, hf_greedy, hf_model


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_next"])
def hybrid_arch(request):
    return request.param


@pytest.fixture(scope="module")
def hybrid(spread_model, hybrid_arch):
    """Four layers: linear, linear, linear, full (the families' pattern)."""
    return spread_model(hybrid_arch, layers=4)


def test_prefill_then_decode_gives_the_full_forwards_logits(hybrid):
    engine = RolloutEngine.from_pretrained(hybrid, max_num_seqs=2, max_model_len=128)
    # 80 tokens: the whole forward and the 70-token prefill each cross a chunk of the delta rule (64 tokens)
    tokens = torch.randint(4, 256, (80,), generator=torch.Generator().manual_seed(0)).tolist()
    split = 70
    model, kv = engine.model, engine.kv
    ids, positions = torch.tensor(tokens), torch.arange(len(tokens))
    with torch.no_grad():
        whole = model(ids, positions, AttnMeta(write_index=positions, cu_seqlens=torch.tensor([0, len(tokens)],
                                               dtype=torch.int32), seqlens=[len(tokens)], max_seqlen=len(tokens)), kv)
        head = model(ids[:split], positions[:split], AttnMeta(
            write_index=positions[:split], cu_seqlens=torch.tensor([0, split], dtype=torch.int32), seqlens=[split],
            max_seqlen=split), kv)
        steps = [decode_forward(model, kv, ids[i:i + 1], positions[i:i + 1], torch.tensor([0]), len(tokens))
                 for i in range(split, len(tokens))]
    stepwise = torch.cat([head] + steps)
    torch.testing.assert_close(stepwise, whole, atol=1e-4, rtol=0)
    with torch.no_grad():
        reference = hf_model(hybrid)(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(whole, reference, atol=1e-4, rtol=0)


def test_rows_of_different_ages_decode_together_and_reused_slots_start_fresh(hybrid):
    """Two slots for four sequences of different lengths and limits: a sequence joins while the other row is
    mid-decode, in the slot the finished one left (its states overwritten, not continued)."""
    engine = RolloutEngine.from_pretrained(hybrid, max_num_seqs=2, max_model_len=64)
    assert isinstance(engine.kv, StateCache) and engine.kv.num_slots == 2
    work = [([5, 6, 7, 8, 9], 3), ([10, 11, 12], 11), ([20] * 17, 6), ([40, 41], 9)]
    session = engine.session(GREEDY)
    seqs = [session.add(prompt, 1, limit)[0] for prompt, limit in work]
    done = session.run()
    model = hf_model(hybrid)
    for seq, (prompt, limit) in zip(seqs, work):
        assert done[seq].token_ids == hf_greedy(model, prompt, limit)


def test_a_finished_row_does_not_fold_its_last_token_in_twice(hybrid):
    """With many decode steps per host look, a row that stops early idles in the batch, fed its stop token again
    until the host looks; its continuation still equals a one-shot prefill of the whole sequence."""
    engine = RolloutEngine.from_pretrained(hybrid, max_num_seqs=4, max_model_len=64, decode_steps_per_sync=8)
    prompt = [5, 6, 7, 8, 9]
    (plain,), = engine.generate([prompt], GREEDY)
    stop = plain.token_ids[1]  # the short row stops at its second token
    assert stop != plain.token_ids[0]
    # the other row is one whose greedy tokens do not stop as soon (each family's random weights differ)
    candidates = [[10, 11, 12], [30, 31], [50, 51, 52, 53]]
    other = next(c for c, (out,) in zip(candidates, engine.generate(candidates, GREEDY))
                 if stop not in out.token_ids[:6])
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop])
    session = engine.session(params, hold=True)
    short, = session.add(prompt, 1, 12)
    long, = session.add(other, 1, 12)
    first: dict = {}
    while short not in first or long not in first:
        first.update(session.step())
    assert first[short].token_ids == plain.token_ids[:2]
    assert len(first[long].token_ids) > 3  # the batch decoded on while the short row idled
    session.extend(short, [40, 41], 5)
    second = session.run()
    context = prompt + first[short].token_ids + [40, 41]
    (alone,), = engine.generate([context], SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=[]))
    assert second[short].token_ids == alone.token_ids[:len(second[short].token_ids)]
    expected = full_logits(hf_model(hybrid), context, second[short].token_ids).log_softmax(-1)
    torch.testing.assert_close(torch.tensor(second[short].logprobs),
                               expected.gather(-1, torch.tensor(second[short].token_ids)[:, None])[:, 0], atol=1e-4,
                               rtol=0)


def test_a_sequence_cut_short_cannot_be_continued(hybrid):
    engine = RolloutEngine.from_pretrained(hybrid, max_num_seqs=2, max_model_len=64)
    session = engine.session(GREEDY, hold=True)
    seq, = session.add([5, 6, 7, 8, 9], 1, 6)
    out = session.run()[seq]
    session.shorten(seq, 2, out.token_ids[-3])
    session.extend(seq, [40, 41], 4)
    with pytest.raises(ValueError, match=r"states hold 10 tokens, but its continuation starts at token 8: a "
                                         r"recurrent state cannot go back"):
        session.run()


def test_sleep_frees_the_states_and_wake_makes_them_again(hybrid):
    engine = RolloutEngine.from_pretrained(hybrid, max_num_seqs=2, max_model_len=64)
    before = engine.generate([[5, 6, 7], [9] * 11], GREEDY)
    engine.sleep()
    assert engine.kv.conv is None and engine.kv.recurrent is None
    with pytest.raises(RuntimeError, match="wake"):
        engine.generate([[5, 6, 7]], GREEDY)
    engine.wake()
    after = engine.generate([[5, 6, 7], [9] * 11], GREEDY)
    assert [o[0].token_ids for o in after] == [o[0].token_ids for o in before]


def test_exact_mode_and_fp8_weights_are_refused_by_name(hybrid, hybrid_arch):
    with pytest.raises(ValueError, match=f"exact mode cannot run this model: model_type '{hybrid_arch}' has no exact"):
        RolloutEngine.from_pretrained(hybrid, max_num_seqs=2, max_model_len=64, exact=True)
    with pytest.raises(ValueError, match=f"'{hybrid_arch}' mixes linear-attention layers in, whose projections have "
                                         "no FP8 path"):
        RolloutEngine.from_pretrained(hybrid, max_num_seqs=2, max_model_len=64, quantization="fp8")


def test_value_heads_that_do_not_group_under_the_key_heads_are_refused_by_name(hybrid_arch):
    from hybridflow.engine.rollout.model import CausalLM
    from hybridflow.utils.tiny_model import tiny_config

    config = tiny_config(hybrid_arch, 300, layers=4)
    config.linear_num_value_heads = 3  # over 2 key heads
    with pytest.raises(ValueError, match="linear_num_value_heads=3 is not a multiple of linear_num_key_heads=2"):
        CausalLM(config, "sdpa")

"""Sessions of the rollout engine on CPU (fp32): a held sequence continued with appended tokens gives
exactly what a one-shot prefill of the whole sequence gives, while only the new tokens are prefilled;
continuations mix with new prompts and decoding rows; a waiting sequence holds up no one."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine.rollout import RolloutEngine, SamplingParams
from hybridflow.engine.rollout.attention import AttnMeta, cache_attention, prefill_attention

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[])


def hf_logprobs(path, context, tokens, temperature=1.0):
    """log-probs of `tokens` after `context` from one full transformers forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([context + tokens])).logits[0, len(context) - 1:-1].float()
    return (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def turns(session, first, appended, max_tokens=8):
    """Drive sequences turn by turn: turn 1 of every sequence in `first` (seq -> None), then, as each
    turn ends, extend the sequence with the next of its `appended` token lists. Returns seq -> turns."""
    out = {seq: [] for seq in first}
    while session.has_work:
        for seq, completion in session.step():
            out[seq].append(completion)
            if len(out[seq]) <= len(appended[seq]):
                session.extend(seq, appended[seq][len(out[seq]) - 1], max_tokens)
            else:
                session.release(seq)
    return out


# olmo2: its q/k norms over the whole projection; gemma3_text: several queries of a row over the cache, each within
# its own sliding window (8 tokens); qwen3_5_text, qwen3_next: their linear-attention states continue from the slot's
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "olmo2", "gemma3_text", "qwen3_5_text", "qwen3_next"])
def test_continuation_equals_one_shot_prefill_of_the_whole_sequence(spread_model, arch):
    path = spread_model(arch)
    engine = RolloutEngine.from_pretrained(path, max_num_seqs=6, max_model_len=128)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [20] * 17]
    appended = {0: [[40, 41, 42], [50]], 1: [[7] * 9, [60, 61]], 2: [[33, 34], [35, 36, 37, 38]]}
    session = engine.session(GREEDY, hold=True)
    seqs = [session.add(p)[0] for p in prompts]
    got = turns(session, seqs, appended)
    assert session.stats["reused_tokens"] > 0 and not session.held
    for seq, prompt in zip(seqs, prompts):
        context = list(prompt)
        for k, completion in enumerate(got[seq]):
            # the same turn from a fresh engine that prefills the whole conversation so far at once
            (alone,), = engine.generate([context], SamplingParams(temperature=0.0, max_tokens=8 if k else 12,
                                                                   stop_token_ids=[]))
            assert completion.token_ids == alone.token_ids
            # the chunked delta rule over the whole conversation sums in another order than a continuation from the
            # carried state: fp32 roundings apart, up to 1.2e-5 seen
            torch.testing.assert_close(torch.tensor(completion.logprobs), torch.tensor(alone.logprobs),
                                       atol=1e-4 if arch in ("qwen3_5_text", "qwen3_next") else 1e-5, rtol=0)
            torch.testing.assert_close(torch.tensor(completion.logprobs),
                                       hf_logprobs(path, context, completion.token_ids), atol=1e-4, rtol=0)
            context += completion.token_ids + (appended[seq][k] if k < len(appended[seq]) else [])


def test_only_new_tokens_are_prefilled_and_samples_fork_then_diverge(spread_model):
    path = spread_model("llama")
    engine = RolloutEngine.from_pretrained(path, max_num_seqs=8, max_model_len=96)
    params = SamplingParams(n=3, temperature=0.9, max_tokens=6, stop_token_ids=[], seed=4)
    session = engine.session(params, hold=True)
    prompt = [9, 8, 7, 6, 5, 4, 3]
    seqs = session.add(prompt, n=3)
    appended = {seq: [[100 + seq, 101, 102]] for seq in seqs}
    got = turns(session, seqs, appended, max_tokens=6)
    assert session.stats["prefill_tokens"] == len(prompt) + 3 * (1 + 3)  # prompt once; each: last token + 3
    assert session.stats["reused_tokens"] == 3 * (len(prompt) + 6 - 1)
    for seq in seqs:
        first, second = got[seq]
        context = prompt + first.token_ids + appended[seq][0]
        torch.testing.assert_close(torch.tensor(second.logprobs),
                                   hf_logprobs(path, context, second.token_ids, 0.9), atol=1e-4, rtol=0)


def test_a_held_sessions_equal_waiting_prompts_share_one_prefill(spread_model):
    path = spread_model("llama")
    engine = RolloutEngine.from_pretrained(path, max_num_seqs=8, max_model_len=96)
    prompt, other = [9, 8, 7, 6, 5, 4, 3], [9, 8, 7, 6, 5, 4, 2]
    session = engine.session(SamplingParams(temperature=0.9, max_tokens=6, stop_token_ids=[], seed=4), hold=True)
    seqs = [*session.add(prompt), *session.add(other), *session.add(prompt), *session.add(prompt, max_tokens=3)]
    got = turns(session, seqs, {seq: [] for seq in seqs}, max_tokens=6)
    # the second `prompt` joins the first; `other` and the one with a lower max_tokens prefill on their own
    assert session.stats["prefill_tokens"] == 3 * len(prompt)
    assert [len(got[seq][0].token_ids) for seq in seqs] == [6, 6, 6, 3]
    for seq in (seqs[0], seqs[2]):  # each sample of the shared prefill is its own sequence
        torch.testing.assert_close(torch.tensor(got[seq][0].logprobs),
                                   hf_logprobs(path, prompt, got[seq][0].token_ids, 0.9), atol=1e-4, rtol=0)
    # a session that does not hold (partial rollouts withdraw requests by sequence) never joins them
    session = engine.session(SamplingParams(temperature=0.9, max_tokens=6, stop_token_ids=[], seed=4))
    session.add(prompt), session.add(prompt)
    while session.has_work:
        session.step()
    assert session.stats["prefill_tokens"] == 2 * len(prompt)


def test_continuations_prefill_together_with_new_prompts_while_others_decode(spread_model):
    engine = RolloutEngine.from_pretrained(spread_model("qwen2"), max_num_seqs=4, max_model_len=96)
    session = engine.session(SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[]), hold=True)
    a = session.add([5, 6, 7], max_tokens=2)[0]
    b = session.add([8, 9, 10, 11], max_tokens=10)[0]
    ended = dict(session.step() + session.step())  # prefill both, one decode step: `a` ends
    assert list(ended) == [a] and len(ended[a].token_ids) == 2
    session.extend(a, [30, 31], max_tokens=3)
    c = session.add([12, 13])[0]
    session.step()  # one prefill forward: `a`'s continuation (over its cache) and the new prompt `c`
    assert session.stats["prefill_forwards"] == 2 and len(session.batch) == 3
    rest = session.run()
    assert len(rest[a].token_ids) == 3 and len(rest[b].token_ids) == 10 and len(rest[c].token_ids) == 10
    whole = [5, 6, 7] + ended[a].token_ids + [30, 31]
    (alone,), = engine.generate([whole], SamplingParams(temperature=0.0, max_tokens=3, stop_token_ids=[]))
    assert rest[a].token_ids == alone.token_ids


def test_a_held_sequence_waits_outside_the_batch_and_slots_bound_new_prompts(spread_model):
    engine = RolloutEngine.from_pretrained(spread_model("qwen2"), max_num_seqs=2, max_model_len=64)
    session = engine.session(SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[]), hold=True)
    a, b = session.add([5, 6], max_tokens=1)[0], session.add([7, 8])[0]
    c = session.add([9, 10])[0]  # no slot yet
    ended = dict(session.step())  # `a` is done after its prefill; `b` decodes while `a` waits
    assert list(ended) == [a] and len(session.batch) == 1
    ended = session.run()
    assert list(ended) == [b] and not session.has_work  # `c` waits for a slot: both are held
    session.release(a)
    assert session.has_work and list(session.run()) == [c]
    with pytest.raises(ValueError, match="sequence 0 is not waiting for a continuation"):
        session.extend(a, [1])
    with pytest.raises(ValueError, match="would hold 64 tokens.*max_model_len=64"):
        session.extend(b, [1] * 58)
    with pytest.raises(ValueError, match="max_tokens=9 is invalid"):
        session.add([1], max_tokens=9)
    with pytest.raises(ValueError, match="sequence 7 is not held"):
        session.release(7)


@pytest.mark.parametrize("queries", [1, 5])
def test_cache_attention_equals_causal_attention_over_the_whole_sequence(queries):
    """The newest `queries` tokens of each row, attending over its slot, match the same rows of causal
    attention over the whole sequence (the decode case is queries=1)."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, max_len = 4, 2, 8, 32
    lengths, slots = [9, 14, 6], [0, 2, 3]
    k_cache = torch.zeros(5, max_len, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    q_all = [torch.randn(n, heads, dim, generator=gen) for n in lengths]
    k_all = [torch.randn(n, kv_heads, dim, generator=gen) for n in lengths]
    v_all = [torch.randn(n, kv_heads, dim, generator=gen) for n in lengths]
    for slot, n, k, v in zip(slots, lengths, k_all, v_all):
        k_cache[slot, :n], v_cache[slot, :n] = k, v
    cu_q = torch.tensor([0] + [queries] * 3).cumsum(0).to(torch.int32)
    meta = AttnMeta(write_index=torch.zeros(0, dtype=torch.long), cu_seqlens_q=cu_q, max_seqlen_q=queries,
                    max_seqlen=max(lengths), context_lens=torch.tensor(lengths, dtype=torch.int32),
                    slots=torch.tensor(slots))
    q = torch.cat([qs[-queries:] for qs in q_all])
    out = cache_attention(q, k_cache, v_cache, meta, dim ** -0.5, "sdpa")
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    whole = prefill_attention(torch.cat(q_all), torch.cat(k_all), torch.cat(v_all),
                              AttnMeta(write_index=meta.write_index, cu_seqlens=cu, seqlens=lengths,
                                       max_seqlen=max(lengths)), dim ** -0.5, "sdpa")
    expected = torch.cat([w[-queries:] for w in whole.split(lengths)])
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_attention_names_the_metadata_field_it_lacks():
    """Metadata of a new-prompt prefill cannot drive attention over the cache, nor the reverse: the error
    names the missing field."""
    q, k_cache = torch.zeros(3, 4, 8), torch.zeros(2, 16, 2, 8)
    none_written = torch.zeros(0, dtype=torch.long)
    prefill = AttnMeta(write_index=none_written, cu_seqlens=torch.tensor([0, 3], dtype=torch.int32), seqlens=[3],
                       max_seqlen=3)
    with pytest.raises(ValueError, match="AttnMeta.slots is None"):
        cache_attention(q, k_cache, k_cache, prefill, 1.0, "sdpa")
    over_cache = AttnMeta(write_index=none_written, cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32),
                          max_seqlen_q=3, max_seqlen=3, context_lens=torch.tensor([3], dtype=torch.int32),
                          slots=torch.tensor([0]))
    with pytest.raises(ValueError, match="AttnMeta.seqlens is None"):
        prefill_attention(q, k_cache[0, :3], k_cache[0, :3], over_cache, 1.0, "sdpa")


def test_one_step_prefills_all_that_fits_in_forwards_of_the_token_budget(spread_model):
    """Prompts beyond one forward's `max_prefill_tokens` are prefilled in the same step, in several forwards
    queued back to back (no decode step between them), and generate what each prompt alone generates."""
    engine = RolloutEngine.from_pretrained(spread_model("qwen2"), max_num_seqs=4, max_model_len=64,
                                           max_prefill_tokens=8)
    params = SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=[])
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12, 13], [14, 15, 16], [17, 18, 19, 20, 21, 22]]
    session = engine.session(params)
    seqs = [session.add(prompt)[0] for prompt in prompts]
    session.step()
    assert session.stats["prefill_forwards"] == 3 and session.stats["decode_steps"] == 0
    assert len(session.batch) == 4
    done = session.run()
    for seq, prompt in zip(seqs, prompts):
        (alone,), = engine.generate([prompt], params)
        assert done[seq].token_ids == alone.token_ids

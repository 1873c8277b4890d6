"""The device plan at long responses (the arithmetic, no GPU): 16,384-token responses at the 1.5B shape and 32,768
at the 0.5B and SmolLM2-135M shapes fit one H200 with the defaults; a KV cache kept through training (partial
rollouts) is sized beside the update instead of counting every slot; and what cannot fit is refused naming the
keys."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from hybridflow.engine.budget import DeviceDemand, DoesNotFit, ModelShape, RolloutRole, TrainedRole, plan
from hybridflow.engine.budget.estimate import HEAD_CHUNK_BYTES, SLACK_BYTES
from hybridflow.utils.model_shapes import QWEN_SHAPES, SMOLLM2_135M

GIB = 2**30
H200 = (int(139.8 * GIB), int(139.8 * GIB))  # (free, total) of an idle H200
PROMPT = 512


def shape(name: str) -> ModelShape:
    arch, kwargs = ("llama", SMOLLM2_135M) if name == "smollm2" else ("qwen2", QWEN_SHAPES[name])
    return ModelShape.from_config(AutoConfig.for_model(arch, **kwargs))


def demand(name: str, response: int, kept: bool = False) -> DeviceDemand:
    """The defaults of `hybridflow train` on one GPU: actor + colocated rollout of 256 sequences."""
    s, longest = shape(name), PROMPT + response
    return DeviceDemand(trained=(TrainedRole("actor", "model", s, compute_bytes=2, master_bytes=4),),
                        rollout=RolloutRole(s, 2, max_num_seqs=256, max_model_len=longest, cache_stays=kept),
                        longest_sequence=longest)


@pytest.mark.parametrize("name, response", [("1.5b", 16384), ("0.5b", 32768), ("smollm2", 32768)])
def test_long_responses_fit_one_h200_with_the_defaults(name, response):
    d = demand(name, response)
    p = plan(d, *H200)
    actor = p.roles["actor"]
    assert actor.max_tokens >= PROMPT + response  # a whole sequence per micro-batch at least
    assert actor.peak_bytes <= p.cap_bytes - SLACK_BYTES and p.generation_peak_bytes <= p.cap_bytes
    per_seq = (PROMPT + response) * d.rollout.kv_bytes_per_token()
    slots = p.kv_cache_bytes // per_seq  # whole slots: the 256 asked for and the scratch one, or as many as fit
    assert p.kv_cache_bytes == slots * per_seq
    assert slots == 257 or p.generation_peak_bytes + per_seq + d.rollout.logits_bytes_per_seq() > p.cap_bytes
    assert p.kv_cache_bytes // per_seq >= 100  # a hundred long sequences decode at once, or more


def test_the_prefill_workspace_covers_one_sequence_prefilled_again_whole():
    s = shape("0.5b")
    role = RolloutRole(s, 2, max_num_seqs=256, max_model_len=33280)
    assert role.workspace_bytes() == 33280 * 2 * (4 * 896 + 3 * 4864) + 16 * 256 * 151936
    short = RolloutRole(s, 2, max_num_seqs=256, max_model_len=1024)
    assert short.workspace_bytes() == 16384 * 2 * (4 * 896 + 3 * 4864) + 16 * 256 * 151936


def test_a_kv_cache_kept_through_training_is_sized_beside_the_update():
    d = demand("1.5b", 16384, kept=True)
    p = plan(d, *H200)
    actor, kv = p.roles["actor"], p.kv_cache_bytes
    assert actor.breakdown["KV cache (kept)"] == kv and actor.peak_bytes == sum(actor.breakdown.values())
    assert actor.peak_bytes <= p.cap_bytes - SLACK_BYTES + 1  # the cache takes what the update leaves
    alone = plan(demand("1.5b", 16384), *H200).roles["actor"]
    fixed = alone.peak_bytes - alone.breakdown["activations"]
    # the update planned beside half of what its weights, gradients, state and workspace leave
    reserve = (p.cap_bytes - SLACK_BYTES - fixed) // 2
    assert actor.breakdown["activations"] <= p.cap_bytes - SLACK_BYTES - HEAD_CHUNK_BYTES - fixed - reserve
    per_seq = d.rollout.max_model_len * d.rollout.kv_bytes_per_token()
    assert reserve <= kv < 257 * per_seq and kv // per_seq >= 100


def test_what_cannot_fit_at_long_responses_is_refused_naming_the_keys():
    with pytest.raises(DoesNotFit) as err:  # the 1.5B update leaves no room for one kept sequence's cache
        plan(demand("1.5b", 16384, kept=True), 36 * GIB, 141 * GIB)
    msg = str(err.value)
    assert "generation: the KV cache gets" in msg and "rollout.free_cache_after_generate=false keeps it" in msg
    assert ("rollout.free_cache_after_generate=true (with rollout.partial, also "
            "rollout.partial_unfinished=recompute)") in msg
    plan(demand("1.5b", 16384), 36 * GIB, 141 * GIB)  # freed after each generation, it fits
    with pytest.raises(DoesNotFit, match="it fits with actor.optimizer=adamw_8bit"):
        plan(demand("7b", 16384), *H200)

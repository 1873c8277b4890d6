"""Forward passes of the training engine: log-probs and entropy against a plain HF forward (values and
gradients, tied and untied embeddings), packing against padding, critic values at the right positions,
and the fused chunked log-prob function against plain autograd."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from train_helpers import model_cfg, rl_batch

from hybridflow.engine.train import TrainEngine, token_log_probs
from hybridflow.engine.train.logprobs import head_log_probs, top_k_log_probs
from hybridflow.engine.train.head import LogProbHead
from hybridflow.engine.train.packing import build_inputs


def _hf_reference(model, batch, temperature):
    """Per-response-token log-probs and entropy from one plain padded HF forward."""
    R = batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits.float()
    logits = logits[:, -R - 1:-1] / temperature
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, batch["responses"][..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    mask = batch["response_mask"]
    return logp * mask, entropy * mask


# gemma3_text: its 8-token sliding window is shorter than the rows (up to 13 tokens), packed and padded
@pytest.mark.parametrize("arch", ["qwen2", "llama", "olmo2", "phi3", "gemma3_text"])
def test_log_probs_match_plain_hf_forward_packed_and_padded(tiny_model_factory, arch):
    path = tiny_model_factory(arch)
    engine = TrainEngine(model_cfg(path), None, head="lm", pack_on_cpu=True)
    batch = rl_batch(rows=5, prompt_width=7, response_width=6, seed=1)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # unpatched, unsharded
    ref_logp, ref_ent = _hf_reference(plain, batch, temperature=0.7)
    for pack in (True, False):
        out = engine.infer(batch, micro_batch_size=2, temperature=0.7, with_entropy=True, pack=pack)
        torch.testing.assert_close(out["log_probs"], ref_logp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out["entropy"], ref_ent, atol=1e-5, rtol=1e-5)
    by_tokens = engine.infer(batch, max_tokens=16, temperature=0.7)
    torch.testing.assert_close(by_tokens["log_probs"], ref_logp, atol=1e-5, rtol=1e-5)


def test_packed_gradients_equal_padded(tiny_qwen2):
    engine = TrainEngine(model_cfg(tiny_qwen2), None, head="lm", pack_on_cpu=True)
    engine.model.requires_grad_(True)
    batch = rl_batch(rows=4, prompt_width=6, response_width=5, seed=2)
    grads = []
    for pack in (True, False):
        out, _ = engine.forward(batch, pack=pack)
        (out["log_probs"] * batch["response_mask"]).sum().backward()
        grads.append([p.grad.clone() for p in engine.model.parameters()])
        engine.model.zero_grad()
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_critic_values_come_from_the_position_before_each_response_token(tiny_qwen2):
    engine = TrainEngine(model_cfg(tiny_qwen2), None, head="value", pack_on_cpu=True)
    batch = rl_batch(rows=3, prompt_width=5, response_width=4, seed=3)
    R = 4
    with torch.no_grad():
        scores = engine.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              position_ids=batch["position_ids"]).logits[..., 0]
    expected = scores[:, -R - 1:-1] * batch["response_mask"]
    for pack in (True, False):
        values = engine.infer(batch, pack=pack)["values"]
        torch.testing.assert_close(values, expected, atol=1e-5, rtol=1e-5)
    assert values.abs().sum() > 0


@pytest.mark.parametrize("tied", [True, False])
def test_engine_gradients_equal_a_plain_forward_with_full_logits(tiny_model_factory, tied):
    """The fused head's backward (chunked recompute) gives the plain head's gradients, for every parameter
    (the embedding too, which a tied head shares)."""
    path = tiny_model_factory("qwen2", tie_word_embeddings=tied)
    engine = TrainEngine(model_cfg(path), None, head="lm", pack_on_cpu=True)
    engine.model.requires_grad_(True)
    assert isinstance(engine.lm_head, LogProbHead)
    assert (engine.lm_head.weight is engine.model.get_input_embeddings().weight) == tied
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = rl_batch(rows=4, prompt_width=6, response_width=5, seed=4)
    w_logp, w_ent = torch.randn(4, 5), torch.randn(4, 5)
    out, _ = engine.forward(batch, temperature=0.8, with_entropy=True, pack=True)
    ((out["log_probs"] * w_logp + out["entropy"] * w_ent) * batch["response_mask"]).sum().backward()
    R = 5
    logits = plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits[:, -R - 1:-1] / 0.8
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, batch["responses"][..., None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    ((logp * w_logp + ent * w_ent) * batch["response_mask"]).sum().backward()
    ours = dict(engine.model.named_parameters())
    for name, p in plain.named_parameters():
        torch.testing.assert_close(ours[name].grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("entropy_grad", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_log_probs_and_entropy_match_autograd_on_full_logits(temperature, entropy_grad, dtype, tol=1e-5):
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=dtype, requires_grad=True)
    weight = (torch.randn(50, 16, dtype=dtype) / 4).requires_grad_()  # logits ~ N(0, 1), as a trained head's
    bias = torch.randn(50, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    w1, w2 = torch.randn(37, dtype=dtype), torch.randn(37, dtype=dtype) * entropy_grad
    logp, ent = token_log_probs(hidden, weight, targets, temperature=temperature, with_entropy=True, bias=bias,
                                chunk_size=8)
    (w1 * logp + (w2 * ent if entropy_grad else 0)).sum().backward()
    got = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    exact = [t.detach().double().requires_grad_() for t in (hidden, weight, bias)]  # the fp64 truth
    ref_all = ((exact[0] @ exact[1].T + exact[2]) / temperature).log_softmax(-1)
    ref_logp = ref_all.gather(-1, targets[:, None]).squeeze(-1)
    ref_ent = -(ref_all.exp() * ref_all).sum(-1)
    (w1.double() * ref_logp + w2.double() * ref_ent).sum().backward()
    torch.testing.assert_close(logp.double(), ref_logp.detach(), atol=tol, rtol=tol)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), atol=tol, rtol=tol)
    for g, t in zip(got, exact):
        torch.testing.assert_close(g.double(), t.grad, atol=tol, rtol=tol)


@pytest.mark.parametrize("beta", [1.0, 0.0, 0.3])
@pytest.mark.parametrize("entropy_grad", [True, False])
def test_top_k_divergence_and_its_gradient_match_autograd_on_full_logits(entropy_grad, beta, tol=1e-5):
    """`head_log_probs`'s soft target: a teacher's log-probs at k ids per token, the rest of its mass one more
    outcome; TRL's generalized JSD over those k + 1 outcomes (beta 1 reverse KL, 0 forward KL), beside the
    log-probs (and the entropy)."""
    torch.manual_seed(1)
    n, hidden_size, vocab, k = 29, 16, 50, 5
    hidden = torch.randn(n, hidden_size, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size, dtype=torch.float64) / 4).requires_grad_()
    targets = torch.randint(0, vocab, (n,))
    ids = torch.stack([torch.randperm(vocab)[:k] for _ in range(n)])
    q = torch.rand(n, k, dtype=torch.float64) * 0.18  # at most 0.9 of the teacher's mass on its top k
    w1, w2, w3 = (torch.randn(n, dtype=torch.float64) for _ in range(3))
    logp, ent, kl = head_log_probs(hidden, weight, targets, 0.8, entropy_grad, chunk_size=8, soft=(ids, q.log()),
                                   soft_beta=beta)
    assert (ent is not None) == entropy_grad
    (w1 * logp + w2 * kl + (w3 * ent if entropy_grad else 0)).sum().backward()
    got = [t.grad.clone() for t in (hidden, weight)]
    exact = [t.detach().requires_grad_() for t in (hidden, weight)]
    ref_all = ((exact[0] @ exact[1].T) / 0.8).log_softmax(-1)
    s = torch.cat([ref_all.gather(-1, ids).exp(), 1 - ref_all.gather(-1, ids).exp().sum(-1, keepdim=True)], -1)
    t = torch.cat([q, 1 - q.sum(-1, keepdim=True)], -1)
    m = beta * t + (1 - beta) * s
    ref_kl = beta * (t * (t / m).log()).sum(-1) + (1 - beta) * (s * (s / m).log()).sum(-1)
    if beta in (0.0, 1.0):  # TRL's ends: the KLs themselves
        ref_kl = (s * (s / t).log()).sum(-1) if beta else (t * (t / s).log()).sum(-1)
    ref_ent = -(ref_all.exp() * ref_all).sum(-1)
    (w1 * ref_all.gather(-1, targets[:, None]).squeeze(-1) + w2 * ref_kl
     + (w3 * ref_ent if entropy_grad else 0)).sum().backward()
    torch.testing.assert_close(kl.double(), ref_kl.detach(), atol=tol, rtol=tol)
    for g, truth in zip(got, exact):
        torch.testing.assert_close(g.double(), truth.grad, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match=r"soft targets must be ids \[N, k\] and log-probs \[N, k\] for N = 29"):
        head_log_probs(hidden, weight, targets, soft=(ids[:3], q[:3]))


def test_top_k_log_probs_are_the_full_softmax_s_largest_beside_the_targets_log_probs():
    torch.manual_seed(2)
    hidden, weight, bias = torch.randn(23, 16), torch.randn(50, 16) / 4, torch.randn(50)
    targets = torch.randint(0, 50, (23,))
    target_logp, ids, logp = top_k_log_probs(hidden, weight, targets, 7, 0.9, bias, chunk_size=6)
    all_logp = ((hidden @ weight.T + bias) / 0.9).log_softmax(-1)
    full = all_logp.topk(7, -1)
    assert torch.equal(ids, full.indices) and ids.dtype == torch.long
    torch.testing.assert_close(logp, full.values, atol=1e-5, rtol=0)
    torch.testing.assert_close(target_logp, all_logp.gather(-1, targets[:, None])[:, 0], atol=1e-5, rtol=0)


def test_head_without_a_request_is_the_plain_linear_head():
    linear = torch.nn.Linear(8, 30, bias=False)
    head = LogProbHead(linear)
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(head(x), linear(x))
    with head.request(torch.zeros(6, dtype=torch.long), None, 1.0, False) as req:
        head(x)
    assert req.log_probs.shape == (6,) and head(x).shape == (2, 3, 30)


def test_bad_inputs_name_the_problem():
    batch = rl_batch(rows=2, prompt_width=3, response_width=3)
    batch["attention_mask"][1, :3] = 0
    with pytest.raises(ValueError, match="row 1"):
        build_inputs(batch["input_ids"], batch["attention_mask"], 3)
    with pytest.raises(ValueError, match="temperature"):
        token_log_probs(torch.zeros(2, 4), torch.zeros(6, 4), torch.zeros(2, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match=r"weight \[V, H\]"):
        token_log_probs(torch.zeros(2, 4), torch.zeros(6, 5), torch.zeros(2, dtype=torch.long))


def test_packed_attention_gives_flash_a_half_precision_dtype_or_none():
    """Under autocast q/k can arrive in fp32 (the rotary tables promote them): they take autocast's dtype;
    outside autocast fp32 has no flash dtype (the per-row path runs), and half precision passes through."""
    from hybridflow.engine.train.attention import _flash_dtype

    q, k, v = torch.randn(4, 2, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8).bfloat16()
    assert _flash_dtype(q, k, v) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = _flash_dtype(q, k, v)
    assert [t.dtype for t in cast] == [torch.bfloat16] * 3
    torch.testing.assert_close(cast[0], q.bfloat16())
    half = (q.half(), k.half(), v.half())
    assert all(a is b for a, b in zip(_flash_dtype(*half), half))


def test_fused_rms_norms_stay_through_train_and_eval(tiny_qwen2):
    # transformers' hub kernels (on where the `kernels` package is installed) kernelize again at a mode change,
    # which put the class forwards back over the fused ones
    from hybridflow.engine.train.kernels import _fused_rms_norm_forward
    from hybridflow.engine.train.model import load_model

    model = load_model(tiny_qwen2)
    norms = [m for m in model.modules() if type(m).__name__ == "Qwen2RMSNorm"]
    assert norms and not model.use_kernels
    for mode in (True, False, True):
        model.train(mode)
        assert all(vars(m).get("forward").__func__ is _fused_rms_norm_forward for m in norms)


def test_an_eager_pass_of_a_compiled_engine_compiles_nothing_and_gives_the_same_log_probs(tiny_qwen2):
    """`infer(eager=True)` (DPO's one-off reference pass) runs the compiled layers uncompiled."""
    from torch._dynamo.utils import counters

    batch = rl_batch(rows=3, prompt_width=5, response_width=4)
    plain = TrainEngine(model_cfg(tiny_qwen2), head="lm").infer(batch)["log_probs"]
    engine = TrainEngine(model_cfg(tiny_qwen2, compile=True), head="lm")
    assert engine.compiled
    torch._dynamo.reset()
    counters.clear()
    eager = engine.infer(batch, eager=True)["log_probs"]
    assert sum(counters["frames"].values()) == 0  # dynamo saw no frame: nothing was traced or compiled
    torch.testing.assert_close(eager, plain, atol=0, rtol=0)

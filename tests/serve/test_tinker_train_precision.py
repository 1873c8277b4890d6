"""How the service's training clients compute: their targets' log-probs through the training engine's log-prob head
(no full-vocabulary logits), the plain logits where an architecture transforms them after the head, and their
precision (`--train-dtype`: bf16 autocast over fp32 weights, the default on CUDA)."""

from __future__ import annotations

import pytest
import torch

tinker = pytest.importorskip("tinker")

from tests.serve.conftest import TOKENS, logprobs, sft_steps, start_server  # noqa: E402

ROWS = [TOKENS[:13], TOKENS[3:9]]  # two lengths: the shorter row is padded


def _trainee(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    from hybridflow.serve.trainee import Trainee

    return Trainee.full(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), "cpu",
                        compute_dtype=dtype)


def _request():
    from hybridflow.serve.trainee import LossRequest
    from hybridflow.serve.wire import FwdBwdDatum

    data = [FwdBwdDatum(row[:-1], {"target_tokens": torch.tensor(row[1:]), "weights": torch.ones(len(row) - 1)})
            for row in ROWS]
    return LossRequest(data, "cross_entropy", {})


def _plain(path, rows=ROWS):
    """transformers' own fp32 log-probs of each row's targets (one row at a time, unpadded) and the gradients of
    their summed cross-entropy."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = []
    for row in rows:
        logits = model(input_ids=torch.tensor([row[:-1]])).logits[0]
        out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(row[1:])[:, None])[:, 0])
    (-torch.cat(out).sum()).backward()
    return out, {n: p.grad for n, p in model.named_parameters()}


def _check_against_plain(trainee, path) -> None:
    (outputs, metrics), = trainee.forward_backward([_request()], forward_only=False)
    want, grads = _plain(path)
    for got, expected in zip(outputs, want):
        torch.testing.assert_close(got["logprobs"], expected, rtol=0, atol=1e-5)
    assert metrics["loss:sum"] == pytest.approx(-float(torch.cat(want).sum().detach()), rel=1e-5)
    for name, p in trainee.model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_log_prob_head_gives_transformers_log_probs_and_gradients(tiny_qwen2):
    from hybridflow.engine.train.head import LogProbHead

    trainee = _trainee(tiny_qwen2)
    assert isinstance(trainee.model.get_output_embeddings(), LogProbHead) and trainee.head is not None
    _check_against_plain(trainee, tiny_qwen2)


def test_a_model_that_soft_caps_its_logits_takes_the_plain_head(tiny_model_factory, tmp_path):
    from tests.engine.rollout.conftest import with_config

    capped = with_config(tiny_model_factory("gemma3_text"), tmp_path, final_logit_softcapping=2.0)
    trainee = _trainee(capped)
    assert trainee.head is None  # the log-prob head would drop the cap: these numbers would differ by far more
    _check_against_plain(trainee, capped)


def test_bf16_training_clients_run_under_autocast_over_fp32_weights(tiny_qwen2, tmp_path):
    """train_dtype=bf16 (the default on CUDA): a client's log-probs are bf16's, close to the fp32 ones and not equal;
    its weights and optimizer state stay fp32, and it trains."""
    served, stop = start_server(tiny_qwen2, tmp_path, train_dtype="bf16")
    try:
        trainer = served.client.create_lora_training_client(base_model="tiny", rank=2).result()
        got = logprobs(trainer, TOKENS)  # B = 0: the base model's log-probs
        (want,), _ = _plain(tiny_qwen2, [TOKENS])
        gap = (got - want).abs().max().item()
        assert 1e-4 < gap < 0.1, gap  # bf16's rounding (~1e-3 here); fp32 through the head differs by ~1e-6
        losses = sft_steps(trainer, TOKENS, 4, lr=5e-2)
        assert losses[-1] < losses[0]
        (model,) = served.service.models.values()
        assert {p.dtype for p in model.trainee.params} == {torch.float32}
        assert model.trainee.compute_dtype == torch.bfloat16
        assert {s["exp_avg"].dtype for s in model.trainee.optimizer.state.values()} == {torch.float32}
    finally:
        stop()

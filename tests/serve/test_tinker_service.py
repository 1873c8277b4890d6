"""`hybridflow serve` driven by the real `tinker` SDK on 127.0.0.1: LoRA SFT, sampling log-probs, the RL losses
against our own loss functions, and refused requests that leave the server serving."""

from __future__ import annotations

import math

import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from hybridflow.algorithms.losses import compute_policy_loss  # noqa: E402

from tests.serve.conftest import API_KEY, TOKENS  # noqa: E402
from tests.serve.conftest import datum as _datum  # noqa: E402


def test_sft_loss_falls_and_samples_carry_the_trained_logprobs(service_client):
    trainer = service_client.create_lora_training_client(base_model="tiny", rank=8, seed=0).result()
    datum = _datum(TOKENS, weights=[1.0] * (len(TOKENS) - 1))
    losses = []
    for _ in range(10):
        out = trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        losses.append(out.metrics["loss:sum"])
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.9 * losses[0], losses

    path = trainer.save_weights_for_sampler("sft").result().path
    sampler = service_client.create_sampling_client(model_path=path).result()
    prompt = TOKENS[:6]
    result = sampler.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=8, seed=1)).result()
    assert len(result.sequences) == 2
    for seq in result.sequences:
        assert 1 <= len(seq.tokens) == len(seq.logprobs) <= 8
        full = prompt + list(seq.tokens)
        own = trainer.forward([_datum(full, weights=[1.0] * (len(full) - 1))], "cross_entropy").result()
        trained = own.loss_fn_outputs[0]["logprobs"].to_torch()[len(prompt) - 1:]
        torch.testing.assert_close(torch.tensor(seq.logprobs), trained, atol=1e-4, rtol=0)


def _sampled_logprobs_match(sampler, trainer, prompt: list[int]) -> None:
    """Greedy samples of `prompt` carry the log-probs `trainer`'s model gives their tokens."""
    seq = sampler.sample(types.ModelInput.from_ints(prompt), 1,
                         types.SamplingParams(max_tokens=6, temperature=0.0)).result().sequences[0]
    full = prompt + list(seq.tokens)
    own = trainer.forward([_datum(full, weights=[1.0] * (len(full) - 1))], "cross_entropy").result()
    torch.testing.assert_close(torch.tensor(seq.logprobs),
                               own.loss_fn_outputs[0]["logprobs"].to_torch()[len(prompt) - 1:], atol=1e-4, rtol=0)


def test_sampling_the_base_model_after_a_snapshot_restores_its_weights(service_client):
    trained = service_client.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    trained.forward_backward([_datum(TOKENS, weights=[1.0] * (len(TOKENS) - 1))], "cross_entropy").result()
    trained.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    _sampled_logprobs_match(trained.save_weights_and_get_sampling_client().result(), trained, TOKENS[:5])
    fresh = service_client.create_lora_training_client(base_model="tiny", rank=4).result()  # B = 0: the base
    _sampled_logprobs_match(service_client.create_sampling_client(base_model="tiny").result(), fresh, TOKENS[:5])


@pytest.mark.parametrize("loss_fn, config", [("importance_sampling", {}),
                                             ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})])
def test_rl_losses_equal_our_loss_functions(service_client, loss_fn, config):
    trainer = service_client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    gen = torch.Generator().manual_seed(0)
    rows = [TOKENS[:16], TOKENS[8:24]]
    n = len(rows[0]) - 1
    base = trainer.forward([_datum(r, weights=[1.0] * n) for r in rows], "cross_entropy").result()
    logp = torch.stack([o["logprobs"].to_torch() for o in base.loss_fn_outputs])
    old = logp + 0.3 * torch.randn(logp.shape, generator=gen)  # the "sampler's" log-probs: ratios off 1
    adv = torch.randn(logp.shape, generator=gen)
    batch = [_datum(r, logprobs=old[i].tolist(), advantages=adv[i].tolist()) for i, r in enumerate(rows)]
    out = trainer.forward_backward(batch, loss_fn, config).result()

    got = out.metrics["loss:sum"]
    served_logp = torch.stack([o["logprobs"].to_torch() for o in out.loss_fn_outputs])
    torch.testing.assert_close(served_logp, logp, atol=1e-6, rtol=0)  # no step between: the same policy
    if loss_fn == "ppo":
        options = dict(clip_low=0.1, clip_high=0.1)
        ratio = torch.exp(logp - old)
        tinker_formula = torch.maximum(-ratio * adv, -ratio.clamp(0.9, 1.1) * adv).sum()
    else:
        options = dict(clip_low=math.inf, clip_high=math.inf)
        tinker_formula = (-torch.exp(logp - old) * adv).sum()
    ours, _ = compute_policy_loss("ppo", old, logp, adv, torch.ones_like(logp), clip_c=math.inf,
                                  agg="token-mean", global_token_count=1, **options)
    assert got == pytest.approx(float(ours), abs=1e-6, rel=1e-6)
    assert got == pytest.approx(float(tinker_formula), abs=1e-5, rel=1e-5)


def test_a_custom_loss_runs_client_side_through_cross_entropy(service_client):
    """The SDK computes a custom loss on the log-probs of a `forward` and sends its gradient as cross_entropy
    weights: -sum(logp) that way must step the adapters exactly as cross_entropy with unit weights does."""
    datum = _datum(TOKENS[:12], weights=[1.0] * 11)
    after = []
    for custom in (True, False):
        trainer = service_client.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
        if custom:
            trainer.forward_backward_custom([datum], lambda data, logps: (-sum(lp.sum() for lp in logps), {})).result()
        else:
            trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        after.append(trainer.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch())
    torch.testing.assert_close(after[0], after[1], atol=1e-6, rtol=0)


def test_a_client_from_saved_state_with_optimizer_resumes_exactly(service_client):
    datum = _datum(TOKENS, weights=[1.0] * (len(TOKENS) - 1))

    def steps(trainer, n: int) -> None:
        for _ in range(n):
            trainer.forward_backward([datum], "cross_entropy").result()
            trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()

    def logprobs(trainer) -> torch.Tensor:
        return trainer.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()

    first = service_client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    steps(first, 2)
    path = first.save_state("mid").result().path
    steps(first, 2)
    resumed = service_client.create_training_client_from_state_with_optimizer(path).result()
    steps(resumed, 2)
    torch.testing.assert_close(logprobs(resumed), logprobs(first), atol=0, rtol=0)
    fresh_moments = service_client.create_training_client_from_state(path).result()
    steps(fresh_moments, 2)  # weights only: Adam's moments start afresh, so the steps differ
    assert not torch.equal(logprobs(fresh_moments), logprobs(first))
    with pytest.warns(FutureWarning), \
            pytest.raises(tinker.RequestFailedError, match="holds rank-4 LoRA weights.*rank-2 LoRA"):
        service_client.create_lora_training_client(base_model="tiny", rank=2).result().load_state(path).result()


def test_refused_requests_get_the_sdk_error_and_the_server_goes_on(service_client):
    trainer = service_client.create_lora_training_client(base_model="tiny", rank=2).result()
    datum = _datum(TOKENS[:8], weights=[1.0] * 7)
    with pytest.raises(tinker.RequestFailedError, match="loss_fn='dpo_typo' is not served.*cross_entropy"):
        trainer.forward_backward([datum], "dpo_typo").result()
    with pytest.raises(tinker.RequestFailedError, match="needs loss_fn_inputs.*advantages"):
        trainer.forward_backward([datum], "ppo").result()
    with pytest.raises(tinker.RequestFailedError, match="base model 'Qwen/Qwen3-8B' is not served.*tiny"):
        service_client.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=2).result()
    out = trainer.forward_backward([datum], "cross_entropy").result()  # still serving
    assert math.isfinite(out.metrics["loss:sum"]) and len(out.loss_fn_outputs[0]["logprobs"].tolist()) == 7


def test_a_result_not_ready_within_the_poll_wait_is_polled_again(service_client, monkeypatch, caplog):
    from hybridflow.serve import http_api

    monkeypatch.setattr(http_api, "POLL_WAIT_S", 0.0)  # every poll that finds it unfinished answers try_again
    trainer = service_client.create_lora_training_client(base_model="tiny", rank=2).result()  # loading takes a while
    out = trainer.forward_backward([_datum(TOKENS, weights=[1.0] * (len(TOKENS) - 1))], "cross_entropy").result()
    assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == len(TOKENS) - 1
    assert any("because of try_again" in r.getMessage() for r in caplog.records)  # the SDK's own log line


def test_a_wrong_api_key_is_refused(service_client):
    url = str(service_client.holder._base_url)
    with pytest.raises(tinker.AuthenticationError, match="wrong API key"):  # the client connects on first use
        with tinker.ServiceClient(base_url=url, api_key="tml-wrong") as client:
            client.create_lora_training_client(base_model="tiny", rank=2)


def test_closing_a_client_ends_its_session_and_releases_its_models(server):
    """`ServiceClient.close` (and leaving its `with` block) finishes the session on the server: its training
    clients' models are released, another session's stay, and closing twice is the SDK's no-op."""
    other = server.client.create_lora_training_client(base_model="tiny", rank=2).result()
    with tinker.ServiceClient(base_url=server.url, api_key=API_KEY) as client:
        trainer = client.create_lora_training_client(base_model="tiny", rank=2).result()
        trainer.forward_backward([_datum(TOKENS, weights=[1.0] * (len(TOKENS) - 1))], "cross_entropy").result()
        session = client.holder.get_session_id()
        assert any(m.startswith(f"{session}:") for m in server.service.models)
    assert session not in server.service.sessions
    assert not any(m.startswith(f"{session}:") for m in server.service.models)
    assert other.model_id in server.service.models
    client.close("success").result(30)


def test_serve_command_refuses_a_directory_without_a_model(tmp_path, capsys):
    from hybridflow.cli import main

    assert main(["serve", "--model", f"tiny={tmp_path}"]) == 2
    assert f"--model tiny={tmp_path}: no config.json there" in capsys.readouterr().err
    assert main(["serve", "--model", f"a={tmp_path}", "--model", f"a={tmp_path}"]) == 2
    assert "each name once" in capsys.readouterr().err


def test_a_client_gone_before_its_body_arrived_costs_no_traceback(server, caplog):
    """A client that closes its connection half-way through a request's body (the SDK closing at exit with a
    heartbeat in flight) is no server fault: nothing is logged as an error, and the server goes on."""
    import logging
    import socket
    import time
    import urllib.request
    from urllib.parse import urlparse

    url = urlparse(server.url)
    with caplog.at_level(logging.DEBUG, logger="aiohttp"):
        with socket.create_connection((url.hostname, url.port)) as s:
            s.sendall(b"POST /api/v1/session_heartbeat HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"X-API-Key: " + API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"session_id\":")
            time.sleep(0.2)  # the handler is reading the body
        time.sleep(0.5)  # the server notices the closed connection
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    health = urllib.request.Request(f"{server.url}/api/v1/healthz", headers={"X-API-Key": API_KEY})
    with urllib.request.urlopen(health, timeout=10) as response:
        assert response.status == 200

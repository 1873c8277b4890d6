"""Requests that arrive together run together: two clients' concurrent sample calls on the same weights are one engine
batch (and one that arrives while that batch runs joins it), and a client's concurrent forward_backward calls one
forward and backward, with the results and the step each would get alone; through the real SDK, the worker held while
the requests queue up.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from hybridflow.serve.work_queue import Job  # noqa: E402
from tests.serve.conftest import TOKENS, datum, logprobs  # noqa: E402


def _hold(service) -> threading.Event:
    """Keep the worker busy until the returned event is set (requests queue up meanwhile). Returns once the worker
    holds: a hold job still waiting would count among the requests `_until_waiting` waits for, and the release could
    come before the last request arrived (seen once under load: each request then ran alone)."""
    release, holding = threading.Event(), threading.Event()
    service.queue.submit(Job(lambda requests: [holding.set(), release.wait(60)][1:], None))
    assert holding.wait(30), "the worker did not take the hold job"
    return release


def _settled(service) -> int:
    """The count of batches the worker ran, once every request before this call has run (a batch is counted after
    its run, and a sample batch answers its requests during its run)."""
    service.queue.submit(Job(lambda requests: [None], None)).result(60)
    return len(service.queue.batches) - 1  # not counting this call's own batch


def _until_waiting(service, n: int) -> None:
    deadline = time.monotonic() + 30
    while service.queue.waiting() < n:
        assert time.monotonic() < deadline, f"{service.queue.waiting()} requests queued, expected {n}"
        time.sleep(0.01)


def _sessions(engine, monkeypatch, on_first_step=None) -> list:
    """The engine's sessions, recorded as the service opens them; `on_first_step()` runs before the first step of
    the first one (while its batch holds the worker)."""
    sessions = []
    make = engine.session

    def session(params, hold=False):
        made = make(params, hold)
        sessions.append(made)
        step = made.step

        def first_step():
            if on_first_step is not None and len(sessions) == 1 and not made.stats["prefill_tokens"]:
                on_first_step()
            return step()

        made.step = first_step
        return made

    monkeypatch.setattr(engine, "session", session)
    return sessions


def test_concurrent_sample_calls_share_one_engine_batch(server, monkeypatch):
    service = server.service
    sampler = server.client.create_sampling_client(base_model="tiny").result()
    params = types.SamplingParams(max_tokens=5, temperature=1.0)
    alone = sampler.sample(types.ModelInput.from_ints(TOKENS[:4]), 2, params).result()  # the engine is built
    sessions = _sessions(service.samplers["tiny"].engine, monkeypatch)
    batches = _settled(service) + 1

    release = _hold(service)
    first = sampler.sample(types.ModelInput.from_ints(TOKENS[:4]), 2, params)
    second = server.client.create_sampling_client(base_model="tiny").result().sample(
        types.ModelInput.from_ints(TOKENS[5:12]), 2, params)  # another client, another prompt
    _until_waiting(service, 2)
    release.set()
    results = [first.result(), second.result()]
    assert len(sessions) == 1 and service.queue.batches[batches:_settled(service)] == [1, 2]  # the hold; one session
    for result in results + [alone]:
        assert len(result.sequences) == 2 and all(1 <= len(s.tokens) == len(s.logprobs) <= 5 for s in result.sequences)


def test_a_sample_request_arriving_mid_batch_joins_the_running_session(server, monkeypatch):
    """A request that comes while an engine session runs (the SDK's concurrent calls reach the server one by one)
    joins it between two steps instead of waiting for its end; a request of other parameters waits its turn."""
    service = server.service
    sampler = server.client.create_sampling_client(base_model="tiny").result()
    params = types.SamplingParams(max_tokens=6, temperature=1.0)
    sampler.sample(types.ModelInput.from_ints(TOKENS[:4]), 1, params).result()  # the engine is built
    late = []

    def send_more() -> None:
        late.append(sampler.sample(types.ModelInput.from_ints(TOKENS[5:12]), 2, params))
        late.append(sampler.sample(types.ModelInput.from_ints(TOKENS[:6]), 2, params))
        late.append(sampler.sample(types.ModelInput.from_ints(TOKENS[:6]), 2,
                                   types.SamplingParams(max_tokens=3, temperature=1.0)))  # another key
        _until_waiting(service, 3)

    sessions = _sessions(service.samplers["tiny"].engine, monkeypatch, send_more)
    batches = _settled(service) + 1
    first = sampler.sample(types.ModelInput.from_ints(TOKENS[:4]), 2, params).result()
    results = [first] + [f.result() for f in late]
    assert len(sessions) == 2 and service.queue.batches[batches:_settled(service)] == [3, 1]  # two joined the first
    assert [len(r.sequences) for r in results] == [2, 2, 2, 2]
    for result, most in zip(results, (6, 6, 6, 3)):
        assert all(1 <= len(s.tokens) == len(s.logprobs) <= most for s in result.sequences)


def test_concurrent_forward_backward_calls_of_a_client_run_as_one_pass(server):
    service = server.service
    rows = [TOKENS[:12], TOKENS[6:24]]
    clients = [server.client.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
               for _ in range(2)]
    packed, alone = clients
    batches = len(service.queue.batches)
    release = _hold(service)
    futures = [packed.forward_backward([datum(r, weights=[1.0] * (len(r) - 1))], "cross_entropy") for r in rows]
    _until_waiting(service, 2)
    release.set()
    packed_out = [f.result() for f in futures]
    assert service.queue.batches[batches:] == [1, 2]  # the hold, then both requests in one batch
    alone_out = [alone.forward_backward([datum(r, weights=[1.0] * (len(r) - 1))], "cross_entropy").result()
                 for r in rows]  # one after the other
    for p, a in zip(packed_out, alone_out):
        assert p.metrics["loss:sum"] == pytest.approx(a.metrics["loss:sum"], abs=1e-5)
        torch.testing.assert_close(p.loss_fn_outputs[0]["logprobs"].to_torch(),
                                   a.loss_fn_outputs[0]["logprobs"].to_torch(), atol=1e-6, rtol=0)
    for client in clients:
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    torch.testing.assert_close(logprobs(packed, TOKENS), logprobs(alone, TOKENS), atol=1e-5, rtol=0)


def test_a_request_that_cannot_be_served_fails_alone_in_its_batch(server):
    service = server.service
    trainer = server.client.create_lora_training_client(base_model="tiny", rank=2).result()
    sampler = server.client.create_sampling_client(base_model="tiny").result()
    params = types.SamplingParams(max_tokens=3)
    too_long = service.bases.base("tiny").config.max_position_embeddings + 1
    release = _hold(service)
    bad_loss = trainer.forward_backward([datum(TOKENS[:8], weights=[1.0] * 7)], "dpo_typo")
    good_loss = trainer.forward_backward([datum(TOKENS[:8], weights=[1.0] * 7)], "cross_entropy")
    bad_sample = sampler.sample(types.ModelInput.from_ints([1] * too_long), 1, params)
    good_sample = sampler.sample(types.ModelInput.from_ints(TOKENS[:4]), 1, params)
    _until_waiting(service, 4)
    release.set()
    with pytest.raises(tinker.RequestFailedError, match="loss_fn='dpo_typo' is not served"):
        bad_loss.result()
    with pytest.raises(tinker.RequestFailedError, match=f"prompt 0 has {too_long} tokens but the context holds "
                       r"max_model_len=\d+ tokens .* restart hybridflow serve with a larger --max-model-len"):
        bad_sample.result()
    assert len(good_loss.result().loss_fn_outputs[0]["logprobs"].tolist()) == 7
    assert len(good_sample.result().sequences) == 1
    end = _settled(service)
    assert service.queue.batches[end - 2:end] == [2, 2]  # each bad request rode in its batch and failed alone


def test_micro_batches_within_the_token_budget_give_the_one_batch_results(tiny_qwen2, tmp_path, server, monkeypatch,
                                                                         capsys):
    from hybridflow.cli import main
    from hybridflow.serve import http_api
    from tests.serve.conftest import start_server

    started = []
    monkeypatch.setattr(http_api, "serve", lambda config, *args: started.append(config))
    assert main(["serve", "--model", f"tiny={tiny_qwen2}", "--device", "cpu", "--micro-batch-tokens", "40"]) == 0
    assert main(["serve", "--model", f"tiny={tiny_qwen2}", "--device", "cpu"]) == 0
    assert [c.micro_batch_tokens for c in started] == [40, None]  # None: each client's follows the free memory
    assert main(["serve", "--model", f"tiny={tiny_qwen2}", "--micro-batch-tokens", "-1"]) == 2
    assert "--micro-batch-tokens=-1 must be >= 0" in capsys.readouterr().err
    small, stop = start_server(tiny_qwen2, tmp_path, micro_batch_tokens=40)
    try:
        rows = [TOKENS[:12], TOKENS[4:24], TOKENS[2:10]]  # 11, 19 and 7 inputs: [11, 19] pads to 38, 7 starts anew
        data = [datum(r, weights=[1.0] * (len(r) - 1)) for r in rows]
        outs, trainers = [], []
        for served in (small, server):
            trainer = served.client.create_lora_training_client(base_model="tiny", rank=4, seed=7).result()
            calls = []
            served.service.models[trainer.model_id].trainee.model.register_forward_hook(
                lambda *args: calls.append(1))
            outs.append(trainer.forward_backward(data, "cross_entropy").result())
            trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            trainers.append((trainer, len(calls)))
        assert [n for _, n in trainers] == [2, 1]  # two micro-batches within 40 tokens, one without a budget
        assert outs[0].metrics["loss:sum"] == pytest.approx(outs[1].metrics["loss:sum"], rel=1e-6)
        for a, b in zip(outs[0].loss_fn_outputs, outs[1].loss_fn_outputs):
            torch.testing.assert_close(a["logprobs"].to_torch(), b["logprobs"].to_torch(), atol=1e-6, rtol=0)
        torch.testing.assert_close(logprobs(trainers[0][0], TOKENS), logprobs(trainers[1][0], TOKENS), atol=1e-5,
                                   rtol=0)  # the same step: the micro-batches' gradients add up to the batch's
    finally:
        stop()


def test_left_out_the_micro_batch_follows_the_free_memory(tiny_qwen2, tmp_path, monkeypatch, server, caplog):
    """Without --micro-batch-tokens a client's micro-batches hold what TRAIN_MEMORY_FRACTION of the free memory at its
    creation holds of the model's activations: here memory for 40 tokens, so the rows above split in two, with the
    one-batch results; `0` asks for one batch whatever the memory."""
    from transformers import AutoConfig

    from hybridflow.engine.budget.estimate import ModelShape
    from hybridflow.serve import tinker_service
    from hybridflow.serve.trainee import TRAIN_MEMORY_FRACTION
    from tests.serve.conftest import start_server

    per_token = ModelShape.from_config(AutoConfig.from_pretrained(tiny_qwen2)).activation_bytes(4, False)
    monkeypatch.setattr(tinker_service, "free_memory", lambda device: int(40.5 * per_token / TRAIN_MEMORY_FRACTION))
    rows = [TOKENS[:12], TOKENS[4:24], TOKENS[2:10]]
    data = [datum(r, weights=[1.0] * (len(r) - 1)) for r in rows]
    outs, calls = [], []
    for config in ({}, {"micro_batch_tokens": 0}):
        served, stop = start_server(tiny_qwen2, tmp_path / str(len(outs)), **config)
        try:
            with caplog.at_level("INFO", logger=tinker_service.__name__):
                trainer = served.client.create_lora_training_client(base_model="tiny", rank=4, seed=7).result()
            seen = []
            served.service.models[trainer.model_id].trainee.model.register_forward_hook(lambda *a: seen.append(1))
            outs.append(trainer.forward_backward(data, "cross_entropy").result())
            calls.append(len(seen))
        finally:
            stop()
    assert calls == [2, 1]
    assert "micro-batches of 40 padded tokens" in caplog.text and "--micro-batch-tokens sets it" in caplog.text
    assert outs[0].metrics["loss:sum"] == pytest.approx(outs[1].metrics["loss:sum"], rel=1e-6)

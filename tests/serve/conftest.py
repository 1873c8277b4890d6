"""A `hybridflow serve` on a free 127.0.0.1 port in a background thread, per test module, and the real `tinker`
SDK's `ServiceClient` talking to it; helpers the serve tests share."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any

import pytest

API_KEY = "tml-local-test"
TOKENS = list(range(40, 64))  # one fixed sequence the model learns


@dataclass
class Server:
    client: Any  # tinker.ServiceClient
    service: Any  # the server's TinkerService, for what the SDK cannot see (its queue, shared weights)
    checkpoint_dir: Any
    url: str

    def rest(self) -> Any:
        """The SDK's RestClient (checkpoints, weights info) of this server."""
        import tinker

        return tinker.RestClient(base_url=self.url, api_key=API_KEY)


def start_server(model_dir, checkpoint_dir, name: str = "tiny", more_models: dict[str, Any] | None = None,
                 **config: Any):
    """(Server, stop): a server of the tiny model as `name` (and of `more_models`, {name: directory}) with `config`'s
    ServeConfig fields."""
    tinker = pytest.importorskip("tinker")
    from aiohttp import web

    from hybridflow.serve.http_api import SERVICE, make_app
    from hybridflow.serve.config import ServeConfig

    loop = asyncio.new_event_loop()
    models = {name: model_dir, **(more_models or {})}
    app = make_app(ServeConfig(models, max_num_seqs=8, checkpoint_dir=checkpoint_dir, **config), api_key=API_KEY)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())  # the site binds a free port itself
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"

    client = tinker.ServiceClient(base_url=url, api_key=API_KEY)

    def stop() -> None:
        # the SDK's session heartbeats would otherwise outlive the server, logging a failure every minute
        client.close("success").result(30)
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)

    return Server(client, app[SERVICE], checkpoint_dir, url), stop


@pytest.fixture(scope="module")
def server(tiny_qwen2, tmp_path_factory):
    served, stop = start_server(tiny_qwen2, tmp_path_factory.mktemp("checkpoints"))
    yield served
    stop()


@pytest.fixture(scope="module")
def service_client(server):
    return server.client


def datum(tokens: list[int], **inputs: list[float]):
    """A Datum predicting `tokens[1:]` from `tokens[:-1]`, with these loss inputs."""
    from tinker import types

    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], **inputs})


def logprobs(trainer, tokens: list[int]):
    """The trainer's log-probs of `tokens[1:]` (a forward, no step)."""
    out = trainer.forward([datum(tokens, weights=[1.0] * (len(tokens) - 1))], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].to_torch()


def sft_steps(trainer, tokens: list[int], steps: int, lr: float = 1e-2) -> list[float]:
    """`steps` cross_entropy steps on `tokens`; the loss of each."""
    from tinker import types

    losses = []
    for _ in range(steps):
        out = trainer.forward_backward([datum(tokens, weights=[1.0] * (len(tokens) - 1))], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=lr)).result()
        losses.append(out.metrics["loss:sum"])
    return losses

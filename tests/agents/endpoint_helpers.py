"""Helpers of the endpoint tests: the endpoint served on a tiny engine (or on a scripted driver) in this
process, for the real `openai` client."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from hybridflow.agents.endpoint.http_server import JSONServer
from hybridflow.agents.endpoint.routes import Endpoint
from hybridflow.agents.loop.engine_driver import EngineDriver
from hybridflow.engine.rollout import Completion, SamplingParams
from hybridflow.engine.rollout.session import Launched, Session

TOKEN = "test-token"


@contextlib.asynccontextmanager
async def serving(tokenizer, driver, params: SamplingParams, budget: int = 64, max_prompt_length: int = 200,
                  vocab_size: int = 10**6, max_concurrent: int = 64, images=None,
                  **server_args) -> AsyncIterator[tuple[Endpoint, int]]:
    """(endpoint, port) served on 127.0.0.1 while the block runs; `driver.serve()` runs beside it. images: a
    vision-language model's `RequestImages`; server_args: `JSONServer`'s limits."""
    endpoint = Endpoint(tokenizer, driver, params, budget, max_prompt_length, vocab_size, max_concurrent, TOKEN,
                        images)
    server = JSONServer(endpoint.handle, **server_args)
    port = await server.start()
    task = asyncio.create_task(driver.serve())
    try:
        yield endpoint, port
    finally:
        driver.stop()
        await asyncio.gather(task, return_exceptions=True)
        await server.close()
        endpoint.close()


def engine_driver(engine, params: SamplingParams) -> EngineDriver:
    return EngineDriver(engine.session(params, hold=True))


class _Finished:
    """A CUDA event's stand-in whose work is done."""

    def synchronize(self) -> None:
        pass


def launch_as_on_a_gpu(monkeypatch) -> None:
    """Every `Session.launch` returns its step with an event, as on CUDA, so `EngineDriver` takes its GPU path: a
    worker thread collects each step and launches the next while the event loop serves requests."""
    launch = Session.launch

    def launched_with_an_event(self: Session) -> Launched | None:
        got = launch(self)
        return None if got is None else Launched(got.tick, got.busy, got.prefilled, _Finished())

    monkeypatch.setattr(Session, "launch", launched_with_an_event)


# how many `client`s the running test made (`tests/agents/conftest.py` collects them once the test has ended)
CLIENTS_MADE = [0]


def client(port: int, key: str, api_key: str = TOKEN):
    import openai

    CLIENTS_MADE[0] += 1
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/t/{key}/v1", api_key=api_key, max_retries=0)


class ScriptedDriver:
    """A driver whose "model" writes scripted texts, tokenized as the tokenizer would (then the stop id): the
    endpoint's stitching and the token check on a real template without an engine. It records what the
    endpoint asked (`calls`) and keeps each sequence's ids, so a test can compare them with the template."""

    max_group = 8

    def __init__(self, tokenizer, answers: list[str], stop_id: int) -> None:
        self.tokenizer, self.answers, self.stop_id = tokenizer, list(answers), stop_id
        self.sequences: dict[int, list[int]] = {}
        self.released: set[int] = set()
        self.calls: list[tuple] = []
        self.next = 0

    def _answer(self, seq: int) -> asyncio.Future:
        ids = self.tokenizer(self.answers.pop(0), add_special_tokens=False)["input_ids"] + [self.stop_id]
        self.sequences[seq] += ids
        future = asyncio.get_running_loop().create_future()
        future.set_result(Completion(ids, [-0.5] * len(ids), "stop"))
        return future

    def start(self, prompt, n, max_tokens):
        self.calls.append(("start", len(prompt), n))
        pairs = []
        for _ in range(n):
            seq, self.next = self.next, self.next + 1
            self.sequences[seq] = list(prompt)
            pairs.append((seq, self._answer(seq)))
        return pairs

    def extend(self, seq, tokens, max_tokens):
        assert seq not in self.released
        self.calls.append(("extend", seq, len(tokens)))
        self.sequences[seq] += tokens
        return self._answer(seq)

    def shorten(self, seq, drop, last_token):
        del self.sequences[seq][-drop:]

    def release(self, seq):
        self.released.add(seq)

    def stop(self):
        pass

    async def serve(self):
        pass

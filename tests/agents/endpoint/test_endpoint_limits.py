"""The endpoint under large, slow and malformed requests, from the client's side (raw sockets on 127.0.0.1 and the
real `openai` client): the key and the declared length checked before the body is read, malformed requests
answered 400, idle and slow connections closed, client mistakes answered 4xx with an OpenAI-style body and no
traceback in the log, and an oversized message refused from its length, its rendering off the event loop."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import openai
import pytest
from transformers import AutoTokenizer

from endpoint_helpers import TOKEN, ScriptedDriver, client, engine_driver, serving
from hybridflow.agents.endpoint.stitching import Renderers
from hybridflow.agents.loop.rendering import Encoder
from hybridflow.engine.rollout import RolloutEngine, SamplingParams

PARAMS = SamplingParams(temperature=1.0, max_tokens=4, seed=0)
QUESTION = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen2):
    return AutoTokenizer.from_pretrained(tiny_qwen2)


def scripted(tokenizer, answers: int = 8) -> ScriptedDriver:
    return ScriptedDriver(tokenizer, ["Fine."] * answers, tokenizer.eos_token_id)


def post(path: str, body: bytes, key: str = TOKEN, length: int | str | None = None) -> bytes:
    """A raw POST request: `length` overrides the Content-Length header."""
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer ".encode() + key.encode()
            + f"\r\nContent-Type: application/json\r\nContent-Length: {len(body) if length is None else length}"
              f"\r\n\r\n".encode() + body)


async def exchange(port: int, data: bytes, timeout: float = 5.0) -> tuple[int | None, bytes]:
    """Sends `data` on a new connection; (status, body) of the answer, or (None, b"") when the server closes the
    connection without one."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(timeout):
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
            body = await reader.readexactly(int(headers.get("content-length", 0)))
        return int(lines[0].split()[1]), body
    except (asyncio.IncompleteReadError, ConnectionError):
        return None, b""
    finally:
        writer.close()


def chat(path_key: str = "k") -> str:
    return f"/t/{path_key}/v1/chat/completions"


def test_the_key_and_the_declared_length_are_checked_before_the_body_is_read(tokenizer):
    """A wrong or non-ASCII key is answered 401 and a body declared over the limit 413, though none of the body
    was sent: the server did not wait for it. A chunked body (no length declared) is refused 413 once it grows
    past the limit. Below the limit, the request is served."""

    async def main():
        async with serving(tokenizer, scripted(tokenizer), PARAMS, max_body_bytes=4096) as (endpoint, port):
            endpoint.open("k")
            start = time.monotonic()
            wrong = await exchange(port, post(chat(), b"", key="wrong", length=50 * 2**20))
            accented = await exchange(port, post(chat(), b"", key="t\u00e9st-token", length=10))
            too_large = await exchange(port, post(chat(), b"", length=5000))
            waited = time.monotonic() - start
            head = (f"POST {chat()} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
                    f"Transfer-Encoding: chunked\r\n\r\n1388\r\n")  # one chunk of 0x1388 = 5000 bytes
            chunked = await exchange(port, head.encode() + b"x" * 5000 + b"\r\n0\r\n\r\n")
            fits = json.dumps({"model": "policy", "messages": QUESTION}).encode()
            served = await exchange(port, post(chat(), fits))
            return wrong, accented, too_large, waited, chunked, served

    wrong, accented, too_large, waited, chunked, served = asyncio.run(main())
    assert wrong[0] == 401 and json.loads(wrong[1])["error"]["code"] == "invalid_api_key"
    assert accented[0] == 401 and json.loads(accented[1])["error"]["code"] == "invalid_api_key"
    assert too_large[0] == 413 and "at most 4096" in json.loads(too_large[1])["error"]["message"]
    assert waited < 4  # three answers without their bodies (a wait for one would take the 5 s timeout)
    assert chunked[0] == 413 and json.loads(chunked[1])["error"]["code"] == "request_too_large"  # no length declared
    assert served[0] == 200 and json.loads(served[1])["choices"][0]["message"]["content"] == "Fine."


def test_malformed_requests_are_answered_400_without_a_traceback(tokenizer, caplog):
    async def main():
        async with serving(tokenizer, scripted(tokenizer), PARAMS) as (endpoint, port):
            endpoint.open("k")
            return [await exchange(port, post(chat(), b"{}", length=length)) for length in (-5, "abc")] + [
                await exchange(port, b"NOT HTTP AT ALL\r\n\r\n"),
                await exchange(port, post(chat(), b"{not json")),
                await exchange(port, post(chat(), b"[1, 2]"))]

    with caplog.at_level(logging.DEBUG, logger="hybridflow"):
        answers = asyncio.run(main())
    assert [status for status, _ in answers] == [400] * 5
    assert "not JSON" in json.loads(answers[3][1])["error"]["message"]
    assert "must be a JSON object" in json.loads(answers[4][1])["error"]["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_idle_and_slow_connections_time_out(tokenizer):
    """A connection that sends nothing, or trickles its headers, is closed after the idle timeout; a body that
    does not arrive in time is answered 408."""

    async def closed_after(port: int, data: bytes) -> float:
        start = time.monotonic()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(data)
        async with asyncio.timeout(5):
            assert await reader.read() == b""  # closed by the server, no answer
        writer.close()
        return time.monotonic() - start

    async def main():
        async with serving(tokenizer, scripted(tokenizer), PARAMS, idle_timeout_s=0.5, body_timeout_s=0.5) as (
                endpoint, port):
            endpoint.open("k")
            silent = await closed_after(port, b"")
            trickled = await closed_after(port, b"POST /t/k/v1/chat/completions HTTP/1.1\r\nHost: 127")
            slow_body = await exchange(port, post(chat(), b'{"model": ', length=100))
            return silent, trickled, slow_body

    silent, trickled, slow_body = asyncio.run(main())
    assert 0.4 < silent < 3 and 0.4 < trickled < 3
    assert slow_body[0] == 408 and json.loads(slow_body[1])["error"]["code"] == "request_timeout"


def test_client_mistakes_are_answered_4xx_in_openai_form_without_a_traceback(tiny_qwen2, tokenizer, caplog):
    """Each mistake a 400 naming its parameter, none logged; then the trajectory is served as if none had come.
    Sixteen KV slots: a request may ask for at most two samples (an eighth)."""
    engine = RolloutEngine.from_pretrained(tiny_qwen2, max_num_seqs=16, max_model_len=128)
    nested = {"type": "object", "properties": {}}
    for _ in range(80):
        nested = {"type": "object", "properties": {"x": nested}}
    mistakes = [(dict(n=3), "n"), (dict(n=10000), "n"), (dict(n=0), "n"), (dict(n=True), "n"),
                (dict(tools=[1]), "tools[0]"), (dict(temperature=True), "temperature"), (dict(top_p="1"), "top_p"),
                (dict(stop=5), "stop"), (dict(max_tokens=1.5), "max_tokens"),
                (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": nested}}]), None)]

    async def main():
        async with serving(tokenizer, engine_driver(engine, PARAMS), PARAMS) as (endpoint, port):
            endpoint.open("k")
            api = client(port, "k")
            errors = []
            for change, param in mistakes:
                with pytest.raises(openai.BadRequestError) as caught:
                    await api.chat.completions.create(model="policy", messages=QUESTION, **change)
                errors.append((param, caught.value.body))
            deep = b'{"model": "policy", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
            raw = await exchange(port, post(chat(), deep))
            served = await api.chat.completions.create(model="policy", messages=QUESTION, n=2)
            return endpoint, errors, raw, served

    with caplog.at_level(logging.DEBUG, logger="hybridflow"):
        endpoint, errors, raw, served = asyncio.run(asyncio.wait_for(main(), timeout=60))
    for param, body in errors:
        assert set(body) == {"message", "type", "param", "code"} and body["param"] == param, body
    assert "nests JSON deeper than 64 levels" in errors[-1][1]["message"]
    assert "serves n <= 2" in errors[0][1]["message"] and "serves n <= 2" in errors[1][1]["message"]
    assert raw[0] == 400 and "nests JSON deeper" in json.loads(raw[1])["error"]["message"]
    assert len(served.choices) == 2 and endpoint.stats["errors"] == len(errors) + 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_an_oversized_message_is_refused_from_its_length_and_rendered_off_the_event_loop(tokenizer, monkeypatch):
    """A 4 MB first message is refused from its characters (the prompt holds 200 tokens), and one sent as a
    continuation is cut to the trajectory's room before it is tokenized: neither reaches the tokenizer whole,
    and neither is kept. Every rendering runs in the renderers' thread, not the event loop's."""
    encoded, threads = [], set()
    ids, render, encode = Renderers.ids, Renderers.render, Encoder.__call__

    def spy_ids(self, text: str, special: bool = False) -> list[int]:
        encoded.append(len(text))
        return ids(self, text, special)

    def spy_encode(self, text: str, plain: bool) -> list[int]:
        encoded.append(len(text))
        return encode(self, text, plain)

    def spy_render(self, *args, **kwargs) -> str:
        threads.add(threading.current_thread().name)
        return render(self, *args, **kwargs)

    monkeypatch.setattr(Renderers, "ids", spy_ids)
    monkeypatch.setattr(Renderers, "render", spy_render)
    monkeypatch.setattr(Encoder, "__call__", spy_encode)
    huge = "word " * (4 * 2**20 // 5)

    async def main():
        async with serving(tokenizer, scripted(tokenizer), PARAMS, budget=32) as (endpoint, port):
            first, later = endpoint.open("first"), endpoint.open("later")
            with pytest.raises(openai.BadRequestError) as refused:
                await client(port, "first").chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": huge}])
            api = client(port, "later")
            reply = await api.chat.completions.create(model="policy", messages=QUESTION)
            follow = [*QUESTION, reply.choices[0].message.model_dump(exclude_none=True),
                      {"role": "user", "content": huge}]
            with pytest.raises(openai.BadRequestError) as cut:
                await api.chat.completions.create(model="policy", messages=follow)
            return first, later, refused.value.body, cut.value.body

    first, later, refused, cut = asyncio.run(asyncio.wait_for(main(), timeout=30))
    assert refused["code"] == "context_length_exceeded" and "characters" in refused["message"]
    assert cut["code"] == "context_length_exceeded" and later.trajectory.cut_by_budget
    assert first.pending is None and first.trajectory.prompt_ids is None  # nothing of it kept
    assert max(encoded) < 10_000 and threads == {"endpoint-render_0"}

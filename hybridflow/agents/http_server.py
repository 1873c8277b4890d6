"""A small HTTP/1.1 server for JSON requests on asyncio, bound to 127.0.0.1 only.

It runs on the same event loop as the engine driver, so a request goes from the socket to the engine's
session with no thread hop. Enough HTTP for OpenAI clients (httpx, aiohttp, requests): keep-alive
connections, bodies sized by `Content-Length`, JSON answers. A request the server cannot read (a bad
request line, a chunked or too large body) gets a 400 / 411 / 413 JSON error and the connection closes.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

logger = logging.getLogger(__name__)

Handler = Callable[[str, str, dict[str, str], bytes], Awaitable[tuple[int, Any]]]
MAX_BODY = 64 * 2**20
MAX_HEADERS = 100


def _error(status: int, message: str) -> tuple[int, dict[str, Any]]:
    return status, {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}


class JSONServer:
    """`handler(method, path, headers, body) -> (status, JSON-able payload)` served on 127.0.0.1."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.server: asyncio.base_events.Server | None = None
        self.port = 0
        self.connections: set[asyncio.Task] = set()

    async def start(self) -> int:
        """Listens on a free port of 127.0.0.1; returns it."""
        self.server = await asyncio.start_server(self._serve, host="127.0.0.1", port=0, limit=2**20,
                                                 backlog=4096)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            for task in list(self.connections):
                task.cancel()
            await asyncio.gather(*self.connections, return_exceptions=True)
            self.server = None

    async def _read(self, reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str], bytes] | tuple[int, str]:
        """(method, path, headers, body), or (status, why) for a request that cannot be read."""
        line = await reader.readline()
        if not line:
            raise EOFError
        parts = line.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1"):
            return 400, f"bad request line {line[:80]!r}"
        headers: dict[str, str] = {}
        while (raw := await reader.readline()) not in (b"\r\n", b"\n", b""):
            if len(headers) >= MAX_HEADERS:
                return 400, "too many headers"
            key, _, value = raw.decode("latin-1").partition(":")
            headers[key.strip().lower()] = value.strip()
        if headers.get("transfer-encoding"):
            return 411, "send the body with a Content-Length (chunked bodies are not read)"
        length = int(headers.get("content-length") or 0)
        if length > MAX_BODY:
            return 413, f"the body has {length} bytes; at most {MAX_BODY} are read"
        body = await reader.readexactly(length) if length else b""
        if parts[2] == "HTTP/1.0" and headers.get("connection", "").lower() != "keep-alive":
            headers["connection"] = "close"
        return parts[0], parts[1], headers, body

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None  # asyncio runs a connection's callback coroutine as a task of its own
        self.connections.add(task)
        try:
            while True:
                request = await self._read(reader)
                keep = len(request) == 4 and request[2].get("connection", "").lower() != "close"
                if len(request) == 4:
                    try:
                        status, payload = await self.handler(*request)
                    except Exception as e:  # noqa: BLE001 - a handler bug answers 500, the server goes on
                        logger.exception("the endpoint failed on %s %s", request[0], request[1])
                        status, payload = _error(500, f"internal error: {type(e).__name__}: {e}")
                else:
                    status, payload = _error(*request)
                data = json.dumps(payload, ensure_ascii=False).encode()
                head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(data)}\r\nConnection: {'keep-alive' if keep else 'close'}\r\n\r\n")
                writer.write(head.encode("latin-1") + data)
                await writer.drain()
                if not keep:
                    break
        except (EOFError, ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError,
                asyncio.CancelledError):  # the client left, or the server is closing
            pass
        finally:
            self.connections.discard(task)
            writer.close()

"""The endpoint's HTTP server: aiohttp's web server on 127.0.0.1, on the event loop that drives the engine.

It runs on the same event loop as the engine driver, so a request goes from the socket to the engine's session
with no thread hop. aiohttp's HTTP parser (llhttp) answers a request it cannot read (a bad request line, a
`Content-Length` of `-5` or `abc`, oversized headers) 400 by itself (logged in one line at debug level: the
client's mistake, not ours), and a
connection that sends no complete request within `idle_timeout_s` (nothing at all, headers trickled, or
nothing between two requests) is closed. It replaced a hand-written asyncio server with no timeouts, which
read every body whole before the handler ran (docs/agents.md, "Requests the endpoint refuses", measures both).

The handler sees the method, path and headers before any of the body is read: it checks the API key and the
route first and reads the body (`read`) only then. A body declared larger than `max_body_bytes` is refused
from its `Content-Length` (413), before a byte of it is read; a chunked one as soon as it grows past that;
one that has not arrived within `body_timeout_s` is answered 408. Every answer is JSON; an exception other than
`APIError` is our bug: logged with its traceback and answered 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from hybridflow.agents.endpoint.openai_wire import APIError

logger = logging.getLogger(__name__)

BodyReader = Callable[[], Awaitable[bytes]]
Handler = Callable[[str, str, Mapping[str, str], BodyReader], Awaitable[tuple[int, Any]]]
MAX_BODY = 64 * 2**20
# longer than the clients' own keep-alive (aiohttp's 15 s, httpx's 5 s), so a client never sends a request on a
# connection the server is closing
IDLE_TIMEOUT_S = 75.0
BODY_TIMEOUT_S = 30.0


class _ServerLog(logging.LoggerAdapter):
    """aiohttp's server log, where a request it could not parse (its 4xx answer) is one debug line, not an error
    with a traceback; anything else it reports stays an error."""

    def exception(self, msg: Any, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        if isinstance(exc_info, HttpProcessingError) and exc_info.code < 500:
            self.debug("a malformed request, answered %d: %s", exc_info.code, exc_info.message.strip())
        else:
            super().exception(msg, *args, exc_info=exc_info, **kwargs)


class JSONServer:
    """`handler(method, path, headers, read) -> (status, JSON-able payload)` served on 127.0.0.1; `read()` returns
    the body (see the module docstring for the limits)."""

    def __init__(self, handler: Handler, max_body_bytes: int = MAX_BODY, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 body_timeout_s: float = BODY_TIMEOUT_S) -> None:
        self.handler = handler
        self.max_body_bytes, self.idle_timeout_s, self.body_timeout_s = max_body_bytes, idle_timeout_s, body_timeout_s
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> int:
        """Listens on a free port of 127.0.0.1; returns it."""
        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_route("*", "/{path:.*}", self._serve)
        # no access log (a line per request); lingering: an unread body (a refused request's) is drained and
        # dropped for up to a second after the answer, so the client reads the answer rather than a reset
        self.runner = web.AppRunner(app, access_log=None, keepalive_timeout=self.idle_timeout_s, lingering_time=1.0,
                                    shutdown_timeout=0.0, handle_signals=False,
                                    logger=_ServerLog(logging.getLogger("aiohttp.server")))
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0, backlog=4096)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self.port

    async def close(self) -> None:
        """Stops listening and ends the open connections (a request still waiting is abandoned)."""
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def _serve(self, request: web.Request) -> web.Response:
        async def read() -> bytes:
            declared = request.content_length
            if declared is not None and declared > self.max_body_bytes:
                raise APIError(413, f"the body has {declared} bytes; this endpoint reads at most {self.max_body_bytes}",
                               code="request_too_large")
            try:
                async with asyncio.timeout(self.body_timeout_s):
                    return await request.read()
            except TimeoutError:
                raise APIError(408, f"the body did not arrive within {self.body_timeout_s:g} s",
                               code="request_timeout") from None
            except web.HTTPRequestEntityTooLarge:  # a chunked body past the limit
                raise APIError(413, f"the body has more than {self.max_body_bytes} bytes; this endpoint reads at "
                                    f"most {self.max_body_bytes}", code="request_too_large") from None

        try:
            status, payload = await self.handler(request.method, request.path, request.headers, read)
        except APIError as e:  # raised by `read`, outside the handler's own error handling
            status, payload = e.status, e.body()
        except Exception as e:  # noqa: BLE001 - our bug: answered 500, logged with its traceback
            logger.exception("the endpoint failed on %s %s", request.method, request.path)
            status, payload = 500, APIError(500, f"internal error: {type(e).__name__}: {e}",
                                            kind="server_error").body()
        return web.Response(body=json.dumps(payload, ensure_ascii=False).encode(), status=status,
                            content_type="application/json")

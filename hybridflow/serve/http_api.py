"""The Tinker REST API (`/api/v1/...`, as the `tinker` SDK 0.38 speaks it) over `TinkerService`, on aiohttp.

    hybridflow serve --model Qwen3-0.6B=/models/qwen3-0.6b --port 8000 [--host 0.0.0.0] [--api-key tml-...]
    # then: tinker.ServiceClient(base_url="http://127.0.0.1:8000", api_key="tml-...")

Thin: each route validates its JSON body with the SDK's own request type, calls the service, and answers
with the SDK's response type. Long operations answer an `UntypedAPIFuture` at once; the SDK then polls
`/api/v1/retrieve_future`, which waits up to `POLL_WAIT_S` for the result and otherwise answers the SDK's
`try_again`. A failed operation answers `{"error", "category"}` (the SDK raises `RequestFailedError`); a
body the SDK types reject answers 400 with the reason. With `--api-key`, every request must carry it in
`X-API-Key` (the SDK's header), else 401.
"""

from __future__ import annotations

import asyncio
import json
import logging
from functools import partial
from typing import Any, Awaitable, Callable

import torch
from aiohttp import web
from pydantic import BaseModel, ValidationError
from tinker import types

from hybridflow.serve.config import ServeConfig
from hybridflow.serve.tinker_service import Result, TinkerService
from hybridflow.serve.wire import PROTO_CONTENT_TYPE, WireError, read_forward_backward

log = logging.getLogger(__name__)
POLL_WAIT_S = 20.0  # under the SDK's 45 s retrieve timeout
SERVICE: web.AppKey[TinkerService] = web.AppKey("service", TinkerService)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _body(request: web.Request, model: type[BaseModel]) -> Any:
    try:
        return model.model_validate(await request.json())
    except (ValidationError, ValueError) as e:
        raise _bad(str(e)) from e
    except ConnectionResetError as e:
        # the client went away before its body arrived (an SDK closing at exit, its heartbeat in flight): an answer
        # nobody reads, not a server fault with a traceback in the log
        raise _bad("the client closed the connection before the request's body arrived") from e


def _bad(detail: str, error: type[web.HTTPException] = web.HTTPBadRequest) -> web.HTTPException:
    """An HTTP error whose JSON body carries `detail`, which the SDK's errors show."""
    return error(text=json.dumps({"detail": detail}), content_type="application/json")


def _future(request_id: str, model_id: str | None = None, sequence_ids: list[str] | None = None) -> web.Response:
    return web.json_response(types.UntypedAPIFuture(request_id=request_id, model_id=model_id,
                                                    sample_sequence_ids=sequence_ids).model_dump(mode="json"))


def _fail(message: str, category: types.RequestErrorCategory) -> web.Response:
    return web.json_response(types.RequestFailedResponse(error=message, category=category).model_dump(mode="json"))


async def retrieve_future(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    req = await _body(request, types.FutureRetrieveRequest)
    future = service.futures.get(req.request_id)
    if future is None:
        return _fail(f"request {req.request_id!r} is unknown (never made, or its result was already taken)",
                     types.RequestErrorCategory.User)
    if not future.done():
        # A result that comes in time is answered at once; else the SDK is told to poll again.
        waiting = asyncio.wrap_future(future)
        # the result is read from `future` (now or at a later poll), never from this wrapper: mark its error seen
        waiting.add_done_callback(lambda w: w.cancelled() or w.exception())
        done, _ = await asyncio.wait([waiting], timeout=POLL_WAIT_S)
        if not done:
            # the SDK's TryAgainResponse (not exported by tinker.types): it polls again at once
            return web.json_response({"type": "try_again", "request_id": req.request_id, "queue_state": "active"})
    try:
        result = future.result()
    except ValueError as e:  # the caller's mistake (unknown model or loss, bad shapes...)
        service.futures.pop(req.request_id, None)
        return _fail(str(e), types.RequestErrorCategory.User)
    except torch.OutOfMemoryError as e:  # the server goes on; what would make the request fit is named
        log.exception("request %s ran out of device memory", req.request_id)
        service.futures.pop(req.request_id, None)
        return _fail(f"the device ran out of memory ({str(e).splitlines()[0]}); send fewer or shorter data per "
                     f"request, or restart hybridflow serve with a smaller --micro-batch-tokens (forward_backward "
                     f"passes), --kv-cache-memory or --max-num-seqs (the sampling engine), or --quantization nf4 "
                     f"(LoRA clients' bases in 4 bits)", types.RequestErrorCategory.Server)
    except Exception as e:  # a fault of the server: logged with its traceback, reported to the caller
        log.exception("request %s failed", req.request_id)
        service.futures.pop(req.request_id, None)
        return _fail(f"{type(e).__name__}: {e}", types.RequestErrorCategory.Server)
    service.futures.pop(req.request_id, None)
    if isinstance(result, bytes):
        return web.Response(body=result, content_type=PROTO_CONTENT_TYPE)
    return web.json_response(result)


async def forward_backward(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    try:
        req = read_forward_backward(await request.read())
    except WireError as e:
        raise _bad(str(e)) from e
    return _future(service.submit_forward_backward(req), req.model_id)


async def asample(request: web.Request) -> web.Response:
    # The SDK stamps these ids on the returned sequences, one per sample, fixed at submission.
    service = request.app[SERVICE]
    req = await _body(request, types.SampleRequest)
    request_id = service.submit_sample(req)
    return _future(request_id, sequence_ids=[f"{request_id}:{i}" for i in range(req.num_samples)])


def _queued(model: type[BaseModel], operation: Callable[[TinkerService, Any], Result]) -> Handler:
    """A route that validates its body as `model` and queues `operation(service, body)`."""
    async def handle(request: web.Request) -> web.Response:
        service = request.app[SERVICE]
        req = await _body(request, model)
        return _future(service.queued(partial(operation, service), req), getattr(req, "model_id", None))
    return handle


async def list_checkpoints(request: web.Request) -> web.Response:
    # one training run's (`/training_runs/{id}/checkpoints`) or every one's (`/checkpoints`); unpaginated
    try:
        return web.json_response(request.app[SERVICE].checkpoints(request.match_info.get("model_id")))
    except ValueError as e:
        raise _bad(str(e), web.HTTPNotFound) from e


async def weights_info(request: web.Request) -> web.Response:
    # the SDK sends {"tinker_path": ...} (it has no request type for it)
    try:
        path = (await request.json())["tinker_path"]
    except (ValueError, KeyError, TypeError) as e:
        raise _bad('weights_info takes a JSON body {"tinker_path": "tinker://MODEL/weights/NAME"}') from e
    try:
        return web.json_response(request.app[SERVICE].weights_info(str(path)))
    except ValueError as e:
        raise _bad(str(e), web.HTTPNotFound) from e


async def client_config(request: web.Request) -> web.Response:
    # API keys only (no JWT exchange); per-request futures; custom losses run client-side. The SDK's pyqwest
    # transport (its default, a dependency of tinker): httpx's own took 0.37-0.57 s against 0.25 s for 64 concurrent
    # samples of a tiny model, the engine alone 0.15 s (2 CPU cores; docs/tinker.md)
    return web.json_response(types.ClientConfigResponse(
        pjwt_auth_enabled=False, use_pyqwest_transport=True, sample_use_retrieve_futures=False,
        custom_loss_server_side=False, sample_join_sampling_session=False).model_dump(mode="json"))


async def create_session(request: web.Request) -> web.Response:
    await _body(request, types.CreateSessionRequest)
    session_id = request.app[SERVICE].create_session()
    return web.json_response(types.CreateSessionResponse(session_id=session_id).model_dump(mode="json"))


async def session_heartbeat(request: web.Request) -> web.Response:
    req = await _body(request, types.SessionHeartbeatRequest)
    if not request.app[SERVICE].sessions.heartbeat(req.session_id):  # 410: the SDK stops its heartbeat loop
        raise _bad(f"session {req.session_id!r} is finished or expired", web.HTTPGone)
    return web.json_response(types.SessionHeartbeatResponse().model_dump())


async def _expire_sessions(app: web.Application) -> Any:
    """While the app runs: finish the sessions whose clients stopped sending heartbeats (`Sessions`), looking a
    few times per timeout."""
    service = app[SERVICE]

    async def loop(period: float) -> None:
        while True:
            await asyncio.sleep(period)
            service.expire_sessions()

    timeout = service.config.session_timeout_s
    task = asyncio.create_task(loop(min(timeout / 4, 10.0))) if timeout > 0 else None
    yield
    if task is not None:
        task.cancel()


async def finish_session(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    try:
        await asyncio.wrap_future(service.finish_session(request.match_info["session_id"]))
    except ValueError as e:
        raise _bad(str(e), web.HTTPNotFound) from e
    return web.json_response(None)


async def create_sampling_session(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    req = await _body(request, types.CreateSamplingSessionRequest)
    try:
        sampling_id = service.create_sampling_session(req)
    except ValueError as e:
        raise _bad(str(e)) from e
    response = types.CreateSamplingSessionResponse(sampling_session_id=sampling_id)
    return web.json_response(response.model_dump(mode="json"))


async def get_info(request: web.Request) -> web.Response:
    req = await _body(request, types.GetInfoRequest)
    try:
        return web.json_response(request.app[SERVICE].info(req.model_id))
    except ValueError as e:
        raise _bad(str(e)) from e


async def get_sampler(request: web.Request) -> web.Response:
    try:
        return web.json_response(request.app[SERVICE].sampler_info(request.match_info["sampler_id"]))
    except ValueError as e:
        raise _bad(str(e), web.HTTPNotFound) from e


def _constant(payload: dict[str, Any]) -> Handler:
    async def handle(request: web.Request) -> web.Response:
        return web.json_response(payload)
    return handle


def _api_key_check(api_key: str | None) -> Any:
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if api_key is not None and request.headers.get("X-API-Key") != api_key:
            return web.json_response({"detail": "missing or wrong API key (X-API-Key)"}, status=401)
        return await handler(request)
    return check


def make_app(config: ServeConfig, api_key: str | None = None) -> web.Application:
    """The aiohttp application serving `config`'s models; the service is closed with the app."""
    app = web.Application(middlewares=[_api_key_check(api_key)], client_max_size=1 << 30)
    service = TinkerService(config)
    app[SERVICE] = service

    async def close(_: web.Application) -> None:
        service.close()

    app.on_cleanup.append(close)
    app.cleanup_ctx.append(_expire_sessions)
    api = "/api/v1"
    app.add_routes([
        web.get(f"{api}/healthz", _constant(types.HealthResponse(status="ok").model_dump())),
        web.get(f"{api}/get_server_capabilities", _constant(service.capabilities())),
        web.post(f"{api}/client/config", client_config),
        web.post(f"{api}/client/dynamic_config", _constant(types.ClientDynamicConfigResponse().model_dump())),
        web.post(f"{api}/create_session", create_session),
        web.post(f"{api}/sessions/{{session_id}}/finish", finish_session),
        web.post(f"{api}/session_heartbeat", session_heartbeat),
        web.post(f"{api}/telemetry", _constant(types.TelemetryResponse(status="accepted").model_dump())),
        web.post(f"{api}/create_model", _queued(types.CreateModelRequest, TinkerService.create_model)),
        web.post(f"{api}/get_info", get_info),
        web.post(f"{api}/forward_backward", forward_backward),
        web.post(f"{api}/optim_step", _queued(types.OptimStepRequest, TinkerService.optim_step)),
        web.post(f"{api}/save_weights", _queued(types.SaveWeightsRequest, TinkerService.save_weights)),
        web.post(f"{api}/save_weights_external",
                 _queued(types.SaveWeightsExternalRequest, TinkerService.save_weights_external)),
        web.get(f"{api}/training_runs/{{model_id}}/checkpoints", list_checkpoints),
        web.get(f"{api}/checkpoints", list_checkpoints),
        web.post(f"{api}/weights_info", weights_info),
        web.post(f"{api}/load_weights", _queued(types.LoadWeightsRequest, TinkerService.load_weights)),
        web.post(f"{api}/save_weights_for_sampler",
                 _queued(types.SaveWeightsForSamplerRequest, TinkerService.save_weights_for_sampler)),
        web.post(f"{api}/create_sampling_session", create_sampling_session),
        web.get(f"{api}/samplers/{{sampler_id}}", get_sampler),
        web.post(f"{api}/asample", asample),
        web.post(f"{api}/retrieve_future", retrieve_future),
    ])
    return app


def serve(config: ServeConfig, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None) -> None:
    """Run the server until interrupted (Ctrl-C, SIGTERM)."""
    web.run_app(make_app(config, api_key), host=host, port=port)  # prints the address it listens on

"""`Endpoint`: the OpenAI-compatible routes over the engine driver the in-process agent loop also uses.

    GET  /v1/models                      the served model (`MODEL_NAME`)
    POST /t/<key>/v1/chat/completions    messages, tools, tool_choice, n, temperature, top_p, max_tokens,
                                         stop, logprobs; tool calls come back in OpenAI's `tool_calls`
    POST /t/<key>/v1/completions         a prompt (text or ids), the same sampling keys

Each trajectory has its own base URL (`/t/<key>/v1`, the key unguessable) and every request must carry
the rollout phase's random token as its API key (`Authorization: Bearer <token>`). Requests of one
trajectory run one after the other and are stitched into its token sequence (`stitching.Lane`); at most
`max_concurrent` requests are served at once (the rest wait their turn). The served sequences are the
engine's (`EngineDriver`): the answers are the sampled ids, their log-probs and their text, decoded once.
A request the engine cannot serve gets an OpenAI-style error body (`openai_wire`). A request for a
trajectory whose runner has returned is refused, counted and drops that trajectory.

A request is checked in order of cost, so no check waits for a more expensive step: the API key and the route
from the headers, before the body is read (`http_server`); the body's shape and values (`openai_wire`); its
length against the trajectory's limits from its characters, before anything is rendered (`stitching`). The
decoding, the checks and the rendering and tokenizing run in the renderers' thread, off the event loop that
drives the engine, so a large request does not hold up the other trajectories' requests or the engine's steps.
A request for more samples than the engine admits without holding back others (`driver.max_group`: an eighth
of its KV slots) is refused: it would wait at the head of the engine's queue until that many slots are free,
and every new trajectory behind it would wait too.

A vision-language model's endpoint (`images`, served by `VisionDriver`) takes `image_url` content parts
(`image_parts`); a text model's refuses them 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from hybridflow.agents.endpoint.openai_wire import (APIError, Choice, Request, decode_body, models_body, parse_request,
                                                    response_body)
from hybridflow.agents.endpoint.image_parts import RequestImages
from hybridflow.agents.endpoint.stitching import Lane, Plan, Renderers, budget_error, cut_at_stop
from hybridflow.agents.tools.parsing import OPEN, parse_tool_calls
from hybridflow.engine.rollout import Completion, SamplingParams

if TYPE_CHECKING:
    from hybridflow.agents.endpoint.http_server import BodyReader

CHAT, COMPLETIONS, MODELS = "/v1/chat/completions", "/v1/completions", "/v1/models"


class Endpoint:
    """The routes (see the module docstring). driver: an `EngineDriver` over a held session sampling with
    `params` (its max_tokens caps a turn; its `max_group` caps a request's n); budget: response tokens of a
    trajectory over all its turns; max_prompt_length: tokens of a trajectory's prompt; vocab_size: bound of
    prompt ids; images: a vision-language model's (its driver's `start` and `extend` then take each plan's
    `vision`), None for a text model."""

    def __init__(self, tokenizer: Any, driver: Any, params: SamplingParams, budget: int, max_prompt_length: int,
                 vocab_size: int, max_concurrent: int, token: str, images: RequestImages | None = None) -> None:
        self.tokenizer, self.driver, self.params, self.budget = tokenizer, driver, params, budget
        self.max_prompt_length, self.vocab_size, self.token = max_prompt_length, vocab_size, token
        self.renderers = Renderers(tokenizer, images)
        self.lanes: dict[str, Lane] = {}
        self.slots = asyncio.Semaphore(max_concurrent)
        self.active = 0
        self.stats = {"requests": 0, "errors": 0, "peak_concurrent": 0}

    def open(self, key: str) -> Lane:
        self.lanes[key] = Lane(key)
        return self.lanes[key]

    def close(self) -> None:
        """Ends the renderers' thread."""
        self.renderers.close()

    async def handle(self, method: str, path: str, headers: Mapping[str, str], read: BodyReader) -> tuple[int, Any]:
        """One HTTP request -> (status, JSON body); `read()` reads its body."""
        self.stats["requests"] += 1
        try:
            return 200, await self._route(method, path.split("?", 1)[0], headers, read)
        except APIError as e:
            self.stats["errors"] += 1
            return e.status, e.body()

    async def _route(self, method: str, path: str, headers: Mapping[str, str], read: BodyReader) -> dict[str, Any]:
        given = headers.get("authorization", "")
        # compare_digest takes ASCII text only; any other key is wrong anyway
        if not (given.isascii() and hmac.compare_digest(given, f"Bearer {self.token}")):
            raise APIError(401, "missing or wrong API key: use the key given with this endpoint's base URL",
                           code="invalid_api_key", kind="authentication_error")
        key = None
        if path.startswith("/t/"):
            key, _, rest = path[3:].partition("/")
            path = "/" + rest
        if method == "GET" and path.rstrip("/") in (MODELS, "/models"):
            return models_body()
        route = path.rstrip("/").removeprefix("/v1")
        if method != "POST" or route not in ("/chat/completions", "/completions"):
            raise APIError(404, f"there is no route {method} {path}; served: GET {MODELS}, POST {CHAT}, "
                                f"POST {COMPLETIONS}", code="not_found")
        lane = self.lanes.get(key) if key else None
        if lane is None:
            raise APIError(404, "no trajectory at this base URL: send requests to the base URL given to the runner "
                                "(http://127.0.0.1:<port>/t/<key>/v1)", code="trajectory_not_found")
        if lane.ended:
            lane.trajectory.late_requests += 1
            lane.trajectory.drop("a request came after its runner returned")
            raise APIError(400, "this trajectory has ended: its runner returned before this request",
                           code="trajectory_ended")
        body = await read()
        # in flight from here: a request waiting for the concurrency cap is its runner waiting on us, not idle
        lane.in_flight += 1
        try:
            # a trajectory holding a KV slot is served past the cap: capped, it could wait for requests that
            # wait for its slot (new trajectories holding the cap's places), forever
            async with self.slots if not lane.holds() else contextlib.nullcontext():
                self.active += 1
                self.stats["peak_concurrent"] = max(self.stats["peak_concurrent"], self.active)
                try:
                    async with lane.lock:
                        request, plan = await self.renderers.call(self._prepare, lane, body,
                                                                  route == "/chat/completions")
                        return await self._turn(lane, request, plan)
                finally:
                    self.active -= 1
        finally:
            lane.in_flight -= 1
            lane.last_activity = time.monotonic()
            if lane.ended:  # its runner returned meanwhile (`Lane.end`)
                lane.end(self.driver.release)

    def _prepare(self, lane: Lane, body: bytes, chat: bool) -> tuple[Request, Plan]:
        """The checked request and its plan on the lane (in the renderers' thread)."""
        images = self.renderers.images
        request = parse_request(decode_body(body), chat, self.params.temperature, self.params.top_p,
                                self.driver.max_group, images.mark if images is not None else None)
        try:
            plan = lane.plan(request, self.renderers, self.budget, self.max_prompt_length)
        except TemplateError as e:  # the template's own refusal (e.g. roles that do not alternate)
            raise APIError(400, f"the model's chat template refuses these messages: {e}", param="messages") from None
        if plan.prompt and max(plan.prompt) >= self.vocab_size:
            raise APIError(400, f"token id {max(plan.prompt)} is outside the vocabulary [0, {self.vocab_size})",
                           param="prompt", code="invalid_value")
        return request, plan

    async def _turn(self, lane: Lane, request: Request, plan: Plan) -> dict[str, Any]:
        """Run the request's plan on the engine, record and answer it."""
        cap = min(request.max_tokens or self.params.max_tokens, self.params.max_tokens)
        images = {} if self.renderers.images is None else {"vision": plan.vision}  # a VLM's driver takes them
        if plan.seq is not None:
            held = lane.answers().choices[plan.choice]
            room = self.budget - len(lane.trajectory.token_ids) - len(held.ids) - len(plan.appended)
            if room < 1:
                lane.trajectory.cut()
                raise budget_error(self.budget)
            lane.continue_with(plan, self.driver.release, cached=self.renderers.images is None)
            seqs, futures = [plan.seq], [self.driver.extend(plan.seq, plan.appended, min(cap, room), **images)]
        else:
            lane.start_segment(plan.prompt, self.driver.release, plan.vision)
            pairs = self.driver.start(plan.prompt, request.n, min(cap, self.budget), **images)
            seqs, futures = [seq for seq, _ in pairs], [future for _, future in pairs]
        prompt_tokens = len(lane.segment_prompt()) + len(lane.trajectory.token_ids)
        completions = await asyncio.gather(*futures)
        answers = [self._choice(seq, completion, request) for seq, completion in zip(seqs, completions)]
        lane.answered(request, [a for a, _ in answers], seqs, [stopped for _, stopped in answers])
        return response_body(self.tokenizer, request.messages is not None, [a for a, _ in answers], prompt_tokens,
                             request.logprobs)

    def _choice(self, seq: int, completion: Completion, request: Request) -> tuple[Choice, bool]:
        """The answer of one sequence, and whether its last id is a stop token. A stop string cuts the turn
        after the token that completes it (the sequence forgets the rest); tool calls are parsed."""
        finish: str  # the engine's, or "tool_calls"
        ids, logprobs, finish = completion.token_ids, completion.logprobs, completion.finish_reason
        stopped, text = finish == "stop", None
        cut = cut_at_stop(self.tokenizer, ids, request.stop) if request.stop else None
        if cut is not None:
            keep, text = cut
            if keep < len(ids):
                self.driver.shorten(seq, len(ids) - keep, ids[keep - 1])
                ids, logprobs, stopped = ids[:keep], logprobs[:keep], False
            finish = "stop"
        if text is None:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if request.messages is None:
            return Choice(ids, logprobs, finish, text=text), stopped
        message: dict[str, Any] = {"role": "assistant", "content": text}
        calls = parse_tool_calls(text) if request.parse_tools else []
        if calls and all(call.error is None for call in calls):
            message = {"role": "assistant", "content": text[:text.find(OPEN)].rstrip(),
                       "tool_calls": [{"type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                                      for call in calls]}
            finish = "tool_calls"
        return Choice(ids, logprobs, finish, message=message, text=text), stopped

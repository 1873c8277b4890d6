"""One endpoint trajectory's requests stitched into one token sequence (`Lane`).

A trajectory's first request is rendered by the chat template (with its tools) and tokenized: that is the
trajectory's prompt. Its answers (n choices) wait in their KV slots. The next request continues choice c
when its messages are the previous request's messages, then choice c's message as it was returned (the
same content and tool calls), then new messages: the ids of the new messages (`TurnRenderer`, the same
rendering the in-process loop appends) follow choice c's sampled ids and the engine prefills only them.
Anything else (edited history, another tool list, a template that renders the conversation differently
once the new messages follow, n > 1 on a continuation) starts a new segment: the held choices are
released and the request is rendered and prefilled whole; only the last segment is trained on. Raw
completions stitch the same way on text (or ids): a prompt that is the previous prompt plus a returned
text plus more continues it, unless that choice ended on a stop token the text does not show.

A vision-language model's requests carry images (`image_parts`): a new segment's are decoded and processed with
its prompt, each image mark expanded to its vision tokens; a continuation's new messages bring theirs, whose vision
tokens take the marks' places in the appended ids (`ImageSlots`). The lane's trajectory keeps its segment's images
in token order (`Trajectory.vision`), and the plan hands the new ones to the driver.

The recorded ids and log-probs are always the engine's; `finish` commits the last request's first choice
and runs the token-exact check (`token_check`) against the template's rendering of the final conversation.

A request's length is checked before anything is rendered or tokenized, so an oversized message costs no more
than one that fits: no token spans more characters than the vocabulary's longest entry, so message contents of
more than `(limit + 1)` times that many characters cannot fit `limit` tokens. A new segment whose contents
exceed that for `data.max_prompt_length` is refused at once; a continuation's new contents (or text) are cut to
what could still fit the trajectory's room, so their ids exceed it and the request is refused with a full
context. The rendering and tokenizing then run in `Renderers`' own thread (`Renderers.call`), off the event
loop that drives the engine and serves the other trajectories' requests; one thread, since the tokenizer's
backend is switched per call between reading special-token text as such or as plain text.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hybridflow.agents.endpoint.image_parts import RequestImages
from hybridflow.agents.endpoint.openai_wire import APIError, Choice, Request, same_message
from hybridflow.agents.endpoint.token_check import first_mismatch
from hybridflow.agents.loop.rendering import TurnRenderer
from hybridflow.agents.loop.trajectory import Trajectory
from hybridflow.data.chat import render_messages, with_tools
from hybridflow.data.image_prompts import VisionInputs

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Renderers:
    """The chat template's renderings for one tokenizer, a `TurnRenderer` per tool list (cached), and the thread
    they run in (`call`; `close` ends it); a vision-language model's `images` (None for a text model)."""

    def __init__(self, tokenizer: Any, images: RequestImages | None = None) -> None:
        self.tokenizer, self.images = tokenizer, images
        self.cache: dict[str, TurnRenderer] = {}
        self.max_token_chars = self.turn(None).max_token_chars
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="endpoint-render")

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in the rendering thread (every use of the tokenizer's encoder runs there)."""
        return await asyncio.get_running_loop().run_in_executor(self.thread, fn, *args)

    def close(self) -> None:
        """Ends the rendering thread once its current call returns; calls still queued are dropped."""
        self.thread.shutdown(wait=False, cancel_futures=True)

    def most_chars(self, tokens: int) -> int:
        """Characters beyond which a text cannot fit `tokens` tokens."""
        return (max(tokens, 0) + 1) * self.max_token_chars

    def turn(self, tools: list[dict] | None) -> TurnRenderer:
        key = json.dumps(tools, sort_keys=True)
        if key not in self.cache:
            self.cache[key] = TurnRenderer(self.tokenizer, tools)
        return self.cache[key]

    def render(self, messages: list[dict[str, Any]], tools: list[dict] | None, generation_prompt: bool) -> str:
        """The conversation as text, the tools shown the way `TurnRenderer` shows them."""
        args = self.turn(tools).template_args
        if tools and not args:  # a template without tools= support: the tools go into the system message
            messages, _ = with_tools(messages, self.tokenizer, tools)
        mark = self.images.mark if self.images is not None else None
        return render_messages(messages, self.tokenizer, mark, add_generation_prompt=generation_prompt, **args)

    def ids(self, text: str, special: bool = False) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])


@dataclass
class Pending:
    """A request's answers, waiting to be continued: its messages (chat) or prompt, tools, the choices
    and their held sequences (None once released)."""

    chat: bool
    messages: list[dict[str, Any]] | None
    tools: list[dict] | None
    prompt: str | list[int] | None
    choices: list[Choice]
    seqs: list[int | None]
    stopped: list[bool]  # the choice's last id is a stop token (the template's end of turn follows it)


@dataclass
class Plan:
    """What a request does: continue `seq` (choice `choice`) with `appended` ids, or start a segment from
    `prompt` ids with n samples; `vision`: the images of the appended ids or of the prompt (None: none)."""

    seq: int | None = None
    choice: int = 0
    appended: list[int] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)  # empty for a continuation
    vision: VisionInputs | None = None


class Lane:
    """A trajectory served by the endpoint (see the module docstring)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.trajectory = Trajectory()
        self.lock = asyncio.Lock()
        self.pending: Pending | None = None
        self.in_flight = 0
        self.last_activity = time.monotonic()
        self.ended = False
        self.finished: Trajectory | None = None  # `finish`'s result, once made

    # ------------------------------------------------------------------ planning a request
    def plan(self, request: Request, renderers: Renderers, budget: int, max_prompt_length: int) -> Plan:
        """Continue a held choice when the request extends it, else a new segment's prompt ids (refused when
        longer than `max_prompt_length`). A continuation's ids are cut past the room the trajectory's `budget`
        leaves (see the module docstring); the caller refuses them then. In the rendering thread."""
        messages = request.messages
        chat = messages is not None
        last = self.pending
        if last is not None and last.chat == chat and request.n == 1:
            for c, choice in enumerate(last.choices):
                if last.seqs[c] is None:
                    continue
                room = budget - len(self.trajectory.token_ids) - len(choice.ids)
                if chat:
                    appended, vision = self._chat_continuation(request, last, c, renderers, room) or ([], None)
                else:
                    appended, vision = self._text_continuation(request, last, c, renderers, room) or [], None
                if appended:
                    if len(appended) < room:  # else refused as over the budget (the contents may have been cut)
                        check_image_tokens(renderers, appended, vision, "the continuation")
                    return Plan(seq=last.seqs[c], choice=c, appended=appended, vision=vision)
        if messages is not None:
            chars = sum(len(m["content"]) for m in messages)
        elif isinstance(request.prompt, str):
            chars = len(request.prompt)
        else:
            chars = 0
        if chars > renderers.most_chars(max_prompt_length):
            raise prompt_error(max_prompt_length, f"its message contents hold {chars} characters")
        vision = renderers.images.load(request.images) if renderers.images is not None else None
        if messages is not None:
            text = renderers.render(messages, request.tools, generation_prompt=True)
            prompt = renderers.ids(renderers.images.expand(text, vision) if renderers.images is not None else text)
        elif isinstance(request.prompt, list):
            prompt = list(request.prompt)
        elif isinstance(request.prompt, str):
            prompt = renderers.ids(request.prompt, True)
        else:
            raise ValueError(f"trajectory {self.key}: a request with neither messages nor a prompt")
        if len(prompt) > max_prompt_length:
            raise prompt_error(max_prompt_length, f"this one has {len(prompt)}")
        check_image_tokens(renderers, prompt, vision, "the prompt")
        return Plan(prompt=prompt, vision=vision)

    @staticmethod
    def _chat_continuation(request: Request, last: Pending, c: int, renderers: Renderers,
                           room: int) -> tuple[list[int], VisionInputs | None] | None:
        """The ids choice c's continuation appends and the images they hold, None when the request does not
        continue it."""
        messages, sent, returned = request.messages, last.messages, last.choices[c].message
        if messages is None or sent is None or returned is None:  # not a chat request or not a chat answer
            return None
        before = len(sent)
        if (request.tools != last.tools or len(messages) <= before + 1 or messages[:before] != sent
                or not same_message(messages[before], returned)):
            return None
        images, vision = renderers.images, None
        slots = None
        if images is not None:  # the images of the new messages: the request's last ones
            vision = images.load(request.images[sum(len(m.get("images", ())) for m in sent):])
            slots = images.slots(vision)
        try:
            return renderers.turn(request.tools).render(messages[before + 1:],
                                                        last.choices[c].ids[-1] if last.stopped[c] else None,
                                                        limit=max(room, 0), images=slots), vision
        except ValueError:  # the template renders the conversation differently once these messages follow
            return None

    @staticmethod
    def _text_continuation(request: Request, last: Pending, c: int, renderers: Renderers,
                           room: int) -> list[int] | None:
        prompt, before, choice = request.prompt, last.prompt, last.choices[c]
        if last.stopped[c]:
            return None
        if isinstance(prompt, list) and isinstance(before, list):
            done = [*before, *choice.ids]
            return prompt[len(done):] if prompt[:len(done)] == done else None
        if isinstance(prompt, str) and isinstance(before, str):
            text = before + choice.text
            rest = prompt[len(text):len(text) + renderers.most_chars(room)] if prompt.startswith(text) else ""
            return renderers.ids(rest) if rest else None
        return None  # a prompt of another kind (ids after text, or the reverse)

    # ------------------------------------------------------------------ recording
    def answers(self) -> Pending:
        """The last request's answers, which a continuation's plan extends."""
        if self.pending is None:
            raise ValueError(f"trajectory {self.key} has no answered request to continue")
        return self.pending

    def continue_with(self, plan: Plan, release: Any, cached: bool = True) -> None:
        """Commit the continued choice and the appended ids; release the other held choices. cached: the engine
        attends over the sequence's KV cache (a vision-language model's driver re-prefills it: nothing reused)."""
        last = self.answers()
        choice = last.choices[plan.choice]
        self.trajectory.add_model_turn(choice.completion())
        self.trajectory.add_env_turn(plan.appended, vision=plan.vision)
        if cached:
            self.trajectory.kv_reused_tokens += len(self.segment_prompt()) + len(self.trajectory.token_ids) \
                - len(plan.appended) - 1
        last.seqs[plan.choice] = None
        self.release(release)

    def start_segment(self, prompt: list[int], release: Any, vision: VisionInputs | None = None) -> None:
        self.release(release)
        self.trajectory.start_segment(prompt, vision)

    def segment_prompt(self) -> list[int]:
        """The current segment's prompt ids (an endpoint trajectory has them once its first request started)."""
        if self.trajectory.prompt_ids is None:
            raise ValueError(f"trajectory {self.key} has started no segment")
        return self.trajectory.prompt_ids

    def holds(self) -> bool:
        """Whether a choice of its last request still holds its sequence (a KV slot) in the engine."""
        return self.pending is not None and any(seq is not None for seq in self.pending.seqs)

    def end(self, release: Any) -> None:
        """Its runner returned or failed: no later request is served, so the held choices' KV slots go back now
        (`release(seq)`) for the trajectories still waiting for one, unless a request is still running (the
        endpoint frees them when it ends). The trajectory keeps the ids and log-probs it recorded."""
        self.ended = True
        if not self.in_flight:
            self.release(release)

    def release(self, release: Any) -> None:
        """Free every held choice's sequence (`release(seq)`)."""
        if self.pending is not None:
            for seq in self.pending.seqs:
                if seq is not None:
                    release(seq)
            self.pending.seqs = [None] * len(self.pending.seqs)

    def answered(self, request: Request, choices: list[Choice], seqs: list[int], stopped: list[bool]) -> None:
        self.pending = Pending(request.messages is not None, request.messages, request.tools, request.prompt,
                               choices, list(seqs), stopped)

    # ------------------------------------------------------------------ the end
    def finish(self, renderers: Renderers) -> Trajectory:
        """The trajectory as trained: the last request's first choice committed, the token-exact check run; once
        (a later call returns the same trajectory). In the rendering thread; it leaves the engine alone (the
        caller has released the held choices: `end`)."""
        if self.finished is None:
            self.finished = self._finish(renderers)
        return self.finished

    def _finish(self, renderers: Renderers) -> Trajectory:
        trajectory, last = self.trajectory, self.pending
        if last is None:
            trajectory.drop("the runner made no request")
            return trajectory
        first = last.choices[0]
        trajectory.add_model_turn(first.completion())
        if last.messages is None or first.message is None:  # a completion: no conversation to check against
            return trajectory
        trajectory.messages = [*last.messages, first.message]
        expected = renderers.render(trajectory.messages, last.tools, generation_prompt=False)
        if renderers.images is not None:  # the marks of the segment's images, as its ids hold them
            expected = renderers.images.expand(expected, trajectory.vision)
        closing = renderers.turn(last.tools).closing(first.ids[-1] if last.stopped[0] else None)
        prompt_ids = self.segment_prompt()
        position = first_mismatch(renderers.tokenizer, prompt_ids, trajectory.token_ids,
                                  trajectory.response_mask, expected, closing)
        if position is not None:
            trajectory.token_mismatch = 1
            ids = prompt_ids + trajectory.token_ids
            logger.warning("trajectory %s: its ids differ from the chat template's rendering of its final "
                           "conversation at token %d of %d (%r...)", self.key, position, len(ids),
                           renderers.tokenizer.decode(ids[position:position + 12], skip_special_tokens=False))
        return trajectory


def check_image_tokens(renderers: Renderers, ids: list[int], vision: VisionInputs | None, what: str) -> None:
    """A vision-language model's `ids` must hold exactly the image tokens of their images `vision`: a text writing
    the image token would be taken for an image position without pixels (the engine refuses it, failing the phase)."""
    images = renderers.images
    if images is None:
        return
    have, want = ids.count(images.pad_id), sum(images.counts(vision))
    if have != want:
        raise APIError(400, f"{what} has {have} image tokens where its images make {want}: a text must not write the "
                            f"image token ({images.prompts.pad})", param="messages", code="invalid_value")


def cut_at_stop(tokenizer: Any, ids: list[int], stop: list[str]) -> tuple[int, str] | None:
    """(ids to keep, text before the stop string) when the decoded turn contains a stop string; the kept
    ids are the fewest whose text reaches the end of the first stop string."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    found = [(text.find(s), s) for s in stop if s in text]
    if not found:
        return None
    start, s = min(found)
    low, high = 1, len(ids)
    while low < high:
        mid = (low + high) // 2
        if len(tokenizer.decode(ids[:mid], skip_special_tokens=True)) >= start + len(s):
            high = mid
        else:
            low = mid + 1
    return low, text[:start]


def prompt_error(limit: int, what: str) -> APIError:
    """The answer to a new segment's prompt longer than `data.max_prompt_length` (`what`: by how much)."""
    return APIError(400, f"This model's maximum context length is {limit} tokens for a prompt (data.max_prompt_length: "
                         f"a trajectory's first request, or one that does not continue the last), and {what}",
                    param="messages", code="context_length_exceeded")


def budget_error(budget: int) -> APIError:
    """The answer to a request with no room left (the phrase agent libraries recognize as a full context)."""
    return APIError(400, f"This model's maximum context length is reached for this trajectory: its turns hold at "
                         f"most data.max_response_length={budget} tokens together", code="context_length_exceeded")

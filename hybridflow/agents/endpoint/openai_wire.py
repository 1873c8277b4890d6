"""The OpenAI wire format of the endpoint: requests checked against what the engine can serve, messages
normalized, responses and error bodies built.

The engine samples every sequence of a rollout phase with the phase's settings (`rollout.temperature`,
`top_p`, `top_k`, stop ids): a request may leave `temperature` / `top_p` out or repeat those values, and is
refused otherwise (the trainer needs the log-probs of the distribution that was sampled). Refused too,
with an OpenAI-style error body (`{"error": {"message", "type", "param", "code"}}`): another model name,
`stream`, a forced `tool_choice`, `top_logprobs` > 0 (the engine returns the sampled token's log-prob
only), `seed`, penalties, `logit_bias`, a JSON `response_format`. Keys the endpoint does not know are
ignored, as vLLM does with its own extensions. The body is checked before anything is rendered: JSON nested
deeper than `MAX_DEPTH` levels, a value of the wrong type (`temperature: true`, `tools: [1]`, `stop: 5`), `n` < 1 or
above what the engine admits without holding back other trajectories (`max_n`) are refused 400. Message contents are
text, or lists of text parts and, for a vision-language model (`image_mark` given), `image_url` parts (`ImagePart`;
decoded by `image_parts`): a text model, a remote URL or an image in an assistant message is refused 400 naming the
part.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridflow.engine.rollout import Completion

MODEL_NAME = "policy"  # the model name the endpoint serves
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_DEPTH = 64  # JSON nesting a request may have (a tool's parameter schema nests a few levels per parameter)


class APIError(Exception):
    """An error answered as an OpenAI-style body with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code=code)


@dataclass
class Request:
    """A checked chat or completion request. messages: normalized (chat); prompt: text or ids (completion);
    tools: function schemas in the chat template's form; stop: stop strings."""

    n: int = 1
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    parse_tools: bool = True
    prompt: str | list[int] | None = None
    images: list[ImagePart] = field(default_factory=list)  # the messages' image parts, in order


@dataclass(frozen=True)
class ImagePart:
    """One `image_url` part of a request: `where` names it (`messages[1].content[0]`), `url` a data URI or file URL."""

    where: str
    url: str

    @property
    def digest(self) -> str:
        """What a message keeps of the image (the URL itself may be megabytes of base64)."""
        return hashlib.sha256(self.url.encode()).hexdigest()[:32]


def image_part(part: dict[str, Any], where: str) -> ImagePart:
    """The checked `image_url` part at `where`; APIError 400 for a missing or remote URL."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise _bad(where, "an image_url part needs image_url.url (a data: URI or a file:// URL)")
    if not url.startswith(("data:", "file://")):
        raise _bad(where, f"only data: URIs and file:// URLs are read (the run is offline: a remote image is never "
                          f"fetched); got {url[:40]!r}", "invalid_image_url")
    return ImagePart(where, url)


def decode_body(body: bytes) -> Any:
    """The request body as JSON, refused (400) when it is not JSON or nests deeper than `MAX_DEPTH` (the chat
    template and the tool schemas' renderings recurse into it)."""
    try:
        value = json.loads(body or b"null")
    except RecursionError:
        raise APIError(400, f"the body nests JSON deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:
        raise APIError(400, f"the body is not JSON: {e}") from None
    level, depth = [value], 0
    while level:
        depth += 1
        if depth > MAX_DEPTH:
            raise APIError(400, f"the body nests JSON deeper than {MAX_DEPTH} levels")
        level = [child for node in level if isinstance(node, (dict, list))
                 for child in (node.values() if isinstance(node, dict) else node)]
    return value


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _content(content: Any, where: str, image_mark: str | None, images: list[ImagePart]) -> str:
    """A message content as text: a string, None, or a list of text parts and (`image_mark` given: a vision-language
    model) `image_url` parts, each becoming `image_mark` in the text and an `ImagePart` appended to `images`."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "must be a string or a list of {type: text, text} parts (and image_url parts for a "
                          "vision-language model)")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            texts.append(str(part.get("text", "")))
        elif kind == "image_url":
            if image_mark is None:
                raise _bad(f"{where}[{k}]", "this model takes no images (a text model, or a Qwen3.5 checkpoint's "
                                            "language model: agent.images=true makes it the vision-language "
                                            "model): send text parts only", "unsupported_value")
            images.append(image_part(part, f"{where}[{k}]"))
            texts.append(image_mark)
        else:
            raise _bad(f"{where}[{k}]", "must be a {type: text, text} part" + (
                " or a {type: image_url, image_url: {url}} part" if image_mark is not None else ""))
    return "".join(texts)


def _arguments(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            raise _bad(where, f"is not a JSON object: {value[:80]!r}") from None
    if not isinstance(value, dict):
        raise _bad(where, "must be a JSON object")
    return value


def normalize_messages(messages: Any, image_mark: str | None = None,
                       images: list[ImagePart] | None = None) -> list[dict[str, Any]]:
    """Chat messages as the chat template and the stitching compare them: text contents, tool calls as
    `{type: function, function: {name, arguments: dict}}` (arguments parsed from their JSON string). With
    `image_mark` (a vision-language model), image parts become that mark in the content, their `ImagePart`s are
    appended to `images` and their digests kept under the message's `images`."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty list of messages")
    images = [] if images is None else images
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise _bad(where, f"must be a mapping with a role in {list(ROLES)}")
        before = len(images)
        message: dict[str, Any] = {"role": m["role"],
                                   "content": _content(m.get("content"), f"{where}.content", image_mark, images)}
        if len(images) > before:
            if m["role"] == "assistant":  # compared with what the endpoint returned, which is text
                raise _bad(f"{where}.content", "an assistant message holds text only, not images")
            message["images"] = [part.digest for part in images[before:]]
        for key in ("name", "tool_call_id", "reasoning_content"):
            if isinstance(m.get(key), str):
                message[key] = m[key]
        calls = m.get("tool_calls")
        if calls:
            if m["role"] != "assistant" or not isinstance(calls, list):
                raise _bad(f"{where}.tool_calls", "must be a list, on an assistant message")
            message["tool_calls"] = []
            for k, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise _bad(f"{where}.tool_calls[{k}]", "must be {type: function, function: {name, arguments}}")
                message["tool_calls"].append({"type": "function", "function": {
                    "name": fn["name"], "arguments": _arguments(fn.get("arguments", {}),
                                                                f"{where}.tool_calls[{k}].function.arguments")}})
        out.append(message)
    return out


def same_message(sent: dict[str, Any], returned: dict[str, Any]) -> bool:
    """Whether a client's assistant message is the one the endpoint returned (content up to surrounding
    whitespace, the same tool calls; tool call ids do not matter)."""
    return (sent["role"] == "assistant" and sent["content"].strip() == returned["content"].strip()
            and sent.get("tool_calls", []) == returned.get("tool_calls", []))


def _check_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise _bad("tools", "must be a list of {type: function, function: {name, description, parameters}}")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function" or not isinstance(fn.get("name"),
                                                                                                  str):
            raise _bad(f"tools[{i}]", "must be {type: function, function: {name, description, parameters}}")
    return [{"type": "function", "function": t["function"]} for t in tools]


def _check_sampling(body: dict[str, Any], temperature: float, top_p: float) -> None:
    for key, value in (("temperature", temperature), ("top_p", top_p)):
        given = body.get(key)
        if given is not None and (not _number(given) or not math.isclose(given, value, abs_tol=1e-6)):
            raise _bad(key, f"this rollout phase samples with {key}={value:g} (rollout.{key}, or rollout.val_"
                            f"{key} when validating): leave it out or pass {value:g}", "unsupported_value")
    fixed: dict[str, Any] = {"stream": False, "seed": None, "presence_penalty": 0, "frequency_penalty": 0,
                             "logit_bias": {}, "echo": False, "suffix": None, "best_of": 1}
    for key, default in fixed.items():
        if body.get(key) not in (None, default):
            raise _bad(key, f"is not supported by this endpoint (leave it out or pass {default!r})",
                       "unsupported_parameter")
    fmt = body.get("response_format")
    if fmt not in (None, {}) and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise _bad("response_format", "only text responses are served", "unsupported_parameter")
    if body.get("top_logprobs") not in (None, 0):
        raise _bad("top_logprobs", "the engine returns the sampled token's log-prob only: top_logprobs must be 0",
                   "unsupported_value")


def parse_request(body: Any, chat: bool, temperature: float, top_p: float, max_n: int,
                  image_mark: str | None = None) -> Request:
    """A checked `Request` from a chat or completion request body; `APIError` naming the parameter else. max_n:
    the most samples a request may ask for; image_mark: a vision-language model's (`normalize_messages`), None for
    a text model."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model != MODEL_NAME:
        raise APIError(404, f"the model {model!r} does not exist; this endpoint serves {MODEL_NAME!r}",
                       param="model", code="model_not_found")
    _check_sampling(body, temperature, top_p)
    n = body.get("n")
    n = 1 if n is None else n
    if not _count(n) or n < 1:
        raise _bad("n", f"must be an integer >= 1, got {n!r}")
    if n > max_n:
        raise _bad("n", f"this engine serves n <= {max_n} (an eighth of its KV slots: a request waits until n slots "
                        f"are free, and every new trajectory behind it waits too), got {n}")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not _count(max_tokens) or max_tokens < 1):
        raise _bad("max_tokens", f"must be an integer >= 1, got {max_tokens!r}")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise _bad("stop", "must be a string or a list of up to 4 non-empty strings")
    request = Request(n=n, max_tokens=max_tokens, stop=stop)
    if chat:
        request.logprobs = bool(body.get("logprobs"))
        request.messages = normalize_messages(body.get("messages"), image_mark, request.images)
        request.tools = _check_tools(body.get("tools"))
        choice = body.get("tool_choice")
        if choice not in (None, "auto", "none"):
            raise _bad("tool_choice", "only 'auto' and 'none' are served (the model is never forced to call a tool)",
                       "unsupported_value")
        request.parse_tools = bool(request.tools) and choice != "none"
    else:
        request.logprobs = body.get("logprobs") not in (None, 0, False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if not (isinstance(prompt, str) and prompt) and not (
                isinstance(prompt, list) and prompt and all(_count(t) and t >= 0 for t in prompt)):
            raise _bad("prompt", "must be one non-empty string or one list of token ids")
        request.prompt = prompt
    return request


def _logprobs(tokenizer: Any, ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
    out = []
    for token, logprob in zip(ids, logprobs):
        text = tokenizer.decode([token], skip_special_tokens=False)
        out.append({"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []})
    return out


@dataclass
class Choice:
    """One sampled answer: its ids and log-probs as recorded, the message (or text) returned."""

    ids: list[int]
    logprobs: list[float]
    finish_reason: str
    message: dict[str, Any] | None = None
    text: str = ""

    def completion(self) -> Completion:
        """As the engine's turn (finish "length" or "stop"), for the trajectory."""
        from hybridflow.engine.rollout import Completion

        return Completion(self.ids, self.logprobs, "length" if self.finish_reason == "length" else "stop")


def response_body(tokenizer: Any, chat: bool, choices: list[Choice], prompt_tokens: int,
                  logprobs: bool) -> dict[str, Any]:
    """A `chat.completion` or `text_completion` object; each choice also carries `token_ids` (the ids the
    engine sampled, vLLM's extension)."""
    out = []
    for i, c in enumerate(choices):
        entry: dict[str, Any] = {"index": i, "finish_reason": c.finish_reason, "token_ids": c.ids}
        if chat:
            if c.message is None:
                raise ValueError(f"choice {i} of a chat completion has no message")
            message = {"role": "assistant", "content": c.message["content"] or None}
            if c.message.get("tool_calls"):
                message["tool_calls"] = [
                    {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                     "function": {"name": t["function"]["name"],
                                  "arguments": json.dumps(t["function"]["arguments"], ensure_ascii=False)}}
                    for t in c.message["tool_calls"]]
            entry["message"] = message
            entry["logprobs"] = {"content": _logprobs(tokenizer, c.ids, c.logprobs)} if logprobs else None
        else:
            entry["text"] = c.text
            entry["logprobs"] = None
            if logprobs:
                tokens = _logprobs(tokenizer, c.ids, c.logprobs)
                entry["logprobs"] = {"tokens": [t["token"] for t in tokens], "token_logprobs": list(c.logprobs),
                                     "top_logprobs": None, "text_offset": None}
        out.append(entry)
    completion_tokens = sum(len(c.ids) for c in choices)
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": MODEL_NAME, "choices": out,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def models_body() -> dict[str, Any]:
    return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "hybridflow"}]}

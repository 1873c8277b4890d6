"""Chat templates and tokenization: prompts for generation, conversations with an assistant-token mask.

A prompt is either a list of chat messages (`{"role": ..., "content": ...}`) or a plain string. With a
chat template on (and the tokenizer having one), a plain string becomes one user message; without,
it is tokenized as it is. With tools (a list of OpenAI-style function schemas), a chat prompt is
rendered with the template's own `tools=` support; a template without it gets the tool descriptions
in its system message instead, in the Hermes / Qwen2.5 wording that asks for `<tool_call>` blocks.
Conversations for SFT get a loss mask that is 1 exactly on the tokens of the assistant turns: each
turn's content and its end-of-turn token, not the role header before it.

Messages carry their contents as strings, and every rendering goes through `render_messages`. Some published
templates read a content only as a list of parts (`{"type": "text", "text": ...}`, `{"type": "image"}`: SmolVLM's,
Idefics3's) and render a string content as nothing. Which form a tokenizer's template reads is decided once per
tokenizer and template (`reads_parts`: a probe conversation rendered with a string content, then with text parts);
for a template that reads parts, each string content is passed as text parts, split at a vision-language model's
image mark (`image_mark`) into image parts, which the template writes as its own image text. A template that renders
neither form is refused, naming the tokenizer; one that raises on the probe in both forms (it demands a system message,
say) keeps strings, as before. A template that renders strings gets the messages as they are.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Sequence
from typing import Any

Messages = list[dict[str, Any]]

# a probe conversation's content: text no template writes of its own, so finding it means the content was rendered
_PROBE = "hybridflow-content-probe-5ac1"
# each tokenizer's (chat template, whether it reads parts): probed once, probed again when its template is replaced
_FORMS: weakref.WeakKeyDictionary[Any, tuple[Any, bool]] = weakref.WeakKeyDictionary()


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def reads_parts(tokenizer: Any) -> bool:
    """Whether `tokenizer`'s chat template reads message contents as lists of parts (see the module docstring): False
    when it renders a string content, True when only text parts render; ValueError naming the tokenizer when neither
    does."""
    template = getattr(tokenizer, "chat_template", None)
    known = _FORMS.get(tokenizer)
    if known is not None and known[0] == template:
        return known[1]
    tried, raised = [], 0
    for parts in (False, True):
        content: Any = [{"type": "text", "text": _PROBE}] if parts else _PROBE
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                 add_generation_prompt=True)
        except Exception as e:  # a template may fail on the content form it does not read (jinja's errors, TypeError)
            tried.append(f"{'text parts' if parts else 'a string'} raised {type(e).__name__}: {e}")
            raised += 1
            continue
        if _PROBE in text:
            _FORMS[tokenizer] = (template, parts)
            return parts
        tried.append(f"{'text parts' if parts else 'a string'} rendered {text!r:.200}")
    if raised == 2:
        # a template that refuses the probe conversation itself (one that demands a system message, say): strings,
        # as before, so the real conversation gets the template's own error or renders
        _FORMS[tokenizer] = (template, False)
        return False
    name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    raise ValueError(f"{name}: its chat template renders a user message's content neither as a string nor as text "
                     f"parts ([{{'type': 'text', 'text': ...}}]); tried a content {_PROBE!r}: {'; '.join(tried)}")


def _as_parts(text: str, image_mark: str | None) -> list[dict[str, str]]:
    """A string content as parts: text, with an image part at each `image_mark`; empty text is left out (a template
    may read the first part's type: SmolVLM's writes `User:` before an image, `User: ` before text)."""
    pieces = text.split(image_mark) if image_mark else [text]
    parts = []
    for i, piece in enumerate(pieces):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts or [{"type": "text", "text": ""}]


def render_messages(messages: Messages, tokenizer: Any, image_mark: str | None = None, **template_args: Any) -> str:
    """`tokenizer.apply_chat_template(messages, tokenize=False, **template_args)` in the content form its template
    reads (`reads_parts`): string contents as they are, or as text parts split into image parts at `image_mark` (a
    vision-language model's image mark in the text; None: no images). Other contents (a tool call's None, parts
    already) and every other key of a message are passed as they are."""
    if reads_parts(tokenizer):
        messages = [{**m, "content": _as_parts(m["content"], image_mark)} if isinstance(m.get("content"), str) else m
                    for m in messages]
    return tokenizer.apply_chat_template(messages, tokenize=False, **template_args)


def pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's pad id (its eos id when it has none)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = pad if pad is not None else getattr(tokenizer, "eos_token_id", None)
    if pad is None:
        raise ValueError("the tokenizer has neither a pad token nor an eos token to pad with")
    return pad


def check_messages(messages: Any) -> str | None:
    """`None` when `messages` is a non-empty list of `{role: str, content: str}`; else what is wrong."""
    if not isinstance(messages, (list, tuple)) or not messages:
        return "a non-empty list of messages"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"message {i} to be a {{role: str, content: str}} mapping"
    if not any(m["content"].strip() for m in messages):
        return "at least one message with non-empty content"
    return None


def as_messages(prompt: str | Messages, tokenizer: Any, apply_chat_template: bool) -> Messages | None:
    """The messages a prompt is rendered from, or `None` when it is used as plain text."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}] if apply_chat_template and has_chat_template(tokenizer) else None
    if not apply_chat_template:
        raise ValueError("a prompt given as chat messages needs data.apply_chat_template=true")
    if not has_chat_template(tokenizer):
        raise ValueError("prompts are chat messages but the tokenizer has no chat template; give plain-string "
                         "prompts or use a tokenizer with a chat template")
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


TOOLS_SYSTEM_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function "
    "call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


def with_tools(messages: Messages, tokenizer: Any, tools: list[dict] | None) -> tuple[Messages, dict[str, Any]]:
    """(messages, extra `apply_chat_template` arguments) that show `tools` to the model: `tools=` when the
    template renders it, else the tool descriptions added to the system message (see the module docstring)."""
    if not tools:
        return messages, {}
    plain = render_messages(messages, tokenizer, add_generation_prompt=True)
    if render_messages(messages, tokenizer, add_generation_prompt=True, tools=tools) != plain:
        return messages, {"tools": tools}
    text = TOOLS_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]], {}
    return [{"role": "system", "content": text}, *messages], {}


def render_prompt(prompt: str | Messages, tokenizer: Any, apply_chat_template: bool = True,
                  tools: list[dict] | None = None, image_mark: str | None = None) -> str:
    """The text the model sees before its response (the generation prompt included), showing `tools`; `image_mark`:
    the text standing for an image in the prompt's contents (`render_messages`)."""
    messages = as_messages(prompt, tokenizer, apply_chat_template)
    if messages is None:
        if tools:
            raise ValueError("tools need chat prompts: data.apply_chat_template=true and a tokenizer with a "
                             "chat template")
        return prompt  # type: ignore[return-value]
    messages, extra = with_tools(messages, tokenizer, tools)
    return render_messages(messages, tokenizer, image_mark, add_generation_prompt=True, **extra)


def encode_prompts(prompts: Sequence[str | Messages], tokenizer: Any, apply_chat_template: bool = True,
                   tools: list[dict] | None = None) -> list[list[int]]:
    """Token ids of each rendered prompt (one batched tokenizer call per kind of prompt).

    Templated text carries its own special tokens; plain text gets the tokenizer's usual ones (BOS).
    """
    texts = [render_prompt(p, tokenizer, apply_chat_template, tools) for p in prompts]
    templated = [as_messages(p, tokenizer, apply_chat_template) is not None for p in prompts]
    out: list[list[int] | None] = [None] * len(texts)
    for flag in (True, False):
        idx = [i for i, t in enumerate(templated) if t == flag]
        if idx:
            ids = tokenizer([texts[i] for i in idx], add_special_tokens=not flag)["input_ids"]
            for i, row in zip(idx, ids):
                out[i] = list(row)
    return out  # type: ignore[return-value]


def render_scored_text(prompt: str | Messages, completion: str | Messages, tokenizer: Any) -> str:
    """The text a reward model scores (`hybridflow.rewards.model_reward.ModelReward`): a message prompt and its
    completion (a string becomes an assistant message) through the chat template; a string prompt and
    string completion concatenated as they are."""
    if isinstance(prompt, str):
        if not isinstance(completion, str):
            raise ValueError("a plain-string prompt needs a plain-string completion")
        return prompt + completion
    if not has_chat_template(tokenizer):
        raise ValueError("chat-message prompts need a tokenizer with a chat template")
    turns = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else list(completion)
    return render_messages([*prompt, *turns], tokenizer)


def assistant_char_spans(messages: Messages, tokenizer: Any) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the `[start, end)` character span of each assistant turn.

    A turn's span starts after its role header (where the generation prompt ends) and ends after its
    end-of-turn text, trailing whitespace excluded. Needs a template whose rendering of the first k
    messages is a prefix of the whole conversation (true of ChatML, Llama 3, Mistral templates).
    """
    full = render_messages(messages, tokenizer)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render_messages(messages[:i], tokenizer, add_generation_prompt=True)
        upto = render_messages(messages[: i + 1], tokenizer)
        if not (full.startswith(upto) and upto.startswith(before)):
            raise ValueError("the chat template does not render conversations prefix by prefix, so assistant "
                             f"tokens cannot be located (turn {i})")
        spans.append((len(before), len(upto.rstrip())))
    return full, spans


def encode_conversation(messages: Messages, tokenizer: Any) -> tuple[list[int], list[int]]:
    """`(input_ids, loss_mask)`: token ids of the templated conversation, 1 on assistant tokens.

    A token belongs to an assistant turn when its first character lies inside the turn's span.
    """
    text, spans = assistant_char_spans(messages, tokenizer)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s <= start < e for s, e in spans)) for start, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask

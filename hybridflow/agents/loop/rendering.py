"""The token ids appended to a live sequence for environment and tool messages, from the chat template.

A model turn ends with the end-of-turn token it sampled (or at its token limit). What the template puts
after it is found once per tokenizer by rendering a reference conversation that ends in an assistant
message: its `tail` (the text after that message's content, e.g. ChatML's `<|im_end|>\\n`). The ids for
new messages are then: the part of the tail the model did not write (ChatML: the `\\n` after the
`<|im_end|>` it sampled; all of it when the turn was cut), followed by what rendering the reference
conversation plus the messages, with the next assistant turn's generation prompt, adds to it. They are
tokenized once and appended as they are: the trainer sees exactly the ids the engine saw.

The template's own text is tokenized with its special tokens; the messages' contents are tokenized as
plain text (`split_special_tokens`), so an environment or tool that writes `<|im_end|>` or
`<|im_start|>assistant` cannot forge a turn. The contents are found by rendering the messages once more
with placeholders; a template that changes contents beyond trimming them cannot be split that way and
is tokenized whole (a warning says so, once). Given the token room left (`limit`), a content is cut to
what could still fit before it is rendered or tokenized (no token spans more characters than the
longest vocabulary entry), so a huge message costs no more than a fitting one: its ids then exceed
`limit` and the caller ends the episode.

A vision-language model's messages hold an image mark in their content where each image goes (the endpoint's
`image_url` parts): given the images' vision token ids (`ImageSlots`), each mark is replaced by the next image's
ids, so the appended ids carry the images as the prompt's do. Plain text the processor puts around an image
(Gemma 3's blank lines, `margins`) is encoded with the text beside it, as tokenizing the whole text would: a special
token ends the text before it, plain text does not (a tokenizer may merge a content's trailing newline with them).
Every rendering goes through `chat.render_messages`, so a template that reads contents as lists of parts (SmolVLM's)
gets them so, each mark an image part.

Each environment turn is on the engine's thread, so it is kept cheap: the placeholder rendering is kept per
message shape, and the pieces are encoded by a fast tokenizer's Rust backend directly wherever that gives the
wrapper's ids (`Encoder`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from hybridflow.data.chat import reads_parts, render_messages, with_tools

logger = logging.getLogger(__name__)

_MARK = "HYBRIDFLOW-TURN-MARK"
_SLOT = "HYBRIDFLOW-CONTENT-{}-SLOT"
_SKELETONS = 64  # placeholder renderings kept per renderer


@dataclass
class ImageSlots:
    """The images of new messages: each `mark` in their text stands for the next image, whose vision token ids are
    the next of `ids`, with the plain text `margins` (before, after) around them."""

    mark: str
    ids: list[list[int]]
    margins: tuple[str, str] = ("", "")


class TurnRenderer:
    """Renders environment / tool messages as ids to append after a model turn (see the module docstring).

    tools: the function schemas the prompts show (rendered the same way here, so templates that format
    tool messages differently when tools are declared stay consistent).
    """

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None) -> None:
        self.tokenizer = tokenizer
        # a reasoning block in the reference turn: templates that drop an earlier turn's reasoning unless it
        # has one (Qwen3) then render it the same whether or not it is the last message
        base = [{"role": "user", "content": "Hello."},
                {"role": "assistant", "content": f"<think>\n{_MARK}\n</think>\n\n{_MARK}"}]
        self.base, self.template_args = with_tools(base, tokenizer, tools)
        self.before = render_messages(self.base, tokenizer, **self.template_args)
        if _MARK not in self.before:
            raise ValueError("the chat template drops the content of earlier assistant messages, so turns cannot "
                             "be appended to a conversation; use a model whose template keeps them")
        self.tail = self.before[self.before.rindex(_MARK) + len(_MARK):]
        self.max_token_chars = max(len(token) for token in tokenizer.get_vocab())
        self.skeletons: dict[str, str] = {}
        self.encoder = Encoder(tokenizer, [self.before, f" {self.before}\n\n{self.tail}x"])
        self.warned = False

    def _after(self, messages: list[dict[str, str]], image_mark: str | None = None) -> str:
        """What the template adds after the reference conversation for `messages` and the generation prompt
        (`image_mark`: the images' mark in their contents, `render_messages`)."""
        after = render_messages(self.base + messages, self.tokenizer, image_mark, add_generation_prompt=True,
                                **self.template_args)
        if not after.startswith(self.before):
            roles = [m["role"] for m in messages]
            raise ValueError(f"the chat template does not render a conversation prefix by prefix when messages "
                             f"with roles {roles} follow an assistant turn; check the roles the environment sends")
        return after[len(self.before):]

    def _encode(self, text: str, plain: bool = False) -> list[int]:
        return self.encoder(text, plain) if text else []

    def _skeleton(self, messages: list[dict[str, str]], leads: list[str], image_mark: str | None) -> str:
        """`_after` of `messages` with each content replaced by its lead (`_pieces`) and a numbered placeholder, kept
        for the last `_SKELETONS` kinds of message list (an episode's turns repeat a few: one render per turn
        fewer)."""
        slots = [{**m, "content": lead + _SLOT.format(i)} for i, (m, lead) in enumerate(zip(messages, leads))]
        key = json.dumps(slots, sort_keys=True, default=repr)
        skeleton = self.skeletons.pop(key, None)
        if skeleton is None:
            skeleton = self._after(slots, image_mark)
            if len(self.skeletons) >= _SKELETONS:
                del self.skeletons[next(iter(self.skeletons))]
        self.skeletons[key] = skeleton  # most recently used last
        return skeleton

    def _pieces(self, messages: list[dict[str, str]], after: str,
                image_mark: str | None = None) -> list[tuple[str, bool]] | None:
        """`after` as (text, is_content) pieces, or None when the contents cannot be told from the template
        (checked against `after`, the real rendering, every time: a template may treat contents by value)."""
        # a template that reads contents as parts may write a message's header by its first part's type (SmolVLM:
        # `User:` before an image, `User: ` before text), so a content's leading image mark stays in the placeholder
        # rendering (its lead, a piece of the template's text), the content after it being the placeholder's
        mark = image_mark if image_mark is not None and reads_parts(self.tokenizer) else None
        leads = [mark if mark and m["content"].startswith(mark) else "" for m in messages]
        skeleton = self._skeleton(messages, leads, image_mark)
        for transform in (lambda text: text, str.strip):
            pieces, rest = [], skeleton
            for i, (message, lead) in enumerate(zip(messages, leads)):
                head, found, rest = rest.partition(_SLOT.format(i))
                if not found:
                    break
                pieces += [(head, False), (transform(message["content"][len(lead):]), True)]
            else:
                pieces.append((rest, False))
                if "".join(text for text, _ in pieces) == after:
                    return pieces
        return None

    def render(self, messages: list[dict[str, str]], last_token: int | None, limit: int | None = None,
               images: ImageSlots | None = None) -> list[int]:
        """Ids to append after a model turn for `messages` ({role, content}) and the next generation prompt.

        last_token: the stop token that ended the model turn, or None when the turn was cut at its limit
        (then the template's whole end-of-turn text is added first). limit: the tokens the trajectory can
        still take (None: no limit); longer contents are cut first, and the ids then exceed it. images: the
        vision token ids of the images the messages' marks stand for (ValueError when they hold more marks).
        """
        if limit is not None:
            cap = (limit + 1) * self.max_token_chars
            messages = [{**m, "content": m["content"][:cap]} for m in messages]
        lead = self.closing(last_token)
        mark = images.mark if images is not None else None
        after = self._after(messages, mark)
        pieces = self._pieces(messages, after, mark)
        slots = iter(images.ids if images is not None else [])
        if pieces is None:
            if not self.warned:
                logger.warning("the chat template changes message contents beyond trimming them; environment and "
                               "tool messages are tokenized with the template, special-token text included")
                self.warned = True
            return self._marked(lead + after, False, images, slots)
        ids = self._marked(lead + pieces[0][0], False, images, slots)  # a lead mark (`_pieces`) is in a head
        for text, is_content in pieces[1:]:
            ids += self._marked(text, is_content, images, slots)
        return ids

    def _marked(self, text: str, plain: bool, images: ImageSlots | None, slots: Any) -> list[int]:
        """`_encode(text, plain)` with each image mark replaced by the next image's ids from `slots`, its margins
        encoded with the text beside it."""
        if images is None or images.mark not in text:
            return self._encode(text, plain)
        pieces = text.split(images.mark)
        before, after = images.margins
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            if k:
                image = next(slots, None)
                if image is None:
                    raise ValueError("the messages hold more image marks than images")
                ids += image
            ids += self._encode((after if k else "") + piece + (before if k < len(pieces) - 1 else ""), plain)
        return ids

    def closing(self, last_token: int | None) -> str:
        """The part of the template's end-of-turn text (`tail`) the model did not write: after a turn that
        ended on `last_token`, what follows it (ChatML: `\\n`); after a cut turn (None), all of it."""
        ended = self.tokenizer.decode([last_token]) if last_token is not None else ""
        return self.tail[len(ended):] if ended and self.tail.startswith(ended) else self.tail


class Encoder:
    """`tokenizer(text, add_special_tokens=False, split_special_tokens=plain)["input_ids"]` (`plain`: special-token
    text encoded as text). A fast tokenizer's Rust backend is called directly where it gives the same ids on
    `probes`, both ways (a tokenizer class that adds its own steps does not): the Python wrapper costs ~0.1 ms a
    call, three times per environment turn. A backend left truncating or padding by other code uses the
    wrapper, which resets those."""

    def __init__(self, tokenizer: Any, probes: list[str]) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and any(self._direct(backend, text, plain) != self._wrapped(text, plain)
                                       for text in probes for plain in (False, True)):
            backend = None
        self.backend = backend

    def __call__(self, text: str, plain: bool) -> list[int]:
        backend = self.backend
        if backend is None or backend.truncation is not None or backend.padding is not None:
            return self._wrapped(text, plain)
        return self._direct(backend, text, plain)

    def _wrapped(self, text: str, plain: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=plain)["input_ids"])

    @staticmethod
    def _direct(backend: Any, text: str, plain: bool) -> list[int]:
        before = backend.encode_special_tokens
        backend.encode_special_tokens = plain
        try:
            return list(backend.encode(text, add_special_tokens=False).ids)
        finally:
            backend.encode_special_tokens = before

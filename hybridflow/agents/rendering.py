"""The token ids appended to a live sequence for environment and tool messages, from the chat template.

A model turn ends with the end-of-turn token it sampled (or at its token limit). What the template puts
after it is found once per tokenizer by rendering a reference conversation that ends in an assistant
message: its `tail` (the text after that message's content, e.g. ChatML's `<|im_end|>\\n`). The ids for
new messages are then: the part of the tail the model did not write (ChatML: the `\\n` after the
`<|im_end|>` it sampled; all of it when the turn was cut), followed by what rendering the reference
conversation plus the messages, with the next assistant turn's generation prompt, adds to it. They are
tokenized once and appended as they are: the trainer sees exactly the ids the engine saw.
"""

from __future__ import annotations

from typing import Any

from hybridflow.data.chat import with_tools

_MARK = "HYBRIDFLOW-TURN-MARK"


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
        self.before = tokenizer.apply_chat_template(self.base, tokenize=False, **self.template_args)
        if _MARK not in self.before:
            raise ValueError("the chat template drops the content of earlier assistant messages, so turns cannot "
                             "be appended to a conversation; use a model whose template keeps them")
        self.tail = self.before[self.before.rindex(_MARK) + len(_MARK):]

    def render(self, messages: list[dict[str, str]], last_token: int | None) -> list[int]:
        """Ids to append after a model turn for `messages` ({role, content}) and the next generation prompt.

        last_token: the stop token that ended the model turn, or None when the turn was cut at its limit
        (then the template's whole end-of-turn text is added first).
        """
        after = self.tokenizer.apply_chat_template(self.base + messages, tokenize=False,
                                                   add_generation_prompt=True, **self.template_args)
        if not after.startswith(self.before):
            roles = [m["role"] for m in messages]
            raise ValueError(f"the chat template does not render a conversation prefix by prefix when messages "
                             f"with roles {roles} follow an assistant turn; check the roles the environment sends")
        text = self.closing(last_token) + after[len(self.before):]
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def closing(self, last_token: int | None) -> str:
        """The part of the template's end-of-turn text (`tail`) the model did not write: after a turn that
        ended on `last_token`, what follows it (ChatML: `\\n`); after a cut turn (None), all of it."""
        ended = self.tokenizer.decode([last_token]) if last_token is not None else ""
        return self.tail[len(ended):] if ended and self.tail.startswith(ended) else self.tail

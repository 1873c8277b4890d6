"""Chat templates that read message contents only as lists of parts (SmolVLM's and Idefics3's as published): a GRPO
prompt, an SFT conversation and a preference pair render with their text, as the parts form renders them; a template
that renders strings keeps the string path (the same ids, probed once per tokenizer); one that renders neither form
is refused, naming the tokenizer; one that refuses the probe conversation itself keeps strings."""

from __future__ import annotations

import functools

import pytest
from parts_templates import SMOLVLM
from transformers import AutoTokenizer

from hybridflow.data import DataError, RLDataset
from hybridflow.data.chat import render_messages
from hybridflow.data.preference_data import PreferenceDataset, encode_policy_pair
from hybridflow.data.sft_data import SFTDataset

PROMPT = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "What is 3 + 4?"}]
# PROMPT as SmolVLM's template reads it
PROMPT_PARTS = [{"role": "system", "content": [{"type": "text", "text": "Answer in one word."}]},
                {"role": "user", "content": [{"type": "text", "text": "What is 3 + 4?"}]}]


@pytest.fixture
def tokenizer(tiny_qwen2):
    """The tiny text model's tokenizer, loaded afresh (each test sets its own template)."""
    return AutoTokenizer.from_pretrained(tiny_qwen2)


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def counting_renders(tokenizer) -> list:
    """The conversations `tokenizer.apply_chat_template` is given from now on, recorded."""
    calls, render = [], tokenizer.apply_chat_template
    tokenizer.apply_chat_template = lambda conversation, *a, **k: calls.append(conversation) or render(
        conversation, *a, **k)
    return calls


def test_a_grpo_prompt_renders_its_text_through_a_parts_template(tokenizer, write_jsonl):
    tokenizer.chat_template = SMOLVLM
    parts_text = tokenizer.apply_chat_template(PROMPT_PARTS, tokenize=False, add_generation_prompt=True)
    assert "What is 3 + 4?" in parts_text
    assert "3 + 4" not in tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    ds = RLDataset(write_jsonl([{"prompt": PROMPT, "ground_truth": "7"}, {"prompt": "What is 3 + 4?"}]), tokenizer)
    assert ds[0]["input_ids"].tolist() == ids_of(tokenizer, parts_text)
    assert ds[1]["input_ids"].tolist() == ids_of(tokenizer, "<|im_start|>User: What is 3 + 4?<end_of_utterance>\n"
                                                            "Assistant:")


def test_sft_and_preference_rows_render_their_text_through_a_parts_template(tokenizer, write_jsonl):
    tokenizer.chat_template = SMOLVLM
    answer = {"role": "assistant", "content": "Seven."}
    sft = SFTDataset(write_jsonl([{"messages": [*PROMPT, answer]}]), tokenizer)[0]
    whole = tokenizer.apply_chat_template([*PROMPT_PARTS, {"role": "assistant", "content": [
        {"type": "text", "text": "Seven."}]}], tokenize=False)
    assert sft["input_ids"] == ids_of(tokenizer, whole)
    learnt = tokenizer.decode([t for t, m in zip(sft["input_ids"], sft["loss_mask"]) if m])
    assert learnt == " Seven.<end_of_utterance>"  # the assistant turn after its `Assistant:` header

    encode = functools.partial(encode_policy_pair, tokenizer=tokenizer)
    pair = {"prompt": PROMPT, "chosen": [answer], "rejected": [{"role": "assistant", "content": "Eight."}]}
    item = PreferenceDataset(write_jsonl([pair], "pairs.jsonl"), tokenizer, encode)[0]
    prompt_text = tokenizer.apply_chat_template(PROMPT_PARTS, tokenize=False, add_generation_prompt=True)
    assert item["prompt_ids"] == ids_of(tokenizer, prompt_text)
    assert item["prompt_ids"] + item["chosen_ids"] == ids_of(tokenizer, whole)


def test_a_template_that_renders_strings_keeps_them_probed_once(tokenizer, write_jsonl):
    calls = counting_renders(tokenizer)
    rows = [{"prompt": PROMPT}, {"prompt": "What is 5 + 1?"}]
    for _ in range(2):
        ds = RLDataset(write_jsonl(rows), tokenizer)
        expected = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
        assert ds[0]["input_ids"].tolist() == ids_of(tokenizer, expected)
    # one probe (its string content rendered), then each row's rendering, twice, and the expected text's
    assert sum("content-probe" in str(c) for c in calls) == 1 and len(calls) == 1 + 2 * (2 + 1)
    assert all(isinstance(m["content"], str) for c in calls for m in c)
    tokenizer.chat_template = SMOLVLM  # a template replaced is probed again
    assert "What is 5 + 1?" in render_messages([{"role": "user", "content": "What is 5 + 1?"}], tokenizer)


def test_a_template_that_renders_neither_form_is_refused_naming_it(tokenizer, tiny_qwen2, write_jsonl):
    tokenizer.chat_template = "{% for message in messages %}{{ message['role'] }}: {{ message['text'] }}\n{% endfor %}"
    with pytest.raises(DataError, match=rf"{tiny_qwen2}: its chat template renders a user message's content neither "
                                        r"as a string nor as text parts .* a string rendered 'user: \\n'; text parts "
                                        r"rendered 'user: \\n'"):
        RLDataset(write_jsonl([{"prompt": PROMPT}]), tokenizer)


def test_a_template_that_refuses_the_probe_keeps_strings(tokenizer):
    """A template that raises on the probe's lone user message in both forms (one that demands a system message) keeps
    the string path, as before: a conversation it accepts renders, one it refuses gets the template's own error."""
    from hybridflow.data.chat import reads_parts

    tokenizer.chat_template = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message first') }}"
                               "{% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    assert reads_parts(tokenizer) is False
    assert render_messages(PROMPT, tokenizer) == "system: Answer in one word.\nuser: What is 3 + 4?\n"
    with pytest.raises(Exception, match="a system message first"):
        render_messages(PROMPT[1:], tokenizer)

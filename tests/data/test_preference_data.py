"""PreferenceDataset: TRL's two formats tokenized as a policy and a reward model see them, the engine's row
layout of a batch of pairs, and errors that name the file, row and column."""

from __future__ import annotations

import functools

import pytest
import torch

from hybridflow.data import DataError
from hybridflow.data.chat import render_scored_text
from hybridflow.data.preference_data import (PreferenceDataset, collate_policy_pairs, collate_scored_pairs,
                                        encode_policy_pair, encode_scored_pair, policy_rows, scored_rows)

PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
CONVERSATIONAL = {"prompt": PROMPT, "chosen": [{"role": "assistant", "content": "Hi!"}],
                  "rejected": [{"role": "assistant", "content": "Go away, I am busy."}]}
PLAIN = {"prompt": "2+2=", "chosen": "4", "rejected": "five"}


def policy_dataset(path, tokenizer, apply_chat_template=True, **kwargs):
    encode = functools.partial(encode_policy_pair, tokenizer=tokenizer, apply_chat_template=apply_chat_template)
    return PreferenceDataset(path, tokenizer, encode, **kwargs)


def test_conversational_pair_is_the_chat_template_with_the_loss_on_the_completion(write_jsonl, tokenizer):
    item = policy_dataset(write_jsonl([CONVERSATIONAL]), tokenizer)[0]
    prompt_text = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert item["prompt_ids"] == tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    for side, text in (("chosen", "Hi!"), ("rejected", "Go away, I am busy.")):
        ids, mask = item[f"{side}_ids"], item[f"{side}_mask"]
        full = tokenizer.apply_chat_template(PROMPT + CONVERSATIONAL[side], tokenize=False)
        assert item["prompt_ids"] + ids == tokenizer(full, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == text + tokenizer.eos_token


def test_plain_pair_with_and_without_the_chat_template(write_jsonl, tokenizer):
    path = write_jsonl([PLAIN])
    templated = policy_dataset(path, tokenizer)[0]
    as_chat = {"prompt": [{"role": "user", "content": "2+2="}], "chosen": [{"role": "assistant", "content": "4"}],
               "rejected": [{"role": "assistant", "content": "five"}]}
    assert templated == {**policy_dataset(write_jsonl([as_chat], "chat.jsonl"), tokenizer)[0], "index": 0}
    raw = policy_dataset(path, tokenizer, apply_chat_template=False)[0]
    assert raw["prompt_ids"] == tokenizer("2+2=")["input_ids"]
    assert raw["rejected_ids"] == tokenizer("five", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert all(raw["chosen_mask"]) and all(raw["rejected_mask"])


def test_scored_pair_is_the_text_the_reward_model_scores(write_jsonl, tokenizer):
    encode = functools.partial(encode_scored_pair, tokenizer=tokenizer)
    for row in (CONVERSATIONAL, PLAIN):
        item = PreferenceDataset(write_jsonl([row]), tokenizer, encode)[0]
        for side in ("chosen", "rejected"):
            text = render_scored_text(row["prompt"], row[side], tokenizer)
            assert item[f"{side}_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert render_scored_text("2+2=", "4", tokenizer) == "2+2=4"  # as ModelReward scores a plain prompt


def test_policy_rows_interleave_the_sides_after_the_shared_prompt(write_jsonl, tokenizer):
    ds = policy_dataset(write_jsonl([CONVERSATIONAL, PLAIN]), tokenizer)
    batch = collate_policy_pairs([ds[0], ds[1]], tokenizer.pad_token_id)
    assert len(batch) == 2 and list(batch["index"]) == [0, 1]
    batch["ref_chosen_logps"], batch["ref_rejected_logps"] = torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -4.0])
    rows = policy_rows(batch.tensors, tokenizer.pad_token_id)
    assert rows["ref_logps"].tolist() == [-1.0, -3.0, -2.0, -4.0]
    width = rows["response_mask"].shape[1]
    prompt_width = rows["input_ids"].shape[1] - width
    for r, (i, side) in enumerate([(0, "chosen"), (0, "rejected"), (1, "chosen"), (1, "rejected")]):
        real = rows["attention_mask"][r].bool()
        assert rows["input_ids"][r][real].tolist() == ds[i]["prompt_ids"] + ds[i][f"{side}_ids"]
        targets = rows["input_ids"][r, prompt_width:][rows["response_mask"][r].bool()]
        assert targets.tolist() == [t for t, m in zip(ds[i][f"{side}_ids"], ds[i][f"{side}_mask"]) if m]
        assert rows["position_ids"][r][real].tolist() == list(range(int(real.sum())))


def test_scored_rows_read_the_score_right_after_the_last_token(write_jsonl, tokenizer):
    ds = PreferenceDataset(write_jsonl([CONVERSATIONAL, PLAIN]), tokenizer,
                           functools.partial(encode_scored_pair, tokenizer=tokenizer))
    rows = scored_rows(collate_scored_pairs([ds[0], ds[1]], tokenizer.pad_token_id).tensors, tokenizer.pad_token_id)
    assert rows["response_mask"].tolist() == [[1.0]] * 4
    for r, (i, side) in enumerate([(0, "chosen"), (0, "rejected"), (1, "chosen"), (1, "rejected")]):
        real = rows["attention_mask"][r].bool()
        assert rows["input_ids"][r][real].tolist() == ds[i][f"{side}_ids"] + [tokenizer.pad_token_id]


def test_max_length_refuses_or_drops_long_pairs(write_jsonl, tokenizer):
    long = {**PLAIN, "rejected": "five " * 40}
    path = write_jsonl([PLAIN, long])
    with pytest.raises(DataError, match=r"data.jsonl, row 1 \(line 2\): \d+ tokens in its longer side, over "
                                        r"max_length=60"):
        policy_dataset(path, tokenizer, max_length=60)
    kept = policy_dataset(path, tokenizer, max_length=60, truncation="filter")
    assert len(kept) == 1 and kept.num_filtered == 1


def test_identical_pairs_are_counted_in_one_warning_naming_the_file(write_jsonl, tokenizer, caplog):
    same = {**CONVERSATIONAL, "rejected": CONVERSATIONAL["chosen"]}
    with caplog.at_level("WARNING", logger="hybridflow.data.preference_data"):
        some = policy_dataset(write_jsonl([PLAIN, same, same], "some.jsonl"), tokenizer)
        every = policy_dataset(write_jsonl([same, same], "every.jsonl"), tokenizer)
        policy_dataset(write_jsonl([PLAIN], "none.jsonl"), tokenizer)
    assert (some.num_identical, every.num_identical) == (2, 2)
    first, second = [r.getMessage() for r in caplog.records]
    assert "some.jsonl: 2 of 3 pairs have the chosen side identical to the rejected one (first: " in first \
        and "some.jsonl, row 1 (line 2)): they carry no preference" in first and "cannot learn" not in first
    assert "every.jsonl: all 2 pairs have the chosen side identical to the rejected one" in second \
        and "the run cannot learn from this data: check the chosen / rejected columns ('chosen', 'rejected')" \
        in second


@pytest.mark.parametrize("row,message", [
    ({"prompt": "hi", "chosen": "a"}, r"row 0 \(line 1\): missing column 'rejected' \(set data.rejected_key to the "
                                      r"column holding it; columns: prompt, chosen\)"),
    ({"prompt": PROMPT, "chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]},
     r"row 0 \(line 1\), column 'chosen': expected a non-empty list of messages continuing the prompt"),
    ({"prompt": "hi", "chosen": "a", "rejected": ""}, r"column 'rejected': expected a non-empty string"),
    ({"prompt": PROMPT, "chosen": [{"role": "user", "content": "b"}], "rejected": CONVERSATIONAL["rejected"]},
     r"column 'chosen': expected at least one assistant message"),
    ({"prompt": 3, "chosen": "a", "rejected": "b"}, r"column 'prompt': expected a non-empty string or"),
])
def test_bad_rows_name_the_file_row_and_column(write_jsonl, tokenizer, row, message):
    with pytest.raises(DataError, match=message):
        policy_dataset(write_jsonl([row]), tokenizer)


def test_columns_are_configurable_and_conversational_needs_the_template(write_jsonl, tokenizer):
    renamed = {"question": "2+2=", "good": "4", "bad": "five"}
    ds = policy_dataset(write_jsonl([renamed]), tokenizer, prompt_key="question", chosen_key="good", rejected_key="bad")
    assert len(ds) == 1
    with pytest.raises(DataError, match="row 0 .*conversational pairs need data.apply_chat_template=true"):
        policy_dataset(write_jsonl([CONVERSATIONAL]), tokenizer, apply_chat_template=False)

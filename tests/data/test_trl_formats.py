"""TRL's dataset formats (issue 55): SFT rows as `text`, as prompt/completion (standard and conversational)
and as `messages`; preference pairs with an explicit or an implicit prompt (the shared start of chosen and
rejected, as `trl.extract_prompt` takes it). A missing column names the key that maps it."""

from __future__ import annotations

import pytest

from hybridflow.data import DataError, SFTDataset
from hybridflow.data.files import Record
from hybridflow.data.preference_data import PreferenceDataset, encode_policy_pair, parse_pair, shared_prompt


def learnt(ds, tokenizer, i=0):
    return tokenizer.decode([t for t, m in zip(ds[i]["input_ids"], ds[i]["loss_mask"]) if m])


def test_text_rows_are_learnt_whole_followed_by_eos(write_jsonl, tokenizer):
    ds = SFTDataset(write_jsonl([{"text": "The sky is blue."}]), tokenizer)
    expected = tokenizer("The sky is blue.")["input_ids"] + [tokenizer.eos_token_id]
    assert ds[0]["input_ids"] == expected and ds[0]["loss_mask"] == [1] * len(expected)
    renamed = SFTDataset(write_jsonl([{"body": "Hi."}], "b.jsonl"), tokenizer, text_key="body")
    assert learnt(renamed, tokenizer) == f"Hi.{tokenizer.eos_token}"


def test_prompt_completion_standard_and_conversational_learn_the_completion_only(write_jsonl, tokenizer):
    eos = tokenizer.eos_token
    standard = SFTDataset(write_jsonl([{"prompt": "The sky is", "completion": " blue."}]), tokenizer)
    assert learnt(standard, tokenizer) == f" blue.{eos}"
    few_shot = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"},
                {"role": "user", "content": "2+2?"}]
    rows = [{"prompt": few_shot, "completion": [{"role": "assistant", "content": "4"}]}]
    conversational = SFTDataset(write_jsonl(rows, "c.jsonl"), tokenizer)
    assert learnt(conversational, tokenizer) == f"4{eos}"  # not the prompt's assistant turn "2"
    text = tokenizer.decode(conversational[0]["input_ids"])
    assert text == tokenizer.apply_chat_template(few_shot + rows[0]["completion"], tokenize=False)


def test_a_missing_sft_column_names_the_key_that_maps_it(write_jsonl, tokenizer):
    with pytest.raises(DataError, match=r"row 0 \(line 1\): missing column 'completion' \(set data.response_key to "
                                        r"the column holding it; columns: prompt, response\)"):
        SFTDataset(write_jsonl([{"prompt": "Q", "response": "A"}]), tokenizer)
    with pytest.raises(DataError, match=r"missing column 'prompt' \(set data.prompt_key to the column holding it; "
                                        r"columns: question, completion\)"):
        SFTDataset(write_jsonl([{"question": "Q", "completion": "A"}], "b.jsonl"), tokenizer)
    mixed = [{"prompt": [{"role": "user", "content": "Q"}], "completion": "A"}]
    with pytest.raises(DataError, match=r"column 'completion': expected a non-empty list of messages continuing the "
                                        r"prompt \(the prompt 'prompt' is a message list, so completions are too"):
        SFTDataset(write_jsonl(mixed, "c.jsonl"), tokenizer)


def test_the_implicit_prompt_is_the_shared_start_as_trl_extracts_it():
    assert shared_prompt("The sky is blue.", "The sky is green.") == ("The sky is", " blue.", " green.")
    user = {"role": "user", "content": "What color is the sky?"}
    chosen = [user, {"role": "assistant", "content": "It is blue."}]
    rejected = [user, {"role": "assistant", "content": "It is green."}]
    assert shared_prompt(chosen, rejected) == ([user], chosen[1:], rejected[1:])
    record = Record({"chosen": chosen, "rejected": rejected}, "pairs.jsonl", 3, 4)
    assert parse_pair(record, "prompt", "chosen", "rejected") == ([user], chosen[1:], rejected[1:])
    nothing_shared = Record({"chosen": "Blue.", "rejected": "Green."}, "pairs.jsonl", 0, 1)
    with pytest.raises(DataError, match=r"row 0 \(line 1\), column 'prompt \(the start 'chosen' and 'rejected' "
                                        r"share, as the row has no 'prompt' column\)': expected a non-empty prompt"):
        parse_pair(nothing_shared, "prompt", "chosen", "rejected")
    same = Record({"chosen": "Blue.", "rejected": "Blue."}, "pairs.jsonl", 0, 1)  # no completion left to prefer
    with pytest.raises(DataError, match=r"column 'chosen': expected a non-empty string"):
        parse_pair(same, "prompt", "chosen", "rejected")
    no_rejected = Record({"prompt": "Q", "chosen": "A", "worse": "B"}, "pairs.jsonl", 0, 1)
    with pytest.raises(DataError, match=r"missing column 'rejected' \(set data.rejected_key to the column holding "
                                        r"it; columns: prompt, chosen, worse\)"):
        parse_pair(no_rejected, "prompt", "chosen", "rejected")


def test_implicit_and_explicit_prompt_pairs_tokenize_alike(write_jsonl, tokenizer):
    user = {"role": "user", "content": "What color is the sky?"}
    explicit = [{"prompt": [user], "chosen": [{"role": "assistant", "content": "Blue."}],
                 "rejected": [{"role": "assistant", "content": "Green."}]}]
    implicit = [{"chosen": [user, *explicit[0]["chosen"]], "rejected": [user, *explicit[0]["rejected"]]}]

    def encode(p, c, r):
        return encode_policy_pair(p, c, r, tokenizer)

    a = PreferenceDataset(write_jsonl(explicit, "a.jsonl"), tokenizer, encode)
    b = PreferenceDataset(write_jsonl(implicit, "b.jsonl"), tokenizer, encode)
    assert a[0] == b[0]

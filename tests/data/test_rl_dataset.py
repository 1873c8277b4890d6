"""RLDataset: verl-format parquet, jsonl, plain strings, malformed-input errors, prompt-length handling."""

from __future__ import annotations

import re

import pytest

from hybridflow.data import DataError, RLDataset
from hybridflow.data.gsm8k_synthetic import make_rows, write_parquet


def _chat_ids(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_verl_parquet_round_trip(tmp_path, tokenizer):
    rows = make_rows(6, "train", seed=0)
    path = write_parquet(rows, tmp_path / "train.parquet")
    ds = RLDataset(path, tokenizer)
    assert len(ds) == 6 and ds.num_rows == 6
    for i, row in enumerate(rows):
        item = ds[i]
        assert item["raw_prompt"] == row["prompt"]
        assert item["data_source"] == "openai/gsm8k" and item["ability"] == "math"
        assert item["ground_truth"] == row["reward_model"]["ground_truth"]
        assert item["extra_info"] == row["extra_info"]
        assert item["input_ids"].tolist() == _chat_ids(tokenizer, row["prompt"])
        assert item["index"] == i


def test_jsonl_plain_strings_with_and_without_template(write_jsonl, tokenizer):
    path = write_jsonl([{"prompt": "2+2?", "ground_truth": "4"}, {"prompt": "3+3?", "data_source": "mine"}])
    ds = RLDataset(path, tokenizer)
    assert ds[0]["input_ids"].tolist() == _chat_ids(tokenizer, [{"role": "user", "content": "2+2?"}])
    assert ds[0]["ground_truth"] == "4" and ds[0]["data_source"] == "unknown" and ds[0]["extra_info"] == {}
    assert ds[1]["data_source"] == "mine" and ds[1]["ground_truth"] is None
    raw = RLDataset(path, tokenizer, apply_chat_template=False)
    assert raw[0]["input_ids"].tolist() == tokenizer("2+2?")["input_ids"]
    assert raw[0]["raw_prompt"] == "2+2?"


def test_several_files_in_order_and_custom_prompt_key(tmp_path, write_jsonl, tokenizer):
    a = write_parquet([{"question": "a"}, {"question": "b"}], tmp_path / "a.parquet")
    b = write_jsonl([{"question": "c"}], "b.jsonl")
    ds = RLDataset([a, str(b)], tokenizer, prompt_key="question", apply_chat_template=False)
    assert [ds[i]["raw_prompt"] for i in range(len(ds))] == ["a", "b", "c"]


MALFORMED = [
    ({"text": "hi"}, r"row 1 \(line 2\): missing column 'prompt' \(set data.prompt_key to the column holding it; "
                     r"columns: text\)"),
    ({"prompt": 5}, r"row 1 \(line 2\), column 'prompt': expected a non-empty string or .*got int 5"),
    ({"prompt": "   "}, r"row 1 \(line 2\), column 'prompt': expected a non-empty prompt"),
    ({"prompt": []}, r"column 'prompt': expected a non-empty string or a non-empty list of messages"),
    ({"prompt": [{"role": "user"}]}, r"column 'prompt': .*message 0 to be a \{role: str, content: str\}"),
    ({"prompt": "x", "extra_info": "oops"}, r"row 1 \(line 2\), column 'extra_info': expected a mapping or null"),
    ({"prompt": "x", "reward_model": 3}, r"column 'reward_model': expected a mapping or null, got int 3"),
    ({"prompt": "x", "data_source": 7}, r"column 'data_source': expected str or null, got int 7"),
]


@pytest.mark.parametrize("bad,pattern", MALFORMED, ids=[p[1][:30] for p in MALFORMED])
def test_malformed_row_names_file_row_column(write_jsonl, tokenizer, bad, pattern):
    path = write_jsonl([{"prompt": "fine"}, bad])
    with pytest.raises(DataError, match=pattern) as e:
        RLDataset(path, tokenizer)
    assert str(e.value).startswith(str(path))


def test_malformed_files(tmp_path, write_jsonl, tokenizer):
    with pytest.raises(DataError, match=r"missing\.parquet: file not found"):
        RLDataset(tmp_path / "missing.parquet", tokenizer)
    with pytest.raises(DataError, match=rf"{tmp_path}: is a directory, not a data file"):
        RLDataset(tmp_path, tokenizer)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not a parquet file at all")
    with pytest.raises(DataError, match=r"garbage\.parquet: cannot read as parquet"):
        RLDataset(garbage, tokenizer)
    csv = tmp_path / "x.csv"
    csv.write_text("prompt\nhi\n")
    with pytest.raises(DataError, match=r"unsupported file type '.csv'; expected one of .parquet, .jsonl"):
        RLDataset(csv, tokenizer)
    bad_json = write_jsonl([{"prompt": "a"}, "", "{not json"])
    with pytest.raises(DataError, match=r"row 1 \(line 3\): not valid JSON"):
        RLDataset(bad_json, tokenizer)
    no_column = write_parquet([{"question": "q"}], tmp_path / "q.parquet")
    with pytest.raises(DataError, match=re.escape(f"{no_column}, row 0: missing column 'prompt'")):
        RLDataset(no_column, tokenizer)
    with pytest.raises(DataError, match="no data files"):
        RLDataset([], tokenizer)


def test_messages_need_a_template(write_jsonl, tokenizer):
    path = write_jsonl([{"prompt": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(DataError, match="apply_chat_template=true"):
        RLDataset(path, tokenizer, apply_chat_template=False)


def _length_data(write_jsonl):
    # plain text, one byte-level token per character: lengths 3, 10, 5, 12
    return write_jsonl([{"prompt": p} for p in ["abc", "a" * 10, "hello", "b" * 12]])


def test_long_prompts_refused_by_default(write_jsonl, tokenizer):
    path = _length_data(write_jsonl)
    with pytest.raises(DataError, match=r"2 of 4 prompts are longer than max_prompt_length=6 tokens \(first: "
                                        r".*row 1 \(line 2\), 10 tokens\); set data.truncation=filter"):
        RLDataset(path, tokenizer, max_prompt_length=6, apply_chat_template=False)


def test_filter_and_truncate_counts(write_jsonl, tokenizer, caplog):
    path = _length_data(write_jsonl)
    with caplog.at_level("WARNING", logger="hybridflow.data.dataset"):
        kept = RLDataset(path, tokenizer, max_prompt_length=6, truncation="filter", apply_chat_template=False)
    assert "2 prompts (4 read, 2 filtered, 0 truncated; max_prompt_length=6)" in caplog.text
    assert len(kept) == 2 and kept.num_filtered == 2 and kept.num_truncated == 0
    assert [kept[i]["raw_prompt"] for i in range(2)] == ["abc", "hello"]
    left = RLDataset(path, tokenizer, max_prompt_length=6, truncation="left", apply_chat_template=False)
    right = RLDataset(path, tokenizer, max_prompt_length=6, truncation="right", apply_chat_template=False)
    assert len(left) == 4 and left.num_truncated == 2 and left.num_filtered == 0
    full = tokenizer("b" * 12)["input_ids"]
    assert left[3]["input_ids"].tolist() == full[-6:] and right[3]["input_ids"].tolist() == full[:6]
    with pytest.raises(DataError, match="all 4 prompts are longer"):
        RLDataset(path, tokenizer, max_prompt_length=2, truncation="filter", apply_chat_template=False)

"""SFTDataset: the loss mask is exactly the assistant tokens; packing keeps rows and their positions."""

from __future__ import annotations

import pytest
import torch

from hybridflow.data import DataError, PackingCollator, BatchLoader, SFTDataset, pack_lengths

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "It is 4."},
]


def test_loss_mask_covers_exactly_the_assistant_tokens(write_jsonl, tokenizer):
    ds = SFTDataset(write_jsonl([{"messages": CONVERSATION}]), tokenizer)
    ids, mask = ds[0]["input_ids"], ds[0]["loss_mask"]
    full = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert ids == tokenizer(full, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token
    # the masked tokens, as runs, are each assistant turn's content followed by its end-of-turn token
    runs, run = [], []
    for tok, m in zip(ids, mask):
        if m:
            run.append(tok)
        elif run:
            runs.append(run)
            run = []
    assert [tokenizer.decode(r) for r in runs] == [f"Hello!{eos}", f"It is 4.{eos}"]
    expected = sum(len(tokenizer(m["content"] + eos, add_special_tokens=False)["input_ids"])
                   for m in CONVERSATION if m["role"] == "assistant")
    assert sum(mask) == expected
    unmasked = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    assert "Hi there" in unmasked and "assistant" in unmasked and "Hello" not in unmasked


def test_prompt_response_columns(write_jsonl, tokenizer):
    ds = SFTDataset(write_jsonl([{"prompt": "Q", "response": "A"}]), tokenizer, response_key="response")
    ids, mask = ds[0]["input_ids"], ds[0]["loss_mask"]
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == f"A{tokenizer.eos_token}"


def test_prompt_response_as_dotted_paths_into_a_dict_column(write_jsonl, tokenizer):
    """verl's gsm8k SFT data keeps the question and answer in `extra_info` (its `prompt_dict_keys`): the keys are
    dotted paths; a row without the nested field is named with the path."""
    rows = [{"extra_info": {"question": "Q", "answer": "A", "index": 0}}]
    ds = SFTDataset(write_jsonl(rows, "n.jsonl"), tokenizer, prompt_key="extra_info.question",
                    response_key="extra_info.answer")
    flat = SFTDataset(write_jsonl([{"prompt": "Q", "completion": "A"}], "f.jsonl"), tokenizer)
    assert ds[0]["input_ids"] == flat[0]["input_ids"] and ds[0]["loss_mask"] == flat[0]["loss_mask"]
    missing = write_jsonl([{"extra_info": {"question": "Q"}}], "m.jsonl")
    with pytest.raises(DataError, match=r"row 0 \(line 1\): missing column 'extra_info.answer' \(set data.response_key "
                                        r"to the column holding it; columns: extra_info\)"):
        SFTDataset(missing, tokenizer, prompt_key="extra_info.question", response_key="extra_info.answer")


def test_sft_errors_and_truncation(write_jsonl, tokenizer):
    no_assistant = write_jsonl([{"messages": [{"role": "user", "content": "hi"}]}], "a.jsonl")
    with pytest.raises(DataError, match=r"row 0 \(line 1\), column 'messages': expected at least one assistant"):
        SFTDataset(no_assistant, tokenizer)
    no_columns = write_jsonl([{"body": "hi"}], "b.jsonl")
    with pytest.raises(DataError, match=r"row 0 \(line 1\): no column to learn from: a conversation under 'messages' "
                                        r"\(data.messages_key\), a prompt and a completion under 'prompt' and "
                                        r"'completion' \(data.prompt_key, data.response_key\) or text under 'text' "
                                        r"\(data.text_key\); set the key that names yours. Columns: body"):
        SFTDataset(no_columns, tokenizer)
    empty_response = write_jsonl([{"prompt": "Q", "completion": ""}], "c.jsonl")
    with pytest.raises(DataError, match=r"column 'completion': expected a non-empty string"):
        SFTDataset(empty_response, tokenizer)
    rows = write_jsonl([{"prompt": "Q", "completion": "A"}, {"prompt": "Q" * 40, "completion": "A"}], "d.jsonl")
    with pytest.raises(DataError, match=r"row 1 \(line 2\): \d+ tokens, over max_length=30"):
        SFTDataset(rows, tokenizer, max_length=30)
    kept = SFTDataset(rows, tokenizer, max_length=30, truncation="filter")
    assert len(kept) == 1 and kept.num_filtered == 1
    cut = SFTDataset(rows, tokenizer, max_length=30, truncation="right")
    assert len(cut[1]["input_ids"]) == len(cut[1]["loss_mask"]) == 30 and cut.num_truncated == 1


def test_pack_lengths_respects_the_budget():
    lengths = [5, 3, 8, 2, 7, 1]
    packs = pack_lengths(lengths, max_tokens=10)
    assert sorted(i for p in packs for i in p) == list(range(6))
    assert all(sum(lengths[i] for i in p) <= 10 for p in packs)
    assert len(packs) == 3  # 26 tokens need at least 3 packs of 10
    with pytest.raises(ValueError, match="row 2 has 8 tokens, over the packing budget max_tokens=7"):
        pack_lengths(lengths, max_tokens=7)


def test_packing_collator_keeps_rows_positions_and_masks():
    items = [{"input_ids": [10 + i] * n, "loss_mask": [0] + [1] * (n - 1), "index": i}
             for i, n in enumerate([4, 3, 5, 2])]
    batch = PackingCollator(max_tokens=8, pad_token_id=0)(items)
    assert batch.meta["num_sequences"] == 4
    assert batch["input_ids"].shape[1] <= 8
    seen = set()
    for k, rows in enumerate(batch["index"]):
        seg = batch["segment_ids"][k]
        for s, i in enumerate(rows, start=1):
            where = seg == s
            n = len(items[i]["input_ids"])
            assert batch["input_ids"][k][where].tolist() == items[i]["input_ids"]
            assert batch["position_ids"][k][where].tolist() == list(range(n))
            assert batch["loss_mask"][k][where].tolist() == items[i]["loss_mask"]
            seen.add(i)
        assert torch.equal(batch["attention_mask"][k], (seg > 0).long())
        assert (batch["input_ids"][k][seg == 0] == 0).all()
    assert seen == {0, 1, 2, 3}
    assert int(batch["attention_mask"].sum()) == 14


def test_sft_through_the_loader(write_jsonl, tokenizer):
    ds = SFTDataset(write_jsonl([{"prompt": f"Q{i}", "completion": "A" * i} for i in range(1, 7)]), tokenizer)
    loader = BatchLoader(ds, batch_size=3, seed=0, collate=PackingCollator(64, ds.pad_token_id))
    batches = list(loader)
    assert len(batches) == 2
    assert sum(b.meta["num_sequences"] for b in batches) == 6
    assert int(sum(b["loss_mask"].sum() for b in batches)) == sum(sum(ds[i]["loss_mask"]) for i in range(6))

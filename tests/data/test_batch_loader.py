"""BatchLoader: left-padded prompt batches, seeded epochs, exact resume, config wiring."""

from __future__ import annotations

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.config import load_config
from hybridflow.data import BatchLoader, RLDataset, build_prompt_loaders
from hybridflow.data.gsm8k_synthetic import write_gsm8k_synthetic


@pytest.fixture
def dataset(write_jsonl, tokenizer):
    rows = [{"prompt": "x" * (i % 5 + 1), "data_source": f"src{i % 2}", "ground_truth": str(i),
             "extra_info": {"i": i}} for i in range(10)]
    return RLDataset(write_jsonl(rows), tokenizer, apply_chat_template=False)


def _uids(batches):
    return [list(b["uid"]) for b in batches]


def test_batch_is_left_padded(dataset):
    batch = BatchLoader(dataset, batch_size=4, shuffle=False).next_batch()
    assert isinstance(batch, Batch) and len(batch) == 4
    lengths = [len(dataset[i]["input_ids"]) for i in range(4)]  # 1, 2, 3, 4 tokens
    prompts, mask = batch["prompts"], batch["attention_mask"]
    assert prompts.shape == (4, max(lengths)) and prompts.dtype == torch.long
    assert mask.sum(1).tolist() == lengths
    for i, n in enumerate(lengths):
        assert prompts[i, -n:].tolist() == dataset[i]["input_ids"].tolist()
        assert (prompts[i, : max(lengths) - n] == 0).all() and (mask[i, : max(lengths) - n] == 0).all()
    assert list(batch["uid"]) == ["0-0", "0-1", "0-2", "0-3"]
    assert list(batch["ground_truth"]) == ["0", "1", "2", "3"]
    assert list(batch["data_source"]) == ["src0", "src1", "src0", "src1"]
    assert batch["extra_info"][2] == {"i": 2} and batch["raw_prompt"][0] == "x"
    assert set(batch.keys()) >= {"index", "ability"}


def test_seeded_epochs(dataset):
    a, b = BatchLoader(dataset, 2, seed=3), BatchLoader(dataset, 2, seed=3)
    epoch0, epoch1 = list(a), list(a)
    assert _uids(epoch0) == _uids(list(b))
    assert len(epoch0) == len(a) == 5
    idx0 = sorted(int(i) for batch in epoch0 for i in batch["index"])
    assert idx0 == list(range(10))  # each epoch is a permutation
    assert [u.split("-")[0] for u in _uids(epoch1)[0]] == ["1", "1"]
    assert [int(i) for bt in epoch0 for i in bt["index"]] != [int(i) for bt in epoch1 for i in bt["index"]]
    other = list(BatchLoader(dataset, 2, seed=4))
    assert _uids(other) != _uids(epoch0)


def test_resume_continues_with_the_exact_next_batch(dataset):
    ref = BatchLoader(dataset, 3, seed=7)  # 3 batches per epoch (drop_last)
    expected = [ref.next_batch() for _ in range(8)]
    run = BatchLoader(dataset, 3, seed=7)
    for _ in range(5):  # into the second epoch
        run.next_batch()
    state = run.state_dict()
    assert state == {"epoch": 1, "position": 2, "seed": 7, "batch_size": 3, "shuffle": True}
    resumed = BatchLoader(dataset, 3, seed=0)
    resumed.load_state_dict(state)
    for want in expected[5:]:
        assert resumed.next_batch() == want


def test_state_at_epoch_end_and_iteration_resume(dataset):
    loader = BatchLoader(dataset, 5, seed=1)
    batches = iter(loader)
    next(batches), next(batches)
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["position"] == 0
    mid = BatchLoader(dataset, 5, seed=1)
    next(iter(mid))
    again = BatchLoader(dataset, 5, seed=1)
    again.load_state_dict(mid.state_dict())
    assert _uids(list(again)) == _uids(list(mid))  # the rest of epoch 0: one batch


def test_bad_states_and_sizes(dataset):
    loader = BatchLoader(dataset, 2)
    with pytest.raises(ValueError, match="batch_size=4, this loader 2"):
        loader.load_state_dict({"epoch": 0, "position": 0, "seed": 0, "batch_size": 4, "shuffle": True})
    with pytest.raises(ValueError, match="larger than the dataset"):
        BatchLoader(dataset, 11)


def test_validation_loader_keeps_every_row(dataset):
    loader = BatchLoader(dataset, 4, shuffle=False, drop_last=False)
    assert [len(b) for b in loader] == [4, 4, 2]


def test_build_from_config(tmp_path, tokenizer):
    train, val = write_gsm8k_synthetic(tmp_path, n_train=12, n_val=5)
    cfg = load_config([f"data.train_files={train}", f"data.val_files={val}", "data.train_batch_size=4",
                       "trainer.seed=5"])
    train_loader, val_loader = build_prompt_loaders(cfg, tokenizer)
    assert len(train_loader) == 3 and train_loader.seed == 5
    assert [len(b) for b in val_loader] == [5]
    assert build_prompt_loaders(load_config([f"data.train_files={train}", "data.train_batch_size=4"]),
                                tokenizer)[1] is None


def test_saved_hf_tokenizer_end_to_end(tmp_path, tiny_qwen2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    train, _ = write_gsm8k_synthetic(tmp_path, n_train=8, n_val=2)
    ds = RLDataset(train, tok, max_prompt_length=256)
    batch = BatchLoader(ds, 4, seed=1).next_batch()
    for row, mask, messages in zip(batch["prompts"], batch["attention_mask"], batch["raw_prompt"]):
        text = tok.decode(row[mask.bool()].tolist())
        assert text == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (batch["prompts"][batch["attention_mask"] == 0] == tok.pad_token_id).all()

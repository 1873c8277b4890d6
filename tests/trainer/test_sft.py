"""`hybridflow sft` on a tiny random model: the assistant-only loss, learning, checkpoints and export."""

from __future__ import annotations

import json

import pytest
import torch

from hybridflow.cli import main as cli_main
from hybridflow.config.loader import load_config
from hybridflow.config.sft_schema import SFTConfig
from hybridflow.config.validate import ConfigError
from hybridflow.data.sft_data import SFTDataset, collate_sft_rows
from hybridflow.trainer.sft_trainer import SFTTrainer

WORDS = ["abc", "hello", "xyz", "qqq", "test", "foo", "bar", "baz"]  # the conversations of the `chats` fixture


def overrides(model, chats, out, *extra):
    return [f"model.path={model}", f"data.train_files={chats}", "data.train_batch_size=4", "optim.lr=3e-3",
            "trainer.total_steps=6", f"trainer.output_dir={out}", *extra]


def read_metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_rows_put_the_loss_on_assistant_tokens_only(tiny_qwen2, chats):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    ds = SFTDataset(chats, tok)
    batch = collate_sft_rows([ds[0], ds[1]], pad_id=0)
    ids, mask = batch["input_ids"], batch["response_mask"]
    assert mask.shape == (2, ids.shape[1] - 1)
    for row, word in zip(range(2), WORDS[:2]):
        targets = ids[row, 1:][mask[row].bool()]
        assert tok.decode(targets) == word + "<|im_end|>"  # the answer and its end-of-turn, no header
    n = batch["attention_mask"].sum(-1)
    assert (ids[0, int(n[0]):] == 0).all() and batch["position_ids"][1, : int(n[1])].tolist() == list(range(int(n[1])))


def test_reported_loss_is_the_mean_nll_of_assistant_tokens(tiny_qwen2, chats, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = load_config(overrides(tiny_qwen2, chats, tmp_path, "data.train_batch_size=8", "trainer.total_steps=1",
                                "data.shuffle=false", "data.max_length=64", "optim.max_tokens_per_micro_batch=64"),
                      schema=SFTConfig)
    trainer = SFTTrainer(cfg)
    batch = trainer.train_loader.batch_at(0, 0)
    metrics = trainer.fit()
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    nll = -torch.log_softmax(logits.float(), -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    mask = batch["response_mask"]
    assert metrics["train/loss"] == pytest.approx(float((nll * mask).sum() / mask.sum()), rel=1e-4)
    resolved = load_config([], tmp_path / "resolved_config.yaml", schema=SFTConfig)  # what the worker ran with
    assert resolved.optim.max_tokens_per_micro_batch == 64 and resolved.model.gradient_checkpointing is False
    assert resolved.model.dtype == "fp32" and resolved.model.compile is False


def test_sft_cli_learns_logs_checkpoints_and_exports(tiny_qwen2, chats, tmp_path):
    from transformers import AutoModelForCausalLM

    assert cli_main(["sft", *overrides(tiny_qwen2, chats, tmp_path, f"data.val_files={chats}",
                                       "trainer.val_every=3", "trainer.val_before_train=true",
                                       "trainer.loggers=[jsonl,tensorboard]")]) == 0
    rows = read_metrics(tmp_path)
    train = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(1, 7))
    for key in ("train/loss", "train/lr", "train/grad_norm", "perf/throughput"):
        assert all(key in r for r in train), key
    val = [r["val/loss"] for r in rows if "val/loss" in r]
    assert len(val) == 3 and val[-1] < val[0] - 0.5  # before, step 3, step 6
    assert train[-1]["train/loss"] < train[0]["train/loss"]
    assert (tmp_path / "checkpoints").is_dir() and list((tmp_path / "tensorboard").glob("events.*"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    start = AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    changed = [n for n, p in exported.state_dict().items() if not torch.equal(p, start.state_dict()[n])]
    assert changed  # the trained weights, not the starting model's


def test_val_loss_after_the_last_step_and_the_loss_on_the_console(tiny_qwen2, chats, tmp_path, capsys):
    """docs/sft.md: val/loss is logged at the end, also with trainer.val_every=0 (issue 36, item 7)."""
    assert cli_main(["sft", *overrides(tiny_qwen2, chats, tmp_path, f"data.val_files={chats}", "trainer.total_steps=2",
                                       "trainer.val_every=0", "trainer.loggers=[console,jsonl]")]) == 0
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows if "val/loss" in r] == [2]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert lines[0].startswith("step 1/2 | loss ") and " | val_loss " in lines[-1]


def test_the_sft_recipe_trains(tiny_qwen2, chats, tmp_path):
    assert cli_main(["sft", "--config", "recipes/sft.yaml", *overrides(tiny_qwen2, chats, tmp_path),
                     "data.max_length=64", "trainer.total_steps=2", "trainer.loggers=[jsonl]"]) == 0
    assert [r["step"] for r in read_metrics(tmp_path) if "train/loss" in r] == [1, 2]


def test_resume_continues_from_the_checkpoint(tiny_qwen2, chats, tmp_path):
    SFTTrainer(load_config(overrides(tiny_qwen2, chats, tmp_path, "trainer.total_steps=2"), schema=SFTConfig)).fit()
    resumed = SFTTrainer(load_config(overrides(tiny_qwen2, chats, tmp_path, "trainer.total_steps=3"),
                                     schema=SFTConfig))
    assert resumed.step == 2
    resumed.fit()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


def test_config_errors_name_key_and_valid_values(tiny_qwen2, chats, tmp_path):
    cfg = load_config(overrides(tiny_qwen2, chats, tmp_path, "optim.mini_batch_size=3",
                                "optim.max_tokens_per_micro_batch=16", "data.max_length=64"), schema=SFTConfig)
    with pytest.raises(ConfigError) as err:
        SFTTrainer(cfg)
    text = str(err.value)
    assert "optim.mini_batch_size=3 must divide data.train_batch_size=4; valid: 1, 2, 4" in text
    assert "optim.max_tokens_per_micro_batch=16 is below data.max_length=64" in text
    with pytest.raises(ConfigError, match="did you mean"):
        load_config(["optim.lrr=1"], schema=SFTConfig)
    assert cli_main(["sft", f"model.path={tiny_qwen2}", f"trainer.output_dir={tmp_path}"]) == 2


def test_docs_reference_matches_the_schema():
    from pathlib import Path

    from hybridflow.config.config_docs import render_sections

    docs = (Path(__file__).resolve().parents[2] / "docs" / "sft.md").read_text()
    assert render_sections(SFTConfig).strip() in docs

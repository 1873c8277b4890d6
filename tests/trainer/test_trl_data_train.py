"""TRL's datasets through the commands (issue 55): one `hybridflow sft` step on rows in each of TRL's SFT
formats (conversational, prompt/completion standard and conversational, plain text under `data.text_key`),
and one `hybridflow dpo` step on pairs with an implicit prompt, whose metrics.jsonl carries TRL's DPO names
(`rewards/accuracies`, `rewards/margins`, `rewards/chosen`, `rewards/rejected`) beside ours."""

from __future__ import annotations

import json

import pytest

from hybridflow.cli import main as cli_main


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_sft_trains_on_rows_of_every_trl_format(tiny_qwen2, tmp_path):
    user = [{"role": "user", "content": "2+2?"}]
    rows = [{"messages": [*user, {"role": "assistant", "content": "4"}]},
            {"prompt": "The sky is", "completion": " blue."},
            {"prompt": user, "completion": [{"role": "assistant", "content": "Four."}]},
            {"body": "Plain text, learnt whole."}]
    data = write_rows(tmp_path / "mixed.jsonl", rows)
    out = tmp_path / "run"
    assert cli_main(["sft", f"model.path={tiny_qwen2}", f"data.train_files={data}", "data.train_batch_size=4",
                     "data.text_key=body", "trainer.total_steps=1", f"trainer.output_dir={out}",
                     "trainer.loggers=[jsonl]"]) == 0
    (metrics,) = read_metrics(out)
    assert metrics["step"] == 1 and metrics["train/loss"] > 0


def test_dpo_on_implicit_prompt_pairs_logs_trls_metric_names(tiny_qwen2, tmp_path):
    pairs = []
    for i in range(4):
        user = {"role": "user", "content": f"say {i}"}
        pairs.append({"chosen": [user, {"role": "assistant", "content": "abc"}],
                      "rejected": [user, {"role": "assistant", "content": "xyz"}]})
    data = write_rows(tmp_path / "pairs.jsonl", pairs)
    out = tmp_path / "run"
    assert cli_main(["dpo", f"model.path={tiny_qwen2}", f"data.train_files={data}", "data.train_batch_size=4",
                     "trainer.total_steps=1", f"trainer.output_dir={out}", "trainer.loggers=[jsonl]"]) == 0
    (metrics,) = [r for r in read_metrics(out) if "train/loss" in r]
    assert metrics["rewards/accuracies"] == metrics["dpo/accuracy"]
    assert metrics["rewards/margins"] == metrics["dpo/margin"]
    assert metrics["rewards/chosen"] == metrics["dpo/rewards/chosen"]
    assert metrics["rewards/rejected"] == metrics["dpo/rewards/rejected"]
    assert metrics["rewards/margins"] == pytest.approx(metrics["rewards/chosen"] - metrics["rewards/rejected"],
                                                       abs=1e-5)

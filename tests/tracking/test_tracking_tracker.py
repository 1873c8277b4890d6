"""Tracker: jsonl appends across runs, TensorBoard events readable, console line format, bad names."""

from __future__ import annotations

import builtins
import io
import json
from dataclasses import dataclass, field

import pytest
import torch

from hybridflow.tracking import Tracker, config_dict, format_line

STEP_METRICS = {
    "reward/mean": 0.5312, "actor/pg_loss": -0.0123, "actor/grad_norm": torch.tensor(1.25),
    "response_length/mean": 87.44, "response_length/max": 256.0, "response_length/clip_ratio": 0.03125,
    "timing_s/step": 4.2109, "perf/throughput": 12345.6,
}


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_one_line_per_step_and_a_second_tracker_appends(tmp_path):
    with Tracker(["jsonl"], output_dir=tmp_path) as tracker:
        for step in (1, 2):
            tracker.log({"reward/mean": step / 10, "bad": float("nan")}, step=step)
        # Flushed per line: readable before close.
        assert len(_read_jsonl(tmp_path / "metrics.jsonl")) == 2
    with Tracker("jsonl", output_dir=tmp_path) as tracker:  # a resumed run
        tracker.log({"reward/mean": 0.3}, step=3)
        tracker.log_samples([{"prompt": "p", "response": "r", "reward": 1.0, "data_source": "d"}], step=3)
    lines = _read_jsonl(tmp_path / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert lines[0] == {"step": 1, "reward/mean": 0.1, "bad": None}
    assert _read_jsonl(tmp_path / "samples.jsonl") == [
        {"step": 3, "prompt": "p", "response": "r", "reward": 1.0, "data_source": "d"}]


@pytest.mark.parametrize("torn", [b'{"step": 2, "reward/me', b'{"step": 2, "reward/mean": 0.2}'])
def test_a_torn_last_line_is_repaired_when_the_run_resumes(tmp_path, caplog, torn):
    """A crash or a full disk mid-write leaves a line without its newline: the resumed run's next line
    must not be glued to it (both would be unreadable, and the report would skip the step)."""
    from hybridflow.report.runlog import load_run

    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1, "reward/mean": 0.1}\n' + torn)
    with Tracker("jsonl", output_dir=tmp_path) as tracker:
        tracker.log({"reward/mean": 0.25}, step=2)
    lines = _read_jsonl(tmp_path / "metrics.jsonl")
    whole = torn.endswith(b"}")
    assert [line["step"] for line in lines] == ([1, 2, 2] if whole else [1, 2])
    assert lines[-1] == {"step": 2, "reward/mean": 0.25}
    assert ("dropped a torn last line (22 bytes)" in caplog.text) is not whole
    run = load_run(tmp_path)
    assert not run.unreadable and run.steps == [1, 2] and run.metrics[2]["reward/mean"] == 0.25


def test_a_full_disk_while_logging_names_the_file(tmp_path):
    from hybridflow.tracking.jsonl_logger import LogWriteError

    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")  # every write fails with ENOSPC
    with Tracker("jsonl", output_dir=tmp_path) as tracker:
        with pytest.raises(LogWriteError, match=r"cannot write .*metrics.jsonl: No space left on device"):
            tracker.log({"reward/mean": 0.25}, step=1)


def test_tensorboard_events_are_readable(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Tracker(["tensorboard"], output_dir=tmp_path, config={"actor": {"lr": 1e-6}}) as tracker:
        for step in (1, 2, 3):
            tracker.log({"reward/mean": step * 0.25, "note": "text is skipped"}, step=step)
        tracker.log_samples([{"prompt": "2+2?", "response": "4", "reward": 1.0, "data_source": "demo"}], step=3)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("reward/mean")
    assert [(e.step, e.value) for e in events] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    tags = acc.Tags()
    assert "note" not in tags["scalars"]
    assert {"config/text_summary", "samples/text_summary"} <= set(tags["tensors"])


def test_console_line_format():
    line = format_line({k: float(v) for k, v in STEP_METRICS.items()}, step=7, total_steps=100)
    assert line == ("step   7/100 | reward 0.531 | pg_loss -0.0123 | grad 1.25 | len 87.4 (max 256, clip 3.1%)"
                    " | 4.21 s | 12,346 tok/s")
    assert format_line({"reward/mean": 1.0, "reward/errors": 2.0, "reward/error_share": 0.25,
                        "agent/env_error_share": 0.0}, step=3) == "step 3 | reward 1.000 | reward errors 25%"
    assert format_line({"reward/error_share": 0.0, "agent/env_error_share": 0.5}, step=3) == "step 3 | env errors 50%"
    assert format_line({"train/loss": 1.5, "val/loss": 1.75}, step=2, total_steps=9) == "step 2/9 | loss 1.5 | val_loss 1.75"
    assert format_line({"train/loss": 0.6, "dpo/margin": 0.25, "dpo/accuracy": 0.75, "val/dpo/accuracy": 0.5},
                       step=1) == "step 1 | loss 0.6 | margin 0.25 | pair_acc 0.750 | val_pair_acc 0.500"
    assert format_line({"teacher/kl": 0.125}, step=4) == "step 4 | teacher_kl 0.125"
    stream = io.StringIO()
    with Tracker(["console"], output_dir=".", total_steps=100, stream=stream) as tracker:
        tracker.log(STEP_METRICS, step=7)
        tracker.log_samples([{"response": "x" * 500, "reward": 0.5, "data_source": "d"}], step=7)
    out = stream.getvalue().splitlines()
    assert out[0] == line
    assert out[1].startswith("  sample 0 [d] reward 0.500: xxx") and out[1].endswith("...") and len(out[1]) < 260


def test_unknown_logger_names_valid_ones():
    with pytest.raises(ValueError, match=r"unknown logger 'tensorbord' \(did you mean 'tensorboard'\?\); "
                                         r"valid: console, jsonl, tensorboard, wandb"):
        Tracker(["console", "tensorbord"], output_dir=".")


def test_wandb_missing_gives_install_hint(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ImportError, match="pip install wandb.*WANDB_MODE=offline"):
        Tracker(["jsonl", "wandb"], output_dir=tmp_path)


def test_wandb_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with Tracker(["wandb"], output_dir=tmp_path, config={"seed": 1}) as tracker:
        tracker.log({"reward/mean": 0.5}, step=1)
        tracker.log_samples([{"prompt": [{"role": "user", "content": "hi"}], "response": "r", "reward": 1.0}], 1)
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_metric_values_must_be_numbers_or_strings(tmp_path):
    with Tracker(["jsonl"], output_dir=tmp_path) as tracker:
        with pytest.raises(TypeError, match="not a number or a string"):
            tracker.log({"x": [1, 2]}, step=1)
        tracker.log({"x": torch.tensor(2.5), "n": 3}, step=1)
    assert _read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "x": 2.5, "n": 3}]


@dataclass
class _Inner:
    lr: float = 1e-6


@dataclass
class _Cfg:
    actor: _Inner = field(default_factory=_Inner)
    loggers: list = field(default_factory=lambda: ["console"])


def test_config_dict_from_dataclass_omegaconf_and_mapping():
    from omegaconf import OmegaConf

    expected = {"actor": {"lr": 1e-6}, "loggers": ["console"]}
    assert config_dict(_Cfg()) == expected
    assert config_dict(OmegaConf.structured(_Cfg)) == expected
    assert config_dict(expected) == expected and config_dict(None) == {}
    with pytest.raises(TypeError, match="config must be a dataclass"):
        config_dict(42)


def test_verl_and_trl_names_are_logged_beside_ours(tmp_path):
    """One alias table (hybridflow.tracking.aliases): verl's critic/score/..., critic/rewards/mean,
    critic/advantages/... and val-core/<source>/reward/mean@<val_n>; TRL's DPO rewards/...; never replacing a
    metric the step has, and an alias whose context field is missing (val_n outside RL) left out."""
    from hybridflow.tracking.aliases import with_aliases

    ours = {"reward/mean": 0.5, "reward/with_kl/mean": 0.4, "advantages/max": 2.0, "response_length/mean": 9.0,
            "val/openai/gsm8k/reward/mean": 0.25, "val/reward/mean": 0.25, "dpo/accuracy": 1.0,
            "dpo/rewards/chosen": 0.3}
    assert with_aliases(ours, {"val_n": 4}) == {
        **ours, "critic/score/mean": 0.5, "critic/rewards/mean": 0.4, "critic/advantages/max": 2.0,
        "val-core/openai/gsm8k/reward/mean@4": 0.25, "rewards/accuracies": 1.0, "rewards/chosen": 0.3}
    assert "val-core/openai/gsm8k/reward/mean@4" not in with_aliases(ours)
    assert with_aliases({"reward/mean": 0.5, "critic/score/mean": 0.7})["critic/score/mean"] == 0.7
    with Tracker(["jsonl"], output_dir=tmp_path, aliases={"val_n": 1}) as tracker:
        tracker.log({"val/toy/reward/mean": 1.0}, step=1)
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {
        "step": 1, "val/toy/reward/mean": 1.0, "val-core/toy/reward/mean@1": 1.0}

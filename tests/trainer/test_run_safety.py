"""Runs you can trust, through `hybridflow train` (in-process, tiny model): an output dir holding another
run's checkpoints or in use by a live run is refused before any model loads (exit 2); a damaged newest
checkpoint is named, export and resume fall back to the older one, and the config's lr and schedule win on
resume; a full disk mid-save leaves no debris and the run resumes; a reward function that fails every row
stops the run; a stopped (SIGSTOP) worker is reported naming role, rank and pid."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from lock_holder import another_run_holding
from rl_helpers import base_overrides, read_metrics

from hybridflow import cli
from hybridflow.checkpoint import main_export
from hybridflow.checkpoint.manifest import write_manifest
from hybridflow.config.loader import load_config, to_yaml
from hybridflow.controller import WorkerUnresponsiveError
from hybridflow.engine.train.optim import lr_factor
from hybridflow.trainer import rl

FAST = ("trainer.val_before_train=false", "trainer.val_every=0")


def train(model, data_dir, out, *extra) -> int:
    """`hybridflow train` on the tiny run; returns its exit status."""
    return cli.main(["train", "--config", "recipes/grpo.yaml", *base_overrides(model, data_dir, out, *FAST, *extra)])


@pytest.fixture
def no_models(monkeypatch):
    """Fails the test if a run gets as far as starting its worker groups (loading models)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the run started its workers before refusing")

    monkeypatch.setattr(rl, "build_roles", refuse)


def _names(out) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def test_an_output_dir_in_use_or_holding_another_runs_checkpoints_is_refused(tiny_qwen2, data_dir, tmp_path,
                                                                             capsys, monkeypatch):
    out = tmp_path / "run"
    assert train(tiny_qwen2, data_dir, out, "trainer.total_steps=1") == 0
    first = (out / "checkpoints" / "step_00000001" / "config.yaml").read_text()

    with monkeypatch.context() as m:
        m.setattr(rl, "build_roles", lambda *a, **k: pytest.fail("started workers before refusing"))
        assert train(tiny_qwen2, data_dir, out, "trainer.total_steps=1", "trainer.resume=never") == 2
        err = capsys.readouterr().err
        assert f"hybridflow train: {out}/checkpoints holds checkpoints of another run (step_00000001) and this " \
               f"run starts fresh (trainer.resume=never)" in err and "trainer.discard_checkpoints=true" in err
        with another_run_holding(out) as holder:
            assert train(tiny_qwen2, data_dir, out, "trainer.total_steps=2") == 2
            assert f"output_dir={out} is in use by another run: pid {holder.pid} on host " in capsys.readouterr().err
    assert (out / "checkpoints" / "step_00000001" / "config.yaml").read_text() == first

    # Starting over is said with a key; the old checkpoints go, the new run's are its own.
    assert train(tiny_qwen2, data_dir, out, "trainer.total_steps=1", "trainer.resume=never", "actor.lr=3e-4",
                 "trainer.discard_checkpoints=true") == 0
    captured = capsys.readouterr()
    assert "taking over the lock of a run that has ended (pid" in captured.out
    assert "trainer.discard_checkpoints=true: deleted step_00000001" in captured.out
    assert _names(out) == ["step_00000001"] and "lr: 0.0003" in (out / "checkpoints/step_00000001/config.yaml").read_text()


def _flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_newest_checkpoint_is_named_and_skipped_and_the_new_lr_applies(tiny_qwen2, data_dir, tmp_path,
                                                                                 capsys):
    out = tmp_path / "run"
    assert train(tiny_qwen2, data_dir, out, "trainer.total_steps=2", "trainer.save_every=1") == 0
    newest, older = out / "checkpoints" / "step_00000002", out / "checkpoints" / "step_00000001"
    shard = max((newest / "actor" / "model").iterdir(), key=lambda p: p.stat().st_size)
    _flip_a_byte(shard)  # same size: only the checksum can tell
    capsys.readouterr()
    damage = f"is damaged: actor/model/{shard.name} has checksum"

    assert main_export([str(out), str(tmp_path / "hf")]) == 0
    captured = capsys.readouterr()
    assert f"WARNING: checkpoint {newest} {damage}" in captured.err
    assert f"falling back to the older checkpoint {older}" in captured.err
    assert f"exported actor of {older} to {tmp_path / 'hf'}" in captured.out  # says which step it wrote

    assert train(tiny_qwen2, data_dir, out, "trainer.total_steps=3", f"trainer.resume={newest}") == 2
    assert f"hybridflow train: trainer.resume={newest}: checkpoint {newest} {damage}" in capsys.readouterr().err

    assert train(tiny_qwen2, data_dir, out, "trainer.total_steps=3", "actor.lr=3e-4", "actor.lr_schedule=cosine",
                 "actor.min_lr_ratio=0") == 0
    captured = capsys.readouterr()
    assert f"resuming from the older checkpoint {older} instead (step_00000002 is kept as damaged_step_00000002" \
           in captured.err
    assert f"resumed from {older} at step 1; changed since the checkpoint (the new values apply): actor.lr: " \
           f"0.0001 (checkpoint) vs 0.0003 (now); actor.lr_schedule: 'constant' (checkpoint) vs 'cosine' (now)" \
           in captured.out
    last = {row["step"]: row for row in read_metrics(out)}
    assert [last[s]["actor/lr"] for s in (2, 3)] == pytest.approx([3e-4 * lr_factor(i, 3, "cosine", 0, 0.0)
                                                                   for i in (1, 2)])
    assert _names(out) == ["damaged_step_00000002", "step_00000001", "step_00000003"]


def test_an_incompatible_checkpoint_is_refused_before_any_model_loads(tiny_qwen2, data_dir, tmp_path, capsys,
                                                                      no_models):
    out, other = tmp_path / "run", tmp_path / "other_model"
    saved = out / "checkpoints" / "step_00000001"  # as a run of another model would have left it
    (saved / "actor" / "hf").mkdir(parents=True)
    (saved / "config.yaml").write_text(to_yaml(load_config(base_overrides(other, data_dir, out, *FAST),
                                                           "recipes/grpo.yaml")))
    write_manifest(saved, 1)
    assert train(tiny_qwen2, data_dir, out, "trainer.total_steps=2") == 2
    assert f"hybridflow train: cannot resume: the checkpoint was saved with an incompatible config:\n  " \
           f"model.path: '{other}' (checkpoint) vs '{tiny_qwen2}' (now)" in capsys.readouterr().err

    # The same model.path, but the directory now holds another architecture.
    (saved / "config.yaml").write_text(to_yaml(load_config(base_overrides(tiny_qwen2, data_dir, out, *FAST),
                                                           "recipes/grpo.yaml")))
    hf = json.loads((tiny_qwen2 / "config.json").read_text())
    (saved / "actor" / "hf" / "config.json").write_text(json.dumps({**hf, "hidden_size": 2 * hf["hidden_size"]}))
    (saved / "COMPLETE").unlink()
    write_manifest(saved, 1)
    assert train(tiny_qwen2, data_dir, out, "trainer.total_steps=2") == 2
    assert f"actor model hidden_size: {2 * hf['hidden_size']} (checkpoint) vs {hf['hidden_size']} (now)" \
           in capsys.readouterr().err


def test_a_full_disk_mid_save_leaves_the_previous_checkpoint_and_the_run_resumes(tiny_qwen2, data_dir, tmp_path,
                                                                                 capsys, monkeypatch):
    from hybridflow.workers.actor import ActorWorker

    out = tmp_path / "run"
    save = ActorWorker.save_checkpoint
    saves = []

    def fills_the_disk(self, role_dir):  # the second save fails half-way, as a full disk does
        saves.append(role_dir)
        save(self, role_dir)
        if len(saves) == 2:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(ActorWorker, "save_checkpoint", fills_the_disk)  # the inline worker runs here
    assert train(tiny_qwen2, data_dir, out, "trainer.total_steps=2", "trainer.save_every=1") == 2
    err = capsys.readouterr().err
    assert f"hybridflow train: cannot save step 2: the disk holding {out}/checkpoints is full (" in err
    assert "save_checkpoint failed: OSError: [Errno 28] No space left on device); the partial checkpoint was " \
           "removed, the previous checkpoints and the logs are intact. Free space and run the same command again " \
           "to resume from step_00000001" in err
    assert _names(out) == ["step_00000001"] and [r["step"] for r in read_metrics(out)] == [1, 2]
    monkeypatch.undo()
    assert train(tiny_qwen2, data_dir, out, "trainer.total_steps=2", "trainer.save_every=1") == 0
    assert f"resumed from {out}/checkpoints/step_00000001 at step 1" in capsys.readouterr().out
    assert _names(out) == ["step_00000001", "step_00000002"]
    assert train(tiny_qwen2, data_dir, out, "trainer.total_steps=2", "trainer.save_every=1") == 0  # done already
    assert "the run is already at step 2 of 2: nothing to train (raise trainer.total_steps to train on)" in \
        capsys.readouterr().out
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 2]


def test_a_full_disk_while_logging_metrics_names_the_file_and_exits_2(tiny_qwen2, data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").symlink_to("/dev/full")  # every write fails with ENOSPC
    assert train(tiny_qwen2, data_dir, out, "trainer.total_steps=1") == 2
    err = capsys.readouterr().err
    assert f"hybridflow train: cannot write {out}/metrics.jsonl: No space left on device (" in err
    assert "Traceback" not in err


def test_a_reward_function_failing_every_row_stops_the_run(tiny_qwen2, data_dir, tmp_path, capsys):
    broken = tmp_path / "broken.py"
    broken.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    raise KeyError('answer')\n")
    out = tmp_path / "run"
    assert train(tiny_qwen2, data_dir, out, "trainer.total_steps=5", f"reward.function={broken}:score",
                 "reward.max_failed_steps=2") == 2
    assert f"hybridflow train: reward function '{broken}:score' failed on every row of 2 training batches in a row " \
           f"(reward.max_failed_steps=2); the first error of the last one: error: KeyError: 'answer'" \
           in capsys.readouterr().err
    assert [r["step"] for r in read_metrics(out)] == [1]


def test_a_stopped_worker_is_reported_with_role_rank_and_pid(tiny_qwen2, data_dir, tmp_path, monkeypatch):
    train_step = rl.RLTrainer.train_step
    stopped = []

    def stop_rank_1(self, prompts):
        if self.step == 1:
            stopped.append(self.roles.actor.pids()[1])
            os.kill(stopped[0], signal.SIGSTOP)
        return train_step(self, prompts)

    monkeypatch.setattr(rl.RLTrainer, "train_step", stop_rank_1)
    cfg = load_config(base_overrides(tiny_qwen2, data_dir, tmp_path, *FAST, "trainer.total_steps=3",
                                     "trainer.n_workers=2", "trainer.worker_timeout_s=3"), "recipes/grpo.yaml")
    trainer = rl.RLTrainer(cfg)
    start = time.monotonic()
    with pytest.raises(WorkerUnresponsiveError) as failed:
        trainer.fit()
    assert time.monotonic() - start < 30
    assert f"worker actor rank 1 (pid {stopped[0]}) is unresponsive: no heartbeat for " in str(failed.value)
    assert "(trainer.worker_timeout_s=3) while the controller waited on generate" in str(failed.value)
    with pytest.raises(ProcessLookupError):  # the group's shutdown killed it
        os.kill(stopped[0], 0)

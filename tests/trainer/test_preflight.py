"""`hybridflow config --command C` makes every check `hybridflow C` makes before any model loads (issue 55) and
writes nothing: a config with problems of several kinds (the config's own, the output directory, the resume
checkpoint, a data row, what the reward function needs of the data, a live run holding the directory, another run's
checkpoints) gets one error listing them all (exit 2); a good one is printed resolved, with no output directory
made, no lock taken and no checkpoint deleted; no worker starts."""

from __future__ import annotations

import json
import socket

import pytest
import yaml
from lock_holder import another_run_holding

from hybridflow import cli
from hybridflow.checkpoint.manifest import write_manifest
from hybridflow.trainer import rl, single_model

RL = ["--config", "recipes/grpo.yaml", "data.train_batch_size=2", "rollout.n=2", "actor.mini_batch_size=null"]


@pytest.fixture(autouse=True)
def no_workers(monkeypatch):
    """Fails a test whose command gets as far as starting worker groups (loading models)."""
    def refuse(*args, **kwargs):
        raise AssertionError("hybridflow config started workers")

    monkeypatch.setattr(rl, "build_roles", refuse)
    monkeypatch.setattr(single_model.SingleModelTrainer, "start_group", refuse)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def problems(err: str) -> list[str]:
    """The problems one `hybridflow config` error lists, after checking its heading counts them."""
    head, *lines = err.strip().splitlines()
    listed = [line.removeprefix("  - ") for line in lines]
    count = "invalid configuration:" if len(listed) == 1 else f"{len(listed)} problems in the configuration:"
    assert head == f"hybridflow config: {count}", err
    assert all(line.startswith("  - ") for line in lines), err
    return listed


def unwritable(path, why: str) -> str:
    return f"output directory {path} is not writable ({why}); choose another trainer.output_dir or fix its permissions"


def test_train_config_lists_the_config_output_dir_resume_and_data_row_problems_at_once(tiny_qwen2, tmp_path,
                                                                                         capsys):
    rows = write_jsonl(tmp_path / "train.jsonl", [{"prompt": [{"role": "user", "content": "2+2?"}]},
                                                  {"question": "3+3?"}])
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    missing = tmp_path / "no_such_checkpoint"
    assert cli.main(["config", *RL, f"model.path={tiny_qwen2}", f"data.train_files={rows}", "actor.ppo_epochs=0",
                     f"trainer.output_dir={blocker}", f"trainer.resume={missing}"]) == 2
    assert problems(capsys.readouterr().err) == [
        "actor.ppo_epochs=0 must be >= 1",
        f"trainer.resume='{missing}': no such checkpoint; valid: auto, never, or an existing path",
        unwritable(blocker, "File exists"),
        f"{rows}, row 1 (line 2): missing column 'prompt' (set data.prompt_key to the column holding it; columns: "
        f"question)"]
    assert blocker.read_text() == "not a directory" and sorted(p.name for p in tmp_path.iterdir()) == \
        ["a_file", "train.jsonl"]


def test_train_config_names_a_live_run_holding_the_dir_beside_the_reward_functions_needs(tiny_qwen2, tmp_path,
                                                                                          capsys):
    rows = write_jsonl(tmp_path / "riddles.jsonl", [{"prompt": [{"role": "user", "content": f"riddle {i}"}],
                                                     "data_source": "my/riddles"} for i in range(2)])
    out = tmp_path / "run"
    out.mkdir()
    with another_run_holding(out) as holder:
        record = (out / ".hybridflow.lock").read_text()
        assert cli.main(["config", *RL, f"model.path={tiny_qwen2}", f"data.train_files={rows}",
                         f"trainer.output_dir={out}"]) == 2
        in_use, reward = problems(capsys.readouterr().err)
        assert in_use.startswith(f"trainer.output_dir={out} is in use by another run: pid {holder.pid} on host "
                                 f"{socket.gethostname()} since ")
        assert in_use.endswith("; wait for it to end, stop it, or choose another trainer.output_dir")
        assert reward.startswith(f"{rows}, row 0 (line 1), column 'data_source': reward.function=auto has no reward "
                                 f"for data_source 'my/riddles'; known data sources: openai/gsm8k -> gsm8k")
        assert (out / ".hybridflow.lock").read_text() == record  # the live run's lock is as it was
        assert holder.poll() is None


def test_a_good_train_config_passes_and_writes_nothing_even_over_another_runs_checkpoints(tiny_qwen2, data_dir,
                                                                                           tmp_path, capsys):
    good = ["config", *RL, f"model.path={tiny_qwen2}", f"data.train_files={data_dir}/train.parquet",
            f"data.val_files={data_dir}/test.parquet"]
    out = tmp_path / "new" / "run"
    assert cli.main([*good, f"trainer.output_dir={out}"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["trainer"]["output_dir"] == str(out)
    assert not (tmp_path / "new").exists()

    old = tmp_path / "old_run"  # a run's checkpoint: this one would mix with it
    step = old / "checkpoints" / "step_00000001"
    step.mkdir(parents=True)
    (step / "config.yaml").write_text("trainer: {}\n")
    write_manifest(step, 1)
    before = sorted(p.relative_to(old) for p in old.rglob("*"))
    assert cli.main([*good, f"trainer.output_dir={old}", "trainer.resume=never"]) == 2
    assert problems(capsys.readouterr().err) == [
        f"{old}/checkpoints holds checkpoints of another run (step_00000001) and this run starts fresh "
        f"(trainer.resume=never): its checkpoints would mix with them. Use another trainer.output_dir, resume the "
        f"newest (trainer.resume=auto), or set trainer.discard_checkpoints=true to delete them"]
    assert cli.main([*good, f"trainer.output_dir={old}", "trainer.resume=never",
                     "trainer.discard_checkpoints=true"]) == 0  # the run would delete it: config does not
    assert sorted(p.relative_to(old) for p in old.rglob("*")) == before


@pytest.mark.parametrize("command", ["sft", "dpo", "rm"])
def test_sft_and_preference_configs_list_every_problem_at_once_and_pass_once_fixed(command, tiny_qwen2, tmp_path,
                                                                                    capsys):
    if command == "sft":
        good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
        bad, bad_row = {"text_only": "oops"}, (
            "no column to learn from: a conversation under 'messages' (data.messages_key), a prompt and a completion "
            "under 'prompt' and 'completion' (data.prompt_key, data.response_key) or text under 'text' "
            "(data.text_key); set the key that names yours. Columns: text_only")
        key_problem = ("optim.passes_per_batch=0", "optim.passes_per_batch=0 must be >= 1")
    else:
        good, bad = {"prompt": "2+2=", "chosen": "4", "rejected": "5"}, {"prompt": "3+3=", "chosen": "6"}
        bad_row = "missing column 'rejected' (set data.rejected_key to the column holding it; columns: prompt, chosen)"
        key_problem = ("dpo.beta=0", "dpo.beta=0.0 must be > 0") if command == "dpo" else \
            ("rm.center_coef=-1", "rm.center_coef=-1.0 must be >= 0")
    rows = write_jsonl(tmp_path / "rows.jsonl", [good, bad])
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    missing = tmp_path / "no_such_checkpoint"
    assert cli.main(["config", "--command", command, f"model.path={tiny_qwen2}", f"data.train_files={rows}",
                     "data.train_batch_size=1", key_problem[0], f"trainer.output_dir={blocker / 'run'}",
                     f"trainer.resume={missing}"]) == 2
    listed = problems(capsys.readouterr().err)
    assert sorted(listed) == sorted([
        key_problem[1], f"trainer.resume='{missing}': no such checkpoint; valid: auto, never, or an existing path",
        unwritable(blocker / "run", "Not a directory"), f"{rows}, row 1 (line 2): {bad_row}"])
    assert listed[-1] == f"{rows}, row 1 (line 2): {bad_row}"  # the data are read last, as the run reads them
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "rows.jsonl"]

    rows = write_jsonl(tmp_path / "rows.jsonl", [good, good])
    out = tmp_path / "new" / "run"
    assert cli.main(["config", "--command", command, f"model.path={tiny_qwen2}", f"data.train_files={rows}",
                     "data.train_batch_size=1", f"trainer.output_dir={out}"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["trainer"]["output_dir"] == str(out)
    assert not (tmp_path / "new").exists()

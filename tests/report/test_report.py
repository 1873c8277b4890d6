"""The run report: synthetic run directories (every branch of what a run may have written) and one
real two-step `hybridflow train` run."""

from __future__ import annotations

import html
import io
import json

import pytest
from PIL import Image

from hybridflow.checkpoint import CheckpointManager
from hybridflow.cli import main as cli_main
from hybridflow.report import PLOTS, ReportError, load_run, write_report
from hybridflow.report.html import render
from hybridflow.report.plots import TIMING_PHASES, draw

PHASES = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "update_weights")


def step_metrics(step: int, critic: bool = False) -> dict:
    row = {"step": step, "reward/mean": 0.1 * step, "reward/max": 1.0, "reward/min": 0.0,
           "response_length/mean": 10.0 + step, "response_length/max": 16, "actor/kl_loss": 0.001 * step,
           "actor/ppo_kl": 0.0005, "actor/entropy": 2.0 - 0.1 * step, "actor/pg_loss": -0.01,
           "actor/grad_norm": 0.5, "timing_s/step": 3.0, **{f"timing_s/{p}": 0.4 for p in PHASES}}
    if critic:
        row.update({"critic/vf_loss": 1.0 / step, "timing_s/values": 0.2, "timing_s/update_critic": 0.3})
    return row


def write_run(root, steps=4, critic=False, samples=True, extra_lines=()):
    root.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": 0, "val/reward/mean": 0.0, "val/gsm8k/reward/mean": 0.0,
                         "val/math/reward/mean": 0.0, "timing_s/val": 1.5})]
    lines += [json.dumps(step_metrics(s, critic)) for s in range(1, steps)]
    lines.append(json.dumps({**step_metrics(steps, critic), "val/reward/mean": 0.75, "val/gsm8k/reward/mean": 0.5,
                             "val/math/reward/mean": 1.0}))
    (root / "metrics.jsonl").write_text("\n".join([*lines, *extra_lines]) + "\n")
    if samples:
        rows = [{"step": 0, "prompt": "What is 2+3?", "response": "It is <b>6</b>", "reward": 0.0,
                 "data_source": "gsm8k"},
                {"step": 0, "prompt": "What is 1+1?", "response": "\n\n", "reward": 0.0, "data_source": "gsm8k"},
                {"step": steps, "prompt": "What is 2+3?", "response": "#### 5 exactly", "reward": 1.0,
                 "data_source": "gsm8k"}]
        (root / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def commit_config(root, step, text):
    manager = CheckpointManager(root)
    tmp = manager.begin(step)
    (tmp / "config.yaml").write_text(text)
    manager.commit(step, tmp)


def assert_png(path):
    data = path.read_bytes()
    with Image.open(io.BytesIO(data)) as img:
        img.verify()
    with Image.open(io.BytesIO(data)) as img:
        assert img.format == "PNG" and img.size[0] >= 400 and img.size[1] >= 200
        assert len(set(img.convert("L").getdata())) > 10  # something was drawn, not a blank canvas


def test_report_has_plots_samples_and_newest_config(tmp_path):
    run = write_run(tmp_path / "run")
    commit_config(run, 2, "algorithm:\n  adv_estimator: rloo\n")
    commit_config(run, 4, "algorithm:\n  adv_estimator: grpo\nrollout:\n  n: 8\n")
    (run / "checkpoints" / "step_00000006").mkdir()  # incomplete (no manifest): ignored
    (run / "checkpoints" / "step_00000006" / "config.yaml").write_text("trainer:\n  broken: true\n")
    page = write_report(run)
    assert page == run / "report.html"
    names = sorted(p.name for p in (run / "report").glob("*.png"))
    assert names == sorted(f"{n}.png" for n in ("reward", "validation", "response_length", "kl", "entropy",
                                                 "timing", "policy_loss", "grad_norm"))
    for png in (run / "report").glob("*.png"):
        assert_png(png)
    text = page.read_text()
    assert "adv_estimator: grpo" in text and "rollout:" in text and "broken" not in text
    assert "step_00000004" in text  # where the config came from
    assert "#### 5 exactly" in text and "What is 2+3?" in text
    assert "It is &lt;b&gt;6&lt;/b&gt;" in text and "<b>6</b>" not in text  # run text is escaped
    assert "&#x27;\\n\\n&#x27;" in text  # a whitespace-only response is shown escaped, not as an empty box
    assert text.count("data:image/png;base64,") == len(names)  # self-contained
    assert "val/math/reward/mean" in text  # per-source validation is drawn


def test_critic_plot_only_for_a_run_with_a_critic(tmp_path):
    spec = next(s for s in PLOTS if s.name == "critic")
    assert draw(load_run(write_run(tmp_path / "a")), spec) is None
    run = load_run(write_run(tmp_path / "b", critic=True))
    assert run.series("critic/vf_loss") == ([1, 2, 3, 4], [1.0, 0.5, 1 / 3, 0.25])
    png, keys = draw(run, spec)
    assert keys == ["critic/vf_loss"] and png.startswith(b"\x89PNG")
    timing = next(s for s in PLOTS if s.name == "timing")
    assert draw(run, timing)[1] == [f"timing_s/{p}" for p in TIMING_PHASES if p in PHASES + ("values", "update_critic")]


def test_resumed_step_keeps_last_line_and_bad_lines_are_reported(tmp_path):
    resumed = json.dumps({**step_metrics(2), "reward/mean": 0.9})
    root = write_run(tmp_path / "run", extra_lines=[resumed, '{"step": 5, "reward/mean": nul', "[1, 2]",
                                                    json.dumps({"reward/mean": 1.0}),
                                                    json.dumps({"step": 7, "actor/entropy": None})])
    run = load_run(root)
    assert run.metrics[2]["reward/mean"] == 0.9
    assert run.steps == [0, 1, 2, 3, 4, 7] and run.metrics[7] == {}  # null (non-finite) values are dropped
    assert run.unreadable == ["metrics.jsonl:7", "metrics.jsonl:8", "metrics.jsonl:9 (no integer 'step')"]
    text = render(run, [])
    assert "Skipped 3 unreadable line(s)" in text and "metrics.jsonl:9 (no integer &#x27;step&#x27;)" in text


def test_missing_pieces_degrade_gracefully(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    (root / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    out = tmp_path / "elsewhere" / "page.html"
    out.parent.mkdir()
    assert write_report(root, out) == out
    text = out.read_text()
    assert "config not recorded" in text and "No samples were logged" in text
    assert [p.name for p in (tmp_path / "elsewhere" / "page").iterdir()] == ["reward.png"]


def test_top_level_config_is_used_without_checkpoints(tmp_path):
    root = write_run(tmp_path / "run", samples=False)
    (root / "config.yaml").write_text("trainer:\n  total_steps: 4\n")
    run = load_run(root)
    assert run.config == {"trainer": {"total_steps": 4}} and run.config_source == root / "config.yaml"


def test_bad_run_dirs_are_refused_with_the_reason(tmp_path, capsys):
    with pytest.raises(ReportError, match="does not exist"):
        write_report(tmp_path / "nope")
    (tmp_path / "tb_only").mkdir()
    assert cli_main(["report", str(tmp_path / "tb_only")]) == 2
    assert "needs 'jsonl' in trainer.loggers" in capsys.readouterr().err
    with pytest.raises(ReportError, match="ending in .html"):
        write_report(write_run(tmp_path / "run"), tmp_path / "report.png")


def test_report_of_a_real_tiny_run(tiny_qwen2, tmp_path, capsys):
    from hybridflow.config.loader import load_config
    from hybridflow.data.gsm8k_synthetic import write_gsm8k_synthetic
    from hybridflow.trainer.rl import train

    data = tmp_path / "data"
    write_gsm8k_synthetic(data, n_train=8, n_val=2, seed=0)
    out = tmp_path / "run"
    train(load_config([f"model.path={tiny_qwen2}", f"data.train_files={data}/train.parquet",
                       f"data.val_files={data}/test.parquet", "data.train_batch_size=2",
                       "data.max_prompt_length=256", "data.max_response_length=8", "rollout.n=2",
                       "actor.lr=1e-4", "trainer.total_steps=2", "actor.mini_batch_size=null",
                       "trainer.val_every=2", "reward.num_workers=1", f"trainer.output_dir={out}"],
                      "recipes/grpo.yaml"))
    assert cli_main(["report", str(out)]) == 0
    assert capsys.readouterr().out.strip().endswith("report.html")
    names = {p.stem for p in (out / "report").glob("*.png")}
    assert {"reward", "validation", "response_length", "kl", "entropy", "timing"} <= names
    assert "critic" not in names
    text = (out / "report.html").read_text()
    assert "adv_estimator: grpo" in text and "kl_loss_coef: 0.001" in text
    sample = json.loads((out / "samples.jsonl").read_text().splitlines()[-1])
    assert html.escape(sample["prompt"]) in text

"""The user docs stay true: links resolve, the verl key table names real keys, the troubleshooting page
quotes messages that still exist, documented commands load and validate, and the custom-loop example
runs and matches the loop the page shows."""

from __future__ import annotations

import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

from hybridflow.config import load_config, validate
from hybridflow.config.loader import schema_fields
from hybridflow.config.preference_schema import DPOConfig
from hybridflow.config.schema import RLConfig
from hybridflow.config.sft_schema import SFTConfig

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = ("index", "quickstart", "custom_loop", "placement", "migrating_from_verl", "troubleshooting", "real_model",
         "agents", "migrating_from_trl", "agents_from_verl_and_trl", "moe", "long_reasoning")
KEYS = set(schema_fields(RLConfig))
PROGRAM_KEYS = KEYS | set(schema_fields(SFTConfig)) | set(schema_fields(DPOConfig))  # train, sft and dpo: the migration pages map to all three


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", path.read_text(), re.M)}


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_and_anchors_resolve(page):
    doc = DOCS / f"{page}.md"
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        assert path.exists(), f"{page}.md links to {target}: no such file"
        if anchor:
            assert anchor in anchors(path), f"{page}.md links to {target}: no such heading"


def test_index_links_every_page_this_task_wrote():
    text = (DOCS / "index.md").read_text()
    for page in PAGES[1:]:
        assert f"]({page}.md" in text


def table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| `")]


def test_verl_table_maps_to_keys_that_exist():
    # the key tables' rows (verl, ours, note); the examples' table beside them has two columns
    rows = [row for row in table_rows((DOCS / "migrating_from_verl.md").read_text()) if len(row) == 3]
    assert len(rows) > 60
    seen = set()
    for verl, ours, _ in rows:
        for token in re.findall(r"`([^`]+)`", ours):
            key = token.split("=", 1)[0]
            if "." in key and not key.endswith(".py"):
                assert key in PROGRAM_KEYS, f"migrating_from_verl.md maps {verl} to unknown key {key}"
                seen.add(key)
    for key in ("data.train_batch_size", "rollout.n", "actor.mini_batch_size", "actor.clip_low", "actor.clip_high",
                "actor.kl_loss_coef", "algorithm.adv_estimator", "algorithm.use_kl_in_reward",
                "algorithm.kl_ctrl.kl_coef", "reward.function", "trainer.total_steps", "trainer.val_every",
                "trainer.save_every"):
        assert key in seen, key


def command_after(text: str, marker: str) -> list[str]:
    """The shell words of the command that follows `marker` in a code block (continuation lines joined)."""
    block = text.split(marker, 1)[1].split("```", 1)[0]
    lines = []
    for line in block.strip().splitlines():
        if line.startswith("#"):
            break
        lines.append(line.rstrip("\\ "))
        if not line.rstrip().endswith("\\"):
            break
    return shlex.split(" ".join(lines).split("#", 1)[0])


def test_translated_verl_script_and_quickstart_commands_validate():
    translated = (DOCS / "migrating_from_verl.md").read_text().split("## A verl GRPO script, translated", 1)[1]
    verl = command_after(translated, "# hybridflow\n")
    assert verl[:4] == ["hybridflow", "train", "--config", "recipes/grpo.yaml"]
    cfg = load_config(verl[4:], ROOT / verl[3])
    validate(cfg, check_paths=False)
    assert cfg.rollout.n == 5 and cfg.trainer.n_workers == 8 and cfg.actor.kl_loss_coef == 0.001
    quick = command_after((DOCS / "quickstart.md").read_text(), "## 3. Train\n\n```bash\n")
    assert quick[:3] == ["hybridflow", "train", "--config"]
    cfg = load_config(quick[4:], ROOT / quick[3])
    validate(cfg, check_paths=False)
    assert cfg.trainer.output_dir == "outputs/grpo_tiny" and "tensorboard" in cfg.trainer.loggers


def test_translated_trl_script_validates():
    page = (DOCS / "migrating_from_trl.md").read_text()
    words = command_after(page, "# hybridflow\n")
    assert words[:4] == ["hybridflow", "train", "--config", "recipes/grpo.yaml"]
    cfg = load_config(words[4:], ROOT / words[3])
    validate(cfg, check_paths=False)
    assert cfg.reward.functions == ["my_rewards.py:accuracy", "my_rewards.py:format_reward"]
    assert cfg.reward.weights == [1.0, 0.2] and cfg.rollout.n == 8 and cfg.actor.clip_high == 0.28
    rows = table_rows(page)
    assert len(rows) > 25
    for _, ours, _ in rows:
        for token in re.findall(r"`([^`]+)`", ours):
            key = token.split("=", 1)[0]
            if "." in key:
                assert key in PROGRAM_KEYS, f"migrating_from_trl.md maps to unknown key {key}"


def test_real_model_page_commands_validate():
    page = (DOCS / "real_model.md").read_text()
    for words in (command_after(page, "--n-val 300\n"), command_after(page.split("## 3.", 1)[1], "```bash\n")):
        assert words[:4] == ["hybridflow", "train", "--config", "recipes/gsm8k_smollm2.yaml"]
        cfg = load_config(words[4:], ROOT / words[3])
        validate(cfg, check_paths=False)
        assert cfg.reward.kwargs == {"method": "flexible"} and cfg.actor.kl_loss_coef == 0.0
    assert cfg.actor.rollout_correction.mode == "token_tis"


def source_text() -> str:
    return "\n".join(p.read_text() for p in (ROOT / "hybridflow").rglob("*.py"))


def test_troubleshooting_quotes_messages_that_exist():
    headings = re.findall(r"^### `(.+?)`", (DOCS / "troubleshooting.md").read_text(), re.M)
    assert len(headings) > 50
    code = source_text()
    for heading in headings:
        for piece in (p.strip() for p in heading.split("…")):
            if piece:
                assert piece in code, f"troubleshooting.md quotes {heading!r}, but {piece!r} is not in hybridflow/"


def test_custom_loop_page_shows_the_example_loop():
    page = (DOCS / "custom_loop.md").read_text()
    shown = page.split("```python\n", 1)[1].split("```", 1)[0]
    example = (ROOT / "examples" / "custom_grpo_loop.py").read_text()
    for line in shown.splitlines():
        assert line.strip() in example, f"custom_loop.md shows a line the example lacks: {line!r}"


def test_custom_loop_example_runs_and_trains(tiny_qwen2, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["custom_grpo_loop.py", "--steps", "2", "--n", "2", "--model", str(tiny_qwen2)])
    runpy.run_path(str(ROOT / "examples" / "custom_grpo_loop.py"), run_name="__main__")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 1", "step 2"]
    assert all("digit share" in line and "pg_loss" in line for line in lines)

"""verl launch scripts, as verl users write them (tests/config/verl_scripts), through `hybridflow migrate`, then
`hybridflow config`, then one tiny step of `hybridflow train` / `hybridflow sft` (issue 55): the shell is worked
out, ``--config-name`` and its ``defaults:`` are followed, the tools, interaction and reward are kept, secrets
stay out of the recipe; and bad input exits 2 with one line."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from hybridflow import cli
from hybridflow.config import load_config
from hybridflow.config.sft_schema import SFTConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "agents" / "adapters"))  # the verl doubles the agent tests use
from verl_doubles import verl_row, write_verl_files  # noqa: E402

CORPUS = Path(__file__).parent / "verl_scripts"
ONE_STEP = ["trainer.total_steps=1", "trainer.n_workers=1", "trainer.device=cpu", "trainer.val_before_train=false",
            "trainer.loggers=[console,jsonl]", "reward.num_workers=0", "data.max_prompt_length=128",
            "data.max_response_length=8", "actor.micro_batch_size=null", "trainer.gpu_memory_utilization=0.9"]


@pytest.fixture
def project(tmp_path, monkeypatch):
    """The corpus in a project of its own (verl's scripts run from the project root), with verl-shaped tool and
    interaction configs and classes beside the Hydra configs, and a HOME without the scripts' data."""
    root = tmp_path / "project"
    shutil.copytree(CORPUS, root / "verl_scripts")
    (root / "pyproject.toml").write_text("[project]\nname = 'my-verl-runs'\n")
    write_verl_files(root / "verl_scripts" / "config")
    monkeypatch.chdir(root)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("TRAIN_BATCH_SIZE", "OFFLOAD", "MODEL", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    return root


def migrate(script: Path, capsys) -> tuple[Path, str, str]:
    """`hybridflow migrate SCRIPT --out R.yaml`: the recipe, its text and what was printed to stderr."""
    recipe = script.with_suffix(".yaml")
    assert cli.main(["migrate", str(script), "--out", str(recipe)]) == 0
    return recipe, recipe.read_text(), capsys.readouterr().err


def test_a_multiturn_script_keeps_its_tools_interaction_and_reward(project, tool_calling_model, capsys, tmp_path):
    recipe, text, err = migrate(project / "verl_scripts" / "run_multiturn_tools.sh", capsys)
    config = project / "verl_scripts" / "config"
    cfg = load_config([], recipe)
    assert cfg.agent.tools == [str(config / "tool_config.yaml")]
    assert cfg.agent.environment == str(config / "interaction_config.yaml")
    assert cfg.reward.function == f"{project / 'verl_scripts' / 'reward.py'}:score_answer"
    assert cfg.agent.max_turns == 2 and cfg.trainer.val_before_train is False  # from the defaults' multiturn_base
    assert cfg.data.max_prompt_length == 128  # from the --config-name YAML
    assert cfg.data.truncation == "filter"  # filter_overlong_prompts=True, whatever truncation='error' says
    assert cfg.data.train_batch_size == 4 and cfg.data.max_response_length == 64 and cfg.rollout.n == 2
    assert cfg.trainer.loggers == ["console", "wandb"] and cfg.rollout.engine == "auto"
    assert "not-a-real-key" not in text and "tok-0123" not in text and cfg.reward.kwargs == {}
    for line in ("#   export WANDB_API_KEY='<not written: a secret>': a secret: set it in the environment of the run",
                 "#   export VLLM_USE_V1='1': an environment variable the script exports",
                 "#   custom_reward_function.reward_kwargs.api_token='<not written: a secret>': holds a secret "
                 "($JUDGE_TOKEN)",
                 "#   trainer.experiment_name=multiturn_$(now): holds a command substitution hybridflow migrate does",
                 "# Read: $(now): a function of the script hybridflow migrate does not run",
                 f"# Read: {config / 'multiturn_grpo.yaml'}: read with its defaults",
                 "# Read: defaults: ppo_trainer: verl's own config",
                 "  n_workers: 1  # trainer.n_gpus_per_node, trainer.nnodes",  # both keys named where they agree
                 "#   actor_rollout_ref.actor.kl_loss_coef=0.001: applies with use_kl_loss=True"):
        assert line in text, line
    assert ("hybridflow migrate: warning: not carried: actor_rollout_ref.rollout.multi_turn.max_user_turns=2: "
            "episodes are bounded by agent.max_turns model turns") in err
    assert "multi_turn.enable" not in err  # carried by the tools and interaction it names
    assert "global_profiler.tool" not in err and "#   global_profiler.tool=torch_memory: hybridflow has no" in text

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(verl_row(i, "42")) + "\n" for i in range(4)))
    # a tiny model whose chat template shows the tools in one short line (the tiny context is short)
    stand_ins = [f"model.path={tool_calling_model}", f"data.train_files=[{data}]", "trainer.loggers=[console,jsonl]"]
    assert cli.main(["config", "--config", str(recipe), *stand_ins]) == 0
    out = tmp_path / "run"
    assert cli.main(["train", "--config", str(recipe), *stand_ins, *ONE_STEP, "agent.max_turns=2",
                     f"trainer.output_dir={out}"]) == 0
    (metrics,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics["agent/env_errors"] == 0 and "agent/turns/mean" in metrics


def test_a_lora_script_passes_config_and_train(project, tiny_qwen2, capsys, tmp_path):
    recipe, text, err = migrate(project / "verl_scripts" / "run_lora.sh", capsys)
    cfg = load_config([], recipe)
    assert cfg.actor.lora.rank == 8 and cfg.actor.lora.alpha == 16 and cfg.actor.ref_param_offload is False
    assert cfg.actor.mini_batch_size == 2 and cfg.rollout.n == 2
    assert cfg.data.train_files == [f"{tmp_path / 'home'}/data/gsm8k/train.parquet"]
    assert ("#   actor_rollout_ref.ref.fsdp_config.param_offload=true: with LoRA (lora_rank > 0) the reference is the "
            "actor's own base weights") in text
    assert "#   actor_rollout_ref.rollout.gpu_memory_utilization=0.4:" in text  # the if's branch taken
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {i} times 7?"}],
                                        "data_source": "openai/gsm8k", "reward_model": {"ground_truth": "42"}}) + "\n"
                            for i in range(4)))
    stand_ins = [f"model.path={tiny_qwen2}", f"data.train_files=[{data}]"]
    assert cli.main(["config", "--config", str(recipe), *stand_ins]) == 0
    assert cli.main(["train", "--config", str(recipe), *stand_ins, *ONE_STEP,
                     f"trainer.output_dir={tmp_path / 'run'}"]) == 0


def test_an_sft_script_becomes_a_recipe_for_hybridflow_sft(project, tiny_qwen2, capsys, tmp_path):
    recipe = project / "verl_scripts" / "run_sft.yaml"
    assert cli.main(["migrate", str(project / "verl_scripts" / "run_sft.sh"), "--out", str(recipe)]) == 0
    assert f"check it with: hybridflow config --command sft --config {recipe}" in capsys.readouterr().out
    text = recipe.read_text()
    assert text.startswith("# Migrated from verl") and "a recipe for `hybridflow sft`" in text.splitlines()[0]
    cfg = load_config([], recipe, schema=SFTConfig)
    assert cfg.data.prompt_key == "extra_info.question" and cfg.data.response_key == "extra_info.answer"
    assert "prompt_key: extra_info.question  # data.prompt_key, data.prompt_dict_keys" in text
    assert cfg.optim.micro_batch_size == 2 and cfg.trainer.n_workers == 1
    assert cfg.optim.use_packing is True and cfg.optim.lr == 1e-4 and cfg.model.path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert "#   trainer.default_local_dir=$2: holds a shell variable neither the script nor the environment sets" in text
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"extra_info": {"index": i, "question": f"{i} + {i}?", "answer": str(2 * i)}})
                            + "\n" for i in range(4)))
    stand_ins = [f"model.path={tiny_qwen2}", f"data.train_files=[{data}]"]
    assert cli.main(["config", "--command", "sft", "--config", str(recipe), *stand_ins]) == 0
    assert cli.main(["sft", "--config", str(recipe), *stand_ins, "trainer.total_steps=1", "trainer.device=cpu",
                     "data.max_length=64", f"trainer.output_dir={tmp_path / 'sft'}"]) == 0


def test_config_reports_every_problem_train_would_refuse_before_a_model_loads(tiny_qwen2, tmp_path, capsys):
    recipe = tmp_path / "lora.yaml"
    recipe.write_text(f"model:\n  path: {tiny_qwen2}\nactor:\n  lora: {{rank: 8}}\n  ref_param_offload: true\n"
                      f"data:\n  train_files: [{tmp_path / 'missing.parquet'}]\n")
    assert cli.main(["config", "--config", str(recipe), "rollout.n=0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridflow config: ") and "problems in the configuration" in err
    assert "actor.ref_param_offload=true offloads the reference model's copy, which a LoRA actor" in err
    assert f"data.train_files: file {tmp_path / 'missing.parquet'} not found" in err
    assert "rollout.n=0" in err
    assert cli.main(["config", "--config", str(recipe), "trainer.device=npu", "rollout.engine=vllm"]) == 2
    err = capsys.readouterr().err  # values outside their choices: all of them at once too
    assert "2 problems in the configuration" in err and "'trainer.device'" in err and "'rollout.engine'" in err
    assert cli.main(["config", "--no-checks", "rollout.n=4"]) == 0  # a partial config printed: no model, no data
    assert yaml.safe_load(capsys.readouterr().out)["rollout"]["n"] == 4
    assert cli.main(["config", "rollout.n=4"]) == 2
    assert "model.path is required" in capsys.readouterr().err


@pytest.mark.parametrize("name, text, message", [
    ("unbalanced.sh", "python3 -m verl.trainer.main_ppo data.train_files='/x.parquet\n",
     "unbalanced.sh: line 1: unbalanced ' (opened here and never closed)"),
    ("no_python.sh", "set -x\necho 'nothing to run'\n",
     "no_python.sh: no python command running verl found (expected a line such as `python3 -m "
     "verl.trainer.main_ppo key=value ...`)"),
    ("binary.sh", b"\xff\xfe\x00python3 -m verl.trainer.main_ppo", "binary.sh: cannot read it (UnicodeDecodeError"),
    ("generate.sh", "python3 -m verl.trainer.main_generation data.path=x\n",
     "runs verl.trainer.main_generation, which hybridflow has no equivalent of"),
    ("missing.sh", None, "missing.sh not found (give a verl shell script or YAML config)"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, name, text, message):
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    elif text is not None:
        path.write_text(text)
    assert cli.main(["migrate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridflow migrate: ") and message in err and err.count("\n") == 1, err


def test_a_verl_class_inside_a_package_is_imported_as_a_module(tmp_path, monkeypatch):
    """verl's tool configs name `verl.tools.gsm8k_tool.Gsm8kTool`, a module of a package with relative imports:
    run from a verl checkout's root, it is imported as part of its package, not executed as a lone file."""
    from hybridflow.agents.adapters.verl_tools import load_class

    package = tmp_path / "checkout" / "mypkg" / "tools"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "base_tool.py").write_text("class BaseTool:\n    kind = 'native'\n")
    (package / "sum_tool.py").write_text("from .base_tool import BaseTool\n\n\nclass SumTool(BaseTool):\n    pass\n")
    monkeypatch.chdir(tmp_path / "checkout")
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_class appends the checkout's root
    cls = load_class("mypkg.tools.sum_tool.SumTool", tmp_path / "configs", "agent.tools[0]")
    assert cls.__name__ == "SumTool" and cls.kind == "native" and cls.__module__ == "mypkg.tools.sum_tool"

"""`hybridflow dpo` and `hybridflow rm` on a tiny random model: learning on held-out pairs, the loss against the
model's own log-probs whatever the micro-batching, every loss type, LoRA, resume, export, config errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from hybridflow.algorithms import compute_preference_loss
from hybridflow.cli import main as cli_main
from hybridflow.config.loader import load_config
from hybridflow.config.preference_schema import DPOConfig, RewardModelTrainConfig
from hybridflow.config.validate import ConfigError
from hybridflow.data.preference_data import policy_rows
from hybridflow.trainer.preference_trainer import DPOTrainer
from pair_helpers import write_pairs
from rl_helpers import reward_file

ROOT = Path(__file__).resolve().parents[2]


def overrides(model, pairs, out, *extra):
    return [f"model.path={model}", f"data.train_files={pairs['train']}", "data.train_batch_size=16", "optim.lr=1e-3",
            f"trainer.output_dir={out}", "trainer.loggers=[jsonl]", *extra]


def read_metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_dpo_widens_the_margin_on_held_out_pairs_and_resumes_with_its_reference(tiny_qwen2, pairs, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    common = overrides(tiny_qwen2, pairs, tmp_path, f"data.val_files={pairs['val']}", "data.val_batch_size=5",
                       "optim.mini_batch_size=8", "trainer.val_every=3", "trainer.val_before_train=true")
    assert cli_main(["dpo", "--config", "recipes/preference/dpo.yaml", *common, "optim.lr_warmup_steps=0",
                     "trainer.total_steps=3"]) == 0
    assert "reference log-probs of 64 pairs" in capsys.readouterr().out
    reference = torch.load(next((tmp_path / "checkpoints").glob("step_*")) / "controller.pt")["reference_val"]
    resumed = DPOTrainer(load_config([*common, "optim.lr_warmup_steps=0", "trainer.total_steps=6"],
                                     ROOT / "recipes/preference/dpo.yaml", schema=DPOConfig))
    assert resumed.step == 3 and "reference log-probs" not in capsys.readouterr().out
    assert torch.equal(resumed.reference["val"].values, reference["values"])  # the starting model's, kept
    resumed.fit()
    rows = read_metrics(tmp_path)
    val = [r for r in rows if "val/dpo/margin" in r]
    assert [r["step"] for r in val] == [0, 3, 6]
    assert val[0]["val/dpo/margin"] == 0.0 and val[0]["val/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert val[-1]["val/dpo/margin"] > val[1]["val/dpo/margin"] > 0.05 and val[-1]["val/dpo/accuracy"] >= 0.9
    train = [r for r in rows if "train/loss" in r]
    for key in ("dpo/margin", "dpo/accuracy", "dpo/rewards/chosen", "dpo/rewards/rejected", "dpo/logps/chosen",
                "train/grad_norm", "perf/throughput"):
        assert all(key in r for r in train), key
    assert train[-1]["dpo/rewards/chosen"] > 0 > train[-1]["dpo/rewards/rejected"]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    start = AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    assert any(not torch.equal(p, start.state_dict()[n]) for n, p in exported.state_dict().items())


def test_simpo_loss_is_that_of_the_models_log_probs_whatever_the_micro_batching(tiny_qwen2, tmp_path):
    """Plain pairs in renamed columns, without the chat template, one pair per forward: the first step's loss is
    SimPO of the Hugging Face model's own log-probs of the batch."""
    from transformers import AutoModelForCausalLM

    keys = ("question", "good", "bad")
    data = write_pairs(tmp_path / "plain.jsonl", 6, seed=3, conversational=False, keys=keys)
    cfg = load_config([f"model.path={tiny_qwen2}", f"data.train_files={data}", "data.prompt_key=question",
                       "data.chosen_key=good", "data.rejected_key=bad", "data.apply_chat_template=false",
                       "data.train_batch_size=6", "data.shuffle=false", "optim.micro_batch_size=1",
                       "dpo.loss_type=simpo", "dpo.beta=2.5", "dpo.simpo_gamma=0.7", "trainer.total_steps=1",
                       f"trainer.output_dir={tmp_path / 'out'}", "trainer.loggers=[jsonl]"], schema=DPOConfig)
    trainer = DPOTrainer(cfg)
    assert trainer.reference == {}  # SimPO compares with no reference
    batch = trainer.train_loader.batch_at(0, 0)
    metrics = trainer.fit()
    rows = policy_rows(batch.tensors, trainer.pad_id)
    width = rows["response_mask"].shape[1]
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2).eval()
    with torch.no_grad():
        logits = model(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"],
                       position_ids=rows["position_ids"]).logits[:, -width - 1:-1]
    token_logps = torch.log_softmax(logits.float(), -1).gather(-1, rows["input_ids"][:, -width:, None])[..., 0]
    mask = rows["response_mask"]
    sums, tokens = (token_logps * mask).sum(-1).view(-1, 2), mask.sum(-1).view(-1, 2)
    expected = compute_preference_loss("simpo", sums[:, 0], sums[:, 1], tokens[:, 0], tokens[:, 1], beta=2.5,
                                       simpo_gamma=0.7)
    assert metrics["train/loss"] == pytest.approx(float(expected.losses.mean()), rel=1e-4)
    margin = expected.chosen_rewards - expected.rejected_rewards
    assert metrics["dpo/margin"] == pytest.approx(float(margin.mean()), rel=1e-4, abs=1e-6)
    resolved = load_config([], tmp_path / "out" / "resolved_config.yaml", schema=DPOConfig)  # what the worker ran with
    assert resolved.dpo.loss_type == "simpo" and resolved.optim.micro_batch_size == 1
    assert resolved.model.gradient_checkpointing is False and resolved.model.dtype == "fp32"


@pytest.mark.parametrize("loss_type,extra", [
    ("ipo", ["optim.lora.rank=4", "optim.lora.alpha=8", "optim.lr=1e-2", "data.max_length=35",
             "data.truncation=filter", "optim.max_tokens_per_micro_batch=80", "data.seed=3"]),
    # two ranks sharing 15 pairs (8 and 7), a last validation batch of one pair (padded over the ranks)
    ("orpo", ["optim.passes_per_batch=2", "dpo.beta=0.5", "trainer.n_workers=2", "data.train_batch_size=15",
              "data.val_batch_size=5", "optim.micro_batch_size=2"]),
])
def test_ipo_with_lora_and_orpo_train(tiny_qwen2, pairs, tmp_path, loss_type, extra):
    from transformers import AutoModelForCausalLM

    metrics = DPOTrainer(load_config(overrides(tiny_qwen2, pairs, tmp_path, f"dpo.loss_type={loss_type}",
                                               f"data.val_files={pairs['val']}", "trainer.total_steps=3", *extra),
                                     schema=DPOConfig)).fit()
    assert metrics["val/dpo/accuracy"] > 0.5
    train = [r for r in read_metrics(tmp_path) if "train/loss" in r]
    assert len(train) == 3 and all(math.isfinite(r["train/loss"]) for r in train)
    assert train[-1]["dpo/margin"] > train[0]["dpo/margin"] and metrics["train/grad_norm"] > 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")  # with LoRA: the adapters merged in
    start = AutoModelForCausalLM.from_pretrained(tiny_qwen2).state_dict()
    assert any(not torch.equal(p, start[n]) for n, p in exported.state_dict().items())


def test_reward_model_ranks_held_out_pairs_as_the_rl_reward_model_scores_them(trained_reward_model, pairs):
    from hybridflow.rewards.model_reward import ModelReward

    rows = read_metrics(trained_reward_model)
    before, after = rows[0], rows[-1]
    assert before["step"] == 0 and after["val/rm/accuracy"] >= 0.9 > before["val/rm/accuracy"]
    for key in ("rm/margin", "rm/accuracy", "rm/score/chosen", "rm/score/rejected", "train/loss"):
        assert key in after, key
    reward = ModelReward(str(trained_reward_model / "hf"))  # what reward.reward_model.path loads
    held_out = [json.loads(line) for line in pairs["val"].read_text().splitlines()]
    scores = {side: torch.tensor(reward.score(reward.format_texts([r["prompt"] for r in held_out],
                                                                  [r[side][0]["content"] for r in held_out])))
              for side in ("chosen", "rejected")}
    margin = scores["chosen"] - scores["rejected"]
    assert float((margin > 0).float().mean()) == pytest.approx(after["val/rm/accuracy"])
    assert float(margin.mean()) == pytest.approx(after["val/rm/margin"], rel=1e-4)
    resolved = load_config([], trained_reward_model / "resolved_config.yaml", schema=RewardModelTrainConfig)
    assert resolved.rm.center_coef == 0.01 and resolved.model.compile is False


def test_the_trained_reward_model_serves_an_rl_run(trained_reward_model, tiny_qwen2, data_dir, tmp_path):
    out = tmp_path / "rl"
    assert cli_main(["train", f"model.path={tiny_qwen2}", f"data.train_files={data_dir}/train.parquet",
                     "data.train_batch_size=2", "rollout.n=2", "data.max_response_length=8", "trainer.total_steps=2",
                     "trainer.val_before_train=false", "trainer.loggers=[jsonl]", "reward.num_workers=0",
                     f"reward.function={reward_file(tmp_path, '0.0')}", f"trainer.output_dir={out}",
                     f"reward.reward_model.path={trained_reward_model}/hf"]) == 0
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:  # the function scores 0: every reward is the model's score
        assert row["reward/mean"] == pytest.approx(row["reward/model/mean"]) and row["reward/model/mean"] != 0


def test_config_errors_name_the_keys(tiny_qwen2, pairs, tmp_path):
    cfg = load_config(overrides(tiny_qwen2, pairs, tmp_path, "dpo.beta=0", "data.max_length=64",
                                "optim.max_tokens_per_micro_batch=100"), schema=DPOConfig)
    with pytest.raises(ConfigError) as err:
        DPOTrainer(cfg)
    assert "dpo.beta=0.0 must be > 0" in str(err.value)
    assert "optim.max_tokens_per_micro_batch=100 is below 2 x data.max_length=64" in str(err.value)
    with pytest.raises(ConfigError, match="did you mean 'dpo.loss_type'"):
        load_config(["dpo.loss=ipo"], schema=DPOConfig)
    with pytest.raises(ConfigError, match="dpo.loss_type.*sigmoid"):
        load_config(["dpo.loss_type=kto"], schema=DPOConfig)
    assert cli_main(["rm", *overrides(tiny_qwen2, pairs, tmp_path, "optim.lora.rank=8")]) == 2


def test_recipes_load_and_docs_reference_the_schemas():
    from hybridflow.config.config_docs import render_sections

    for recipe, schema in (("dpo", DPOConfig), ("simpo", DPOConfig), ("reward_model", RewardModelTrainConfig)):
        load_config([], ROOT / "recipes" / "preference" / f"{recipe}.yaml", schema=schema)
    docs = (ROOT / "docs" / "preference.md").read_text()
    for schema in (DPOConfig, RewardModelTrainConfig):
        assert render_sections(schema).strip() in docs


def test_config_runs_the_preference_checks_before_any_model_loads(tiny_qwen2, pairs, tmp_path, capsys):
    """`hybridflow config --command dpo|rm` runs the checks `hybridflow dpo|rm` runs first and lists every problem in
    one line (exit 2); a recipe that passes is printed resolved, and no output directory is made."""
    bad = overrides(tiny_qwen2, pairs, tmp_path / "dpo", "dpo.beta=0", "data.max_length=64",
                    "optim.max_tokens_per_micro_batch=100")
    assert cli_main(["config", "--command", "dpo", "--config", "recipes/preference/dpo.yaml", *bad]) == 2
    err = capsys.readouterr().err
    assert "dpo.beta=0.0 must be > 0" in err and "optim.max_tokens_per_micro_batch=100 is below 2 x" in err
    assert cli_main(["config", "--command", "rm", *overrides(tiny_qwen2, pairs, tmp_path / "rm", "optim.lora.rank=8",
                                                              "rm.center_coef=-1")]) == 2
    err = capsys.readouterr().err
    assert "optim.lora.rank=8: reward-model training" in err and "rm.center_coef=-1.0 must be >= 0" in err
    assert cli_main(["config", "--command", "dpo", "--config", "recipes/preference/dpo.yaml",
                     *overrides(tiny_qwen2, pairs, tmp_path / "ok")]) == 0
    assert "loss_type:" in capsys.readouterr().out and not (tmp_path / "ok").exists()

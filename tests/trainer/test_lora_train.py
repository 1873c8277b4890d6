"""LoRA through `hybridflow train`, `hybridflow sft` and `hybridflow export`: a LoRA GRPO run learns (the reward
rises), resumes exactly (adapters, optimizer state, mini-batch shuffle), gives the same metrics with the rollout
on its own processes (whose syncs carry the merged adapted weights alone), and its checkpoint exports as a peft
adapter directory and as a merged model that both give the trained policy's log-probs; LoRA SFT writes a merged
`hf/`."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridflow.checkpoint import load_worker_state, main_export
from hybridflow.cli import main as cli_main
from hybridflow.config.model_schema import LoraConfig, ModelConfig
from hybridflow.config.schema import ActorConfig
from hybridflow.engine.train import TrainEngine
from hybridflow.utils.tiny_model import build_tiny_model
from rl_helpers import read_metrics, reward_file, run
from test_rl_resume_and_backends import assert_same_metrics

LORA = ("actor.lora.rank=8", "actor.lora.alpha=16")
QUIET = ("trainer.val_before_train=false", "trainer.val_every=0", "reward.num_workers=0", "trainer.loggers=[jsonl]")
DIGITS = "sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)"


@pytest.fixture(scope="module")
def sharp_model(tmp_path_factory):
    """A random tiny Qwen2 whose untied output head has std 0.2 (10x the usual init). Under the final RMSNorm,
    a random decoder moves std-0.02 logits by about 1 at most, whatever its weights: adapters in the decoder
    could not change such a model's (near-uniform) output distribution, which training the head would."""
    path = build_tiny_model(tmp_path_factory.mktemp("sharp"), tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    model.save_pretrained(path)
    return path


def test_lora_grpo_learns(sharp_model, data_dir, tmp_path):
    """GRPO with the KL loss of recipes/grpo.yaml (the reference: the base weights, adapters disabled) and a
    reward with signal on a random model (the share of digits in the response, ~4% by chance)."""
    rows = run(sharp_model, data_dir, tmp_path / "run", *LORA, *QUIET, "actor.lr=2e-3", "trainer.total_steps=10",
               "data.train_batch_size=8", "rollout.n=4", f"reward.function={reward_file(tmp_path, DIGITS)}")
    rewards = [r["reward/mean"] for r in rows]
    assert len(rewards) == 10 and all(r["actor/kl_loss"] >= 0 for r in rows)
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.3, rewards
    assert all(r["rollout_corr/k3_kl"] < 1e-6 for r in rows)  # the engine sampled from the trained policy


def test_lora_resume_continues_exactly(tiny_qwen2, data_dir, tmp_path):
    common = (*LORA, *QUIET, "actor.kl_loss_coef=0.1", "actor.mini_batch_size=1", "actor.lr=1e-2",
              f"reward.function={reward_file(tmp_path)}")
    straight = run(tiny_qwen2, data_dir, tmp_path / "straight", *common, "trainer.total_steps=4")
    run(tiny_qwen2, data_dir, tmp_path / "resumed", *common, "trainer.total_steps=2")
    role = tmp_path / "resumed" / "checkpoints" / "step_00000002" / "actor"
    assert (role / "adapter_config.json").is_file()
    resumed = run(tiny_qwen2, data_dir, tmp_path / "resumed", *common, "trainer.total_steps=4")
    for step in (3, 4):
        assert_same_metrics(straight[step - 1], resumed[step - 1])


def test_lora_separate_rollout_gives_the_colocated_metrics(tiny_qwen2, data_dir, tmp_path):
    # lr 0.1: large enough that step 3's samples differ if a sync delivers stale or unmerged weights
    common = (*LORA, *QUIET, "trainer.total_steps=3", "actor.lr=0.1", f"reward.function={reward_file(tmp_path)}")
    colocated = run(tiny_qwen2, data_dir, tmp_path / "colocate", *common)
    separate = run(tiny_qwen2, data_dir, tmp_path / "separate", *common, "rollout.placement=separate")
    for a, b in zip(colocated, separate):
        assert_same_metrics(a, b)


def test_lora_checkpoint_exports_an_adapter_directory_and_a_merged_model(tiny_qwen2, data_dir, tmp_path, capsys):
    from peft import PeftModel

    base = shutil.copytree(tiny_qwen2, tmp_path / "base")  # removed at the end: a merge needs it, an adapter not
    run(base, data_dir, tmp_path / "run", *LORA, *QUIET, "actor.lr=5e-2", "trainer.total_steps=2",
        f"reward.function={reward_file(tmp_path)}")
    role = tmp_path / "run" / "checkpoints" / "step_00000002" / "actor"
    assert main_export([str(tmp_path / "run"), str(tmp_path / "adapter")]) == 0
    assert main_export([str(tmp_path / "run"), str(tmp_path / "merged"), "--merge"]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= \
        {p.name for p in (tmp_path / "adapter").iterdir()}
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str(base)

    model_cfg = ModelConfig(path=str(tiny_qwen2), dtype="fp32")
    engine = TrainEngine(model_cfg, ActorConfig(lora=LoraConfig(rank=8, alpha=16)))
    load_worker_state(role, engine.model, trainable_only=True)
    ids = torch.randint(4, 260, (2, 12), generator=torch.Generator().manual_seed(0))  # not the order-dependent global
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "response_mask": torch.ones(2, 6)}
    trained = engine.infer(batch)["log_probs"]
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_qwen2), tmp_path / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    # peft adds B(Ax) as we do; the merged model multiplies by W + BA, rounded once more in fp32 (up to 1.9e-5 seen)
    for model, atol in ((peft_model, 1e-5), (merged, 1e-4)):
        with torch.no_grad():
            logp = model(input_ids=ids).logits[:, 5:-1].float().log_softmax(-1).gather(-1, ids[:, 6:, None])[..., 0]
        torch.testing.assert_close(logp, trained, atol=atol, rtol=0)
    assert (trained - TrainEngine(model_cfg).infer(batch)["log_probs"]).abs().max() > 1e-3  # it did train

    shutil.rmtree(base)
    assert main_export([str(tmp_path / "run"), str(tmp_path / "adapter2")]) == 0
    assert main_export([str(tmp_path / "run"), str(tmp_path / "merged2"), "--merge"]) == 1
    assert f"the run started from '{base}', which is not there: pass its path (--model)" in capsys.readouterr().err


def test_lora_sft_trains_the_adapters_and_writes_a_merged_model(tiny_qwen2, chats, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    args = [f"model.path={tiny_qwen2}", f"data.train_files={chats}", "data.train_batch_size=4", "optim.lr=1e-2",
            "trainer.total_steps=4", f"trainer.output_dir={tmp_path}", "optim.lora.rank=4", "optim.lora.alpha=4",
            "optim.lora.dropout=0.1", "optim.lora.init=gaussian", "optim.lora.target_modules=[q_proj,down_proj]"]
    assert cli_main(["sft", *args]) == 0
    train = [r["train/loss"] for r in read_metrics(tmp_path) if "train/loss" in r]
    assert len(train) == 4 and train[-1] < train[0]
    role = next((tmp_path / "checkpoints").iterdir()) / "sft"
    saved = FileSystemReader(str(role / "model")).read_metadata().state_dict_metadata
    tensors = [k for k in saved if not k.startswith("_")]
    assert tensors and all(".lora_" in k and k.split(".")[-4] in ("q_proj", "down_proj") for k in tensors)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    start = AutoModelForCausalLM.from_pretrained(tiny_qwen2).state_dict()
    changed = {n.rsplit(".", 2)[-2] for n, p in exported.items() if not torch.equal(p, start[n])}
    assert changed == {"q_proj", "down_proj"}  # the adapters merged into their modules, nothing else moved


def test_a_changed_base_model_is_refused_on_resume_and_merge(tiny_qwen2, data_dir, tmp_path, capsys):
    """The same `model.path`, other weights: the adapters would silently make another model."""
    from rl_helpers import base_overrides

    base = shutil.copytree(tiny_qwen2, tmp_path / "base")
    out = tmp_path / "run"
    args = ["train", "--config", "recipes/grpo.yaml",
            *base_overrides(base, data_dir, out, *LORA, *QUIET, f"reward.function={reward_file(tmp_path)}")]
    assert cli_main([*args, "trainer.total_steps=1"]) == 0
    assert cli_main([*args, "trainer.total_steps=2"]) == 0  # the same base: resumes
    model = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.add_(0.01)  # one tensor of the base changes, shapes stay
    model.save_pretrained(base)
    capsys.readouterr()
    assert cli_main([*args, "trainer.total_steps=3"]) == 2
    err = capsys.readouterr().err
    assert "cannot resume" in err and "The adapters only fit the weights they were trained on" in err
    assert f"the base model of the LoRA role 'actor' changed: the checkpoint's adapters were trained on {base} (1 " \
           f"weight files" in err
    assert main_export([str(out), str(tmp_path / "merged"), "--merge"]) == 1
    assert "merging them would write another model than the one trained" in capsys.readouterr().err
    assert main_export([str(out), str(tmp_path / "adapter")]) == 0
    assert "warning: the base model of the LoRA role 'actor' changed" in capsys.readouterr().err

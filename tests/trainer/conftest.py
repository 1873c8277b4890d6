"""Fixtures of the trainer tests: a tiny verl-format GSM8K-style dataset, a few SFT conversations, preference
pairs and a reward model trained on them, the metrics of one local run that the Ray backend's runs must
reproduce, and a record of every optimizer step the in-process engines take."""

from __future__ import annotations

import json

import pytest
import torch

from hybridflow.data.gsm8k_synthetic import write_gsm8k_synthetic
from hybridflow.engine.train import TrainEngine
from hybridflow.engine.train.quantized_base import dense
from pair_helpers import write_pairs
from rl_helpers import TWO_WORKERS, read_metrics, run
from session_cache import built_once


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("gsm8k")
    write_gsm8k_synthetic(out, n_train=16, n_val=4, seed=0)
    return out


@pytest.fixture(scope="session")
def stopping_qwen2(tiny_qwen2, tmp_path_factory):
    """The tiny Qwen2 with its end-of-sequence logit raised (its tied output row set along the mean final hidden
    state), so sampled responses to the GSM8K-style prompts mostly stop within 16 tokens, long-tailed: partial
    rollouts carry the long ones."""
    import shutil

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    ids = torch.randint(4, model.config.vocab_size, (16, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mean = model(ids, output_hidden_states=True).hidden_states[-1].reshape(-1, model.config.hidden_size).mean(0)
        model.lm_head.weight[model.config.eos_token_id] = 4.5 * mean / mean.dot(mean)
    out = tmp_path_factory.mktemp("stopping_qwen2")
    model.save_pretrained(out)
    for f in tiny_qwen2.iterdir():
        if f.suffix in (".json", ".jinja") and f.name != "config.json":
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("sft") / "chats.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"copy {w}"}, {"role": "assistant", "content": w}]}
            for w in ["abc", "hello", "xyz", "qqq", "test", "foo", "bar", "baz"]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def pairs(tmp_path_factory):
    """Conversational preference pairs: `train` (48) and held-out `val` (16) jsonl files."""
    out = tmp_path_factory.mktemp("pairs")
    return {"train": write_pairs(out / "train.jsonl", 48, seed=0), "val": write_pairs(out / "val.jsonl", 16, seed=1)}


@pytest.fixture(scope="session")
def trained_reward_model(tiny_qwen2, pairs, tmp_path_factory):
    """The output dir of `hybridflow rm` trained on `pairs` (its metrics; `hf/` the reward model), trained once
    per test run."""
    return built_once(tmp_path_factory, "rm", lambda out: _train_reward_model(tiny_qwen2, pairs, out))


def _train_reward_model(tiny_qwen2, pairs, out) -> None:
    from hybridflow.cli import main as cli_main

    assert cli_main(["rm", "--config", "recipes/preference/reward_model.yaml", f"model.path={tiny_qwen2}",
                     f"data.train_files={pairs['train']}", f"data.val_files={pairs['val']}", "data.train_batch_size=16",
                     "optim.lr=1e-3", "optim.lr_warmup_steps=0", "rm.center_coef=0.01", "trainer.total_steps=9",
                     "trainer.val_before_train=true", "trainer.val_every=9", "trainer.loggers=[jsonl]",
                     f"trainer.output_dir={out}"]) == 0


@pytest.fixture(scope="session")
def local_two_workers(tiny_qwen2, data_dir, tmp_path_factory):
    """The metrics rows of a 2-step GRPO run with 2 workers on the local backend (`TWO_WORKERS`), run once per
    test run."""
    return read_metrics(built_once(tmp_path_factory, "local_two_workers",
                                   lambda out: run(tiny_qwen2, data_dir, out, *TWO_WORKERS)))


@pytest.fixture
def engine_steps(monkeypatch):
    """Every optimizer step of the engines in this process (one-worker groups run inline), by head (`lm`: the
    actor or SFT, `value`: the critic): dicts of `rows` (this step's mini-batch), `lr`, `grad_norm` (before
    clipping), `changed` (the step changed the weights), `frozen_changed` (it changed a weight that does not
    require grad), `trained_share` (of the parameters, those that train) and `position` (the lr scheduler's,
    after the step)."""
    steps: dict[str, list[dict]] = {}
    train_step = TrainEngine.train_step

    def recording(self, batch, *args, **kwargs):
        params = list(self.model.parameters())
        before = [dense(p.detach()).clone() for p in params]  # a 4-bit base compared dequantized (NF4 has no clone)
        result = train_step(self, batch, *args, **kwargs)
        moved = [not torch.equal(old, dense(new.detach())) for old, new in zip(before, params)]
        trained = sum(p.numel() for p in params if p.requires_grad) / sum(p.numel() for p in params)
        steps.setdefault(self.head, []).append({"rows": len(batch["input_ids"]), "lr": result["lr"],
                                                "grad_norm": result["grad_norm"], "changed": any(moved),
                                                "frozen_changed": any(m for m, p in zip(moved, params)
                                                                      if not p.requires_grad),
                                                "trained_share": trained, "position": self.scheduler.last_epoch})
        return result

    monkeypatch.setattr(TrainEngine, "train_step", recording)
    return steps

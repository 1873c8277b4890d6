"""tinker-cookbook's own recipes (0.5.8's `sl_loop`, `rl_loop`, `preference/dpo`, `distillation/on_policy_distillation`,
unchanged) against `hybridflow serve`, 2 steps each, through their `main` with `base_url` and `model_name` set. What
this machine cannot reach is replaced through public seams: the served model is a tiny Qwen3 under the recipes'
name `Qwen/Qwen3-8B`, whose tokenizer the cookbook's own `register_tokenizer` provides; the hub datasets (No Robots,
GSM8K) are local `DatasetDict`s given to `datasets.load_dataset`; the RL recipe's GSM8K grader, which a random
model never satisfies (so every group would be skipped and nothing trained), is a reward with signal."""

from __future__ import annotations

import contextlib
import json

import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("tinker_cookbook")

from tests.serve.conftest import API_KEY, start_server  # noqa: E402

NAME = "Qwen/Qwen3-8B"  # a name the cookbook's model registry knows (its renderer: qwen3)
ROWS = [{"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
        for a in range(6) for b in range(6)]


@contextlib.contextmanager
def _serving(model_dir, tmp_path, monkeypatch, **more_models):
    """A server of `model_dir` as NAME (and `more_models`, {name: directory}), each name's tokenizer registered with
    the cookbook, and every `tinker.ServiceClient` the recipes make closed at the end: they never close theirs, whose
    heartbeat threads would then post to the stopped server until the interpreter exits."""
    from transformers import AutoTokenizer
    from tinker_cookbook import tokenizer_utils

    server, stop = start_server(model_dir, tmp_path / "checkpoints", name=NAME, more_models=more_models)
    for name in (NAME, *more_models):
        tokenizer_utils.register_tokenizer(name, lambda: AutoTokenizer.from_pretrained(model_dir))
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)  # what the recipes' ServiceClient reads
    made = []

    class Recorded(tinker.ServiceClient):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(tinker, "ServiceClient", Recorded)
    try:
        yield server
    finally:
        for client in made:
            client.close("success").result(30)
        stop()


@pytest.fixture()
def served(tiny_model_factory, tmp_path, monkeypatch):
    with _serving(tiny_model_factory("qwen3"), tmp_path, monkeypatch) as server:
        yield server


def _local_datasets(monkeypatch, splits):
    import datasets

    local = datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()})
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: local)


def _adapters_trained(server) -> bool:
    (model,) = [m for m in server.service.models.values() if m.base == NAME]
    return any(p.abs().sum() > 0 for n, p in model.trainee.model.named_parameters() if "lora_B" in n)


def _metrics(log_path):
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def test_the_cookbooks_sl_loop_trains_two_steps(served, tmp_path, monkeypatch):
    from tinker_cookbook.recipes import sl_loop

    chats = [{"messages": [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]}
             for r in ROWS]
    _local_datasets(monkeypatch, {"train": chats})
    sl_loop.main(sl_loop.Config(base_url=served.url, model_name=NAME, log_path=str(tmp_path / "sl"), batch_size=8,
                                max_steps=2, save_every=0, max_length=128))
    rows = [r for r in _metrics(tmp_path / "sl") if "train_mean_nll" in r]
    assert [r["step"] for r in rows] == [0, 1] and all(r["train_mean_nll"] > 0 for r in rows)
    assert _adapters_trained(served)
    assert {c["name"] for c in map(json.loads, (tmp_path / "sl" / "checkpoints.jsonl").read_text().splitlines())} \
        == {"final"}  # the recipe's final save_state and save_weights_for_sampler, served


def test_the_cookbooks_rl_loop_trains_two_steps(served, tmp_path, monkeypatch):
    from tinker_cookbook.recipes import rl_loop

    _local_datasets(monkeypatch, {"train": ROWS, "test": ROWS[:4]})
    monkeypatch.setattr(rl_loop, "get_reward", lambda response, answer: sum(c.isdigit() for c in response) / 16)
    rl_loop.main(rl_loop.Config(base_url=served.url, model_name=NAME, log_path=str(tmp_path / "rl"), batch_size=4,
                                group_size=4, max_tokens=16, max_steps=2, save_every=0))
    rows = _metrics(tmp_path / "rl")
    assert [r["step"] for r in rows] == [0, 1] and all("reward/total" in r for r in rows)
    assert _adapters_trained(served)  # its importance_sampling forward_backward and optim_step ran


def test_the_cookbooks_sampler_nll_evaluator_scores_as_its_trainer_side_one(served):
    """`SamplerNLLEvaluator` scores held-out data through `compute_logprobs` (the path of the cookbook's DPO reference
    and distillation teacher); its NLL equals the one `NLLEvaluator` computes through the trainer's `forward`."""
    import asyncio
    import warnings

    from tinker_cookbook.supervised.nll_evaluator import NLLEvaluator, SamplerNLLEvaluator

    from tests.serve.conftest import TOKENS, datum

    client = tinker.ServiceClient(base_url=served.url, api_key=API_KEY)  # closed by the fixture
    trainer = client.create_lora_training_client(base_model=NAME, rank=2).result()
    data = [datum(TOKENS[i:i + 8 + 2 * i], weights=[0.0] * 3 + [1.0] * (4 + 2 * i)) for i in range(4)]
    sampler = client.create_sampling_client(base_model=NAME).result()
    with warnings.catch_warnings():  # 0.5.8 calls the SDK's deprecated async spellings, and deprecates NLLEvaluator
        warnings.simplefilter("ignore", FutureWarning)
        sampled = asyncio.run(SamplerNLLEvaluator(data)(sampler))
        trained = asyncio.run(NLLEvaluator(data)(trainer))
    assert sampled["test/nll"] > 0
    assert sampled["test/nll"] == pytest.approx(trained["test/nll"], abs=1e-4)


def test_the_cookbooks_dpo_recipe_trains_two_steps(served, tmp_path, monkeypatch):
    """`recipes/preference/dpo/train.py` on Anthropic HH's layout: its reference model is the initial weights' sampling
    client, scored through `compute_logprobs`, and its loss a `forward_backward_custom` (the SDK's client-side path)."""
    from tinker_cookbook.recipes.preference.dpo import train

    pairs = [{"chosen": f"\n\nHuman: What is {a} plus {b}?\n\nAssistant: {a + b}.",
              "rejected": f"\n\nHuman: What is {a} plus {b}?\n\nAssistant: {a * b + 1}."}
             for a in range(5) for b in range(5)]
    _local_datasets(monkeypatch, {"train": pairs, "test": pairs[:4]})
    train.cli_main(train.CLIConfig(model_name=NAME, dataset="hhh", base_url=served.url, log_path=str(tmp_path / "dpo"),
                                   batch_size=4, max_length=128, max_steps=2, behavior_if_log_dir_exists="delete"))
    rows = [r for r in _metrics(tmp_path / "dpo") if "dpo_loss" in r]
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["dpo_loss"] == pytest.approx(0.6931, abs=1e-3)  # log 2: the policy starts as its reference
    assert _adapters_trained(served)


def test_the_cookbooks_on_policy_distillation_trains_two_steps(tiny_model_factory, tmp_path, monkeypatch):
    """`recipes/distillation/on_policy_distillation.py`: the student samples, a second served base (the same tiny
    shape, other weights) scores the samples through `compute_logprobs`, and the student trains on that reverse KL."""
    import asyncio

    import datasets
    from tinker_cookbook.recipes.distillation import on_policy_distillation as recipe

    from tests.engine.rollout.conftest import spread_weights

    student = tiny_model_factory("qwen3")
    teacher_name = "Qwen/Qwen3-32B"
    questions = datasets.Dataset.from_list([{"question": r["question"]} for r in ROWS])
    monkeypatch.setattr("tinker_cookbook.distillation.datasets.load_dataset", lambda *args, **kwargs: questions)
    with _serving(student, tmp_path, monkeypatch, **{teacher_name: spread_weights(student, tmp_path / "teacher")}) \
            as server:
        asyncio.run(recipe.cli_main(recipe.CLIConfig(
            model_name=NAME, teacher_model=teacher_name, dataset="deepmath", group_size=2, groups_per_batch=2,
            lora_rank=2, max_tokens=8, max_steps=2, eval_every=0, save_every=0, base_url=server.url,
            log_path=str(tmp_path / "distill"), behavior_if_log_dir_exists="delete")))
        rows = _metrics(tmp_path / "distill")
        assert [r["step"] for r in rows] == [0, 1]
        # a near-uniform student against a peaked teacher: their reverse KL on the student's samples is far from 0
        assert all(r["teacher_kl"] > 1.0 for r in rows), [r["teacher_kl"] for r in rows]
        assert _adapters_trained(server)

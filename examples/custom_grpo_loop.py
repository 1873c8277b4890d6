"""Your own GRPO controller loop, written with hybridflow's Python API (no `hybridflow train`).

    python examples/custom_grpo_loop.py                  # CPU, tiny random model, about a minute
    python examples/custom_grpo_loop.py --steps 30 --model path/to/hf_model

A tiny random model is rewarded for the share of digits in its answers. One step is the algorithm,
line for line: generate n responses per prompt -> score them -> old log-probs -> group-relative
advantages -> actor update -> weight sync into the rollout engine. The digit share climbs from the
random model's ~4 % to about half of the characters in ten steps.

Debugging: with `n_workers=1` the worker group runs in this process, so a `breakpoint()` here or
inside `hybridflow/workers/actor.py` stops in your terminal. With more workers each rank is its
own process (its prints come back prefixed `(actor rank N)`).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import AutoTokenizer

from hybridflow import algorithms
from hybridflow.batch import Batch
from hybridflow.config.model_schema import ModelConfig
from hybridflow.config.schema import ActorConfig, DataConfig, RLConfig, RolloutConfig
from hybridflow.controller import WorkerGroup
from hybridflow.data.chat import encode_prompts
from hybridflow.data.loader import left_pad
from hybridflow.rewards.manager import scores_to_token_scores
from hybridflow.trainer.role_configs import actor_config, train_sampling
from hybridflow.utils.tiny_model import build_tiny_model
from hybridflow.workers import ActorWorker

QUESTIONS = ["Count to five.", "What is 12 times 3?", "Give me a phone number.", "What year is it?"]


def digit_share(text: str) -> float:
    """The reward: the fraction of the response's characters that are digits (0 for an empty one)."""
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


def prompt_batch(tokenizer, questions: list[str], step: int) -> Batch:
    """Chat-templated prompts, left-padded: Batch{prompts, attention_mask} + one `uid` per prompt."""
    ids = encode_prompts(questions, tokenizer)  # each question as a user message, chat template applied
    prompts, mask = left_pad(ids, tokenizer.pad_token_id)
    return Batch({"prompts": prompts, "attention_mask": mask}, {"uid": [f"{step}-{i}" for i in range(len(ids))]})


def responses_text(tokenizer, batch: Batch) -> list[str]:
    lengths = batch["response_mask"].sum(-1).long().tolist()
    return [tokenizer.decode(row[:n].tolist(), skip_special_tokens=True) for row, n in zip(batch["responses"], lengths)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Hugging Face model directory (default: a tiny random Qwen2)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--n", type=int, default=8, help="responses per prompt (the GRPO group)")
    args = parser.parse_args()
    model_path = args.model or build_tiny_model(tempfile.mkdtemp(prefix="tiny_"), hidden=64, layers=2)
    tokenizer = AutoTokenizer.from_pretrained(model_path)

    cfg = RLConfig(model=ModelConfig(path=str(model_path)), actor=ActorConfig(lr=1e-2, mini_batch_size=None),
                   rollout=RolloutConfig(n=args.n, temperature=1.0),
                   data=DataConfig(max_prompt_length=64, max_response_length=16))
    sampling = train_sampling(cfg)                                   # n, temperature, max_tokens, seed
    actor = WorkerGroup(ActorWorker, n_workers=1, name="actor",
                        init_kwargs=dict(config=actor_config(cfg, total_steps=args.steps)))
    with actor:
        for step in range(1, args.steps + 1):
            prompts = prompt_batch(tokenizer, QUESTIONS, step)
            batch = actor.generate(prompts, sampling, step)          # len(QUESTIONS) * n rows
            scores = torch.tensor([digit_share(t) for t in responses_text(tokenizer, batch)])
            batch["token_rewards"] = scores_to_token_scores(scores, batch["response_mask"])
            batch = batch.union(actor.compute_log_probs(batch, sampling.temperature))  # old_log_probs, entropy
            batch["advantages"], batch["returns"] = algorithms.compute_advantages("grpo", batch)
            metrics = actor.update_actor(batch, sampling.temperature)  # the same on every rank: one dict
            actor.sync_weights()                                     # trained weights -> rollout engine
            print(f"step {step}: digit share {scores.mean():.3f} | pg_loss {metrics['actor/pg_loss']:+.4f} | "
                  f"entropy {metrics['actor/entropy']:.3f}")


if __name__ == "__main__":
    main()

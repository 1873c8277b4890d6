"""`agent.verifiers`: a `verifiers` environment (its rollout and rubric, unchanged) played through the endpoint.

    agent.verifiers: vf-gsm8k                      # an installed environment id (verifiers.load_environment)
    agent.verifiers: envs/my_env.py                # a file whose load_environment(**kwargs) returns one
    agent.env_kwargs: {num_train_examples: 500}    # the arguments of load_environment

Per trajectory the environment's `run_rollout` runs with the row as its input (`prompt` the row's chat
messages, `answer` its ground truth, `info` / `task` / `example_id` from its `extra_info`), a verifiers
`OpenAIChatCompletionsClient` on the trajectory's base URL and the served model's name; the rubric's
reward is the trajectory's reward and its metrics are the runner metrics. The environment is loaded once
per runner process. `export_dataset` writes an environment's dataset as a training file in that layout
(its system prompt and few-shot examples already in the prompts):

    python -m hybridflow.agents.adapters.verifiers_runner envs/my_env.py data/train.parquet [--split eval]

Needs the `agents` extra (verifiers 0.2: the Environment / Rubric API), imported only here.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from hybridflow.agents.endpoint.openai_wire import MODEL_NAME

_environments: dict[str, Any] = {}


def load(spec: str, env_args: dict[str, Any] | None = None) -> Any:
    """The verifiers Environment of `spec` (see the module docstring), loaded once per process and arguments."""
    key = json.dumps([spec, env_args or {}], sort_keys=True, default=str)
    if key not in _environments:
        import verifiers

        if spec.endswith(".py") or ".py:" in spec:
            from hybridflow.utils.imports import load_from_file

            factory = load_from_file(spec if ".py:" in spec else f"{spec}:load_environment", "verifiers environment",
                                     "function", "agent.verifiers")
            env = factory(**(env_args or {}))
        else:
            env = verifiers.load_environment(spec, **(env_args or {}))
        if not isinstance(env, verifiers.Environment):
            raise TypeError(f"agent.verifiers={spec!r} gave a {type(env).__name__}, not a verifiers.Environment")
        _environments[key] = env
    return _environments[key]


def rollout_input(row: dict[str, Any]) -> dict[str, Any]:
    """A verifiers `RolloutInput` from a dataset row."""
    extra = row.get("extra_info") or {}
    prompt = row.get("raw_prompt")
    out: dict[str, Any] = {"prompt": [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt,
                           "example_id": int(extra.get("example_id", row.get("index") or 0))}
    if row.get("ground_truth") is not None:
        out["answer"] = str(row["ground_truth"])
    for key in ("info", "task"):
        if extra.get(key) is not None:
            out[key] = extra[key]
    return out


async def run(client: Any, row: dict[str, Any], env: str, env_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """One rollout of environment `env` for `row`, scored by its rubric."""
    from verifiers.clients.openai_chat_completions_client import OpenAIChatCompletionsClient

    environment = load(env, env_args)
    output = await environment.run_rollout(rollout_input(row), OpenAIChatCompletionsClient(client), MODEL_NAME, {})
    if output.get("error"):
        raise RuntimeError(f"the verifiers rollout failed: {output['error']}")
    metrics = {k: float(v) for k, v in (output.get("metrics") or {}).items() if isinstance(v, (int, float))}
    return {"reward": float(output["reward"]), "metrics": metrics}


def export_dataset(spec: str, path: str, split: str = "train", env_args: dict[str, Any] | None = None) -> int:
    """Writes environment `spec`'s dataset (`split`: train or eval) as a training file; returns its rows."""
    import pandas as pd

    env = load(spec, env_args)
    dataset = env.get_dataset() if split == "train" else env.get_eval_dataset()
    rows = []
    for i, example in enumerate(dataset):
        info = example.get("info")
        rows.append({"data_source": f"verifiers:{spec}", "prompt": example["prompt"],
                     "reward_model": {"ground_truth": str(example.get("answer", ""))},
                     "extra_info": {"example_id": int(example.get("example_id", i)), "task": example.get("task"),
                                    "info": json.loads(info) if isinstance(info, str) else info}})
    frame = pd.DataFrame(rows)
    (frame.to_parquet if path.endswith(".parquet") else lambda p: frame.to_json(p, orient="records", lines=True))(path)
    return len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description="Write a verifiers environment's dataset as a training file.")
    parser.add_argument("env", help="an environment id or path/to/file.py (its load_environment)")
    parser.add_argument("out", help="a .parquet or .jsonl file")
    parser.add_argument("--split", choices=("train", "eval"), default="train")
    parser.add_argument("--env-args", default="{}", help="load_environment's arguments, as JSON")
    args = parser.parse_args()
    print(f"{export_dataset(args.env, args.out, args.split, json.loads(args.env_args))} rows -> {args.out}")


if __name__ == "__main__":
    main()

"""Procedural tasks with a verifiable answer, for the demo: problems, splits and data files.

A task maps a seeded `random.Random` to one `(question, answer)` pair; answers are short strings that
the built-in `exact_match` reward checks. `make_splits` draws the SFT, RL and held-out sets with
disjoint questions, and `write_task_data` writes them in the formats the trainers read:

    sft.jsonl            {"messages": [{"role": "user", ...}, {"role": "assistant", "content": answer}]}
    rl_train.parquet     verl rows: data_source, prompt (chat messages), reward_model.ground_truth, extra_info
    heldout.parquet      the same, never seen by SFT or RL (the accuracy before/after RL is measured here)

    python -m hybridflow.demo.tasks data/demo --task reverse --n-sft 4096 --n-rl 2048 --n-heldout 200
"""

from __future__ import annotations

import argparse
import json
import random
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridflow.data.gsm8k_synthetic import write_parquet

Problem = tuple[str, str]


def _letters(rng: random.Random, low: int, high: int) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(low, high)))


def reverse_task(rng: random.Random, min_len: int = 3, max_len: int = 7) -> Problem:
    """`reverse abcd` -> `dcba`."""
    word = _letters(rng, min_len, max_len)
    return f"reverse {word}", word[::-1]


def sort_task(rng: random.Random, min_len: int = 3, max_len: int = 7) -> Problem:
    """`sort dbca` -> `abcd` (letters in alphabetical order)."""
    word = _letters(rng, min_len, max_len)
    return f"sort {word}", "".join(sorted(word))


def pick_task(rng: random.Random, min_len: int = 3, max_len: int = 7) -> Problem:
    """`pick 2 kdpqa` -> `d` (the letter at a 1-based position)."""
    word = _letters(rng, min_len, max_len)
    k = rng.randint(1, len(word))
    return f"pick {k} {word}", word[k - 1]


def add_task(rng: random.Random, min_len: int = 2, max_len: int = 3) -> Problem:
    """`add 417+58` -> `475` (operands of min_len..max_len digits)."""
    a, b = (rng.randint(10 ** (rng.randint(min_len, max_len) - 1), 10 ** max_len - 1) for _ in range(2))
    return f"add {a}+{b}", str(a + b)


TASKS: dict[str, Callable[..., Problem]] = {"reverse": reverse_task, "sort": sort_task, "pick": pick_task,
                                            "add": add_task}


def make_problem_fn(task: str, min_len: int | None = None, max_len: int | None = None) -> Callable[..., Problem]:
    """The generator of `task` (a `TASKS` name) with optional length bounds."""
    if task not in TASKS:
        raise ValueError(f"unknown demo task {task!r}; valid: {', '.join(TASKS)}")
    bounds = {k: v for k, v in (("min_len", min_len), ("max_len", max_len)) if v is not None}
    fn = TASKS[task]
    return lambda rng: fn(rng, **bounds)


def make_splits(task: str, sizes: dict[str, int], seed: int = 0, min_len: int | None = None,
                max_len: int | None = None) -> dict[str, list[Problem]]:
    """`{split: problems}` with `sizes[split]` problems each and no question in two splits (nor twice
    in one); splits are drawn in order, so a later split never takes an earlier one's question."""
    fn = make_problem_fn(task, min_len, max_len)
    rng = random.Random(f"demo-{task}-{seed}")
    seen: set[str] = set()
    out: dict[str, list[Problem]] = {}
    for split, n in sizes.items():
        problems: list[Problem] = []
        tries = 0
        while len(problems) < n:
            tries += 1
            if tries > 50 * n + 1000:
                raise ValueError(f"task {task!r} with lengths {min_len}..{max_len} has too few distinct "
                                 f"questions for {sum(sizes.values())} problems; lower the split sizes")
            question, answer = fn(rng)
            if question not in seen:
                seen.add(question)
                problems.append((question, answer))
        out[split] = problems
    return out


def rl_rows(problems: list[Problem], task: str, split: str) -> list[dict[str, Any]]:
    """verl-format rows for `hybridflow train` (scored by `reward.function=exact_match`)."""
    return [{"data_source": f"demo/{task}", "prompt": [{"role": "user", "content": q}], "ability": task,
             "reward_model": {"style": "rule", "ground_truth": a}, "extra_info": {"split": split, "index": i}}
            for i, (q, a) in enumerate(problems)]


def echo_answer(question: str) -> str:
    """The demo's noisy demonstration: the input echoed back (`reverse abcd` -> `abcd`), a plausible,
    systematic mistake that the exact-match reward scores 0."""
    return question.split()[-1]


def write_task_data(out_dir: str | Path, task: str, n_sft: int, n_rl: int, n_heldout: int, seed: int = 0,
                    min_len: int | None = None, max_len: int | None = None,
                    sft_noise: float = 0.0) -> dict[str, Path]:
    """Writes `sft.jsonl`, `rl_train.parquet`, `heldout.parquet` under `out_dir`; returns their paths.

    `sft_noise`: the share of SFT demonstrations whose answer is `echo_answer` instead of the right
    one (imperfect demonstrations, as human or model-written SFT data has): the SFT model then gives
    the right answer only part of the time, which is what RL with a verifiable reward can fix.
    """
    if not 0.0 <= sft_noise < 1.0:
        raise ValueError(f"sft_noise={sft_noise}: must be in [0, 1)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    splits = make_splits(task, {"heldout": n_heldout, "sft": n_sft, "rl": n_rl}, seed, min_len, max_len)
    noise = random.Random(f"demo-noise-{seed}")
    sft = out / "sft.jsonl"
    sft.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                    {"role": "assistant", "content": echo_answer(q)
                                                     if noise.random() < sft_noise else a}]}) + "\n"
                           for q, a in splits["sft"]))
    return {"sft": sft, "rl": write_parquet(rl_rows(splits["rl"], task, "rl"), out / "rl_train.parquet"),
            "heldout": write_parquet(rl_rows(splits["heldout"], task, "heldout"), out / "heldout.parquet")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--task", default="reverse", choices=list(TASKS))
    parser.add_argument("--n-sft", type=int, default=4096)
    parser.add_argument("--n-rl", type=int, default=2048)
    parser.add_argument("--n-heldout", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name, path in write_task_data(args.out_dir, args.task, args.n_sft, args.n_rl, args.n_heldout,
                                      args.seed).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()

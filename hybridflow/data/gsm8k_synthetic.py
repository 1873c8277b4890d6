"""A tiny GSM8K-style dataset in verl's parquet format, made procedurally (no download).

Arithmetic word problems with `#### <answer>` ground truths, laid out exactly like verl's GSM8K
preprocessing (`data_source="openai/gsm8k"`, chat-message prompts asking for the answer after "####",
`reward_model.ground_truth`, `extra_info`), so the built-in GSM8K reward scores them. For tests, the
demo and the README quickstart:

    python -m hybridflow.data.gsm8k_synthetic data/gsm8k --n-train 256 --n-val 64
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
NAMES = ("Ava", "Ben", "Chen", "Dana", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jade")
ITEMS = ("apples", "books", "coins", "marbles", "pencils", "stamps", "cookies", "shells")


def _problem(rng: random.Random) -> tuple[str, str, int]:
    """`(question, worked solution ending in '#### n', n)` for one random template."""
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    a, b, c = rng.randint(2, 20), rng.randint(2, 20), rng.randint(2, 6)
    kind = rng.randrange(4)
    if kind == 0:
        answer = a + b
        q = f"{name} has {a} {item}. {other} gives {name} {b} more. How many {item} does {name} have now?"
        steps = f"{name} has {a} + {b} = {answer} {item}."
    elif kind == 1:
        a, b = max(a, b), min(a, b)
        answer = a - b
        q = f"{name} had {a} {item} and gave {b} of them to {other}. How many {item} does {name} have left?"
        steps = f"{name} has {a} - {b} = {answer} {item} left."
    elif kind == 2:
        answer = a * c
        q = f"{name} buys {c} boxes with {a} {item} in each box. How many {item} does {name} buy in total?"
        steps = f"{name} buys {c} * {a} = {answer} {item}."
    else:
        answer = a * c + b
        q = (f"{name} has {c} bags of {a} {item} and finds {b} more {item}. "
             f"How many {item} does {name} have altogether?")
        steps = f"The bags hold {c} * {a} = {a * c} {item}; with {b} more that is {a * c} + {b} = {answer}."
    return q, f"{steps}\n#### {answer}", answer


def make_rows(n: int, split: str, seed: int) -> list[dict[str, Any]]:
    """`n` verl-format rows (`data_source`, `prompt`, `ability`, `reward_model`, `extra_info`)."""
    rng = random.Random(f"{seed}-{split}")
    rows = []
    for i in range(n):
        question, solution, answer = _problem(rng)
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"split": split, "index": i, "answer": solution, "question": question},
        })
    return rows


def write_parquet(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Writes rows (list/dict columns become parquet list/struct columns, as verl's files have)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_gsm8k_synthetic(out_dir: str | Path, n_train: int = 256, n_val: int = 64, seed: int = 0
                          ) -> tuple[Path, Path]:
    """Writes `out_dir/train.parquet` and `out_dir/test.parquet`; returns both paths."""
    out = Path(out_dir)
    return (write_parquet(make_rows(n_train, "train", seed), out / "train.parquet"),
            write_parquet(make_rows(n_val, "test", seed), out / "test.parquet"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--n-train", type=int, default=256)
    parser.add_argument("--n-val", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for path in write_gsm8k_synthetic(args.out_dir, args.n_train, args.n_val, args.seed):
        print(path)


if __name__ == "__main__":
    main()

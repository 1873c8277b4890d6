"""Learning on a synthetic image task (issue 59, a CPU benchmark): a tiny random vision-language model, warmed up by
supervised fine-tuning, then trained with GRPO by `hybridflow train` on geo3k-format data; does its held-out reward
rise?

The task: a picture filled with one of four colors (red, green, blue, yellow), in a shade and a size drawn at
random, drawn with PIL; the prompt asks which color fills it, and the reward is 1 when the answer's first word names
it. The model is `hybridflow.utils.tiny_vlm`'s (Qwen2.5-VL or Qwen3-VL architecture, random weights). The warm-up
is a short teacher-forced loop over the transformers model (our SFT trainer reads text only) that leaves the model
sometimes right, which is what RL can sharpen; GRPO then runs `recipes/geo3k_vl.yaml` with validation on held-out
pictures (greedy) every few steps. Prints the curve and writes JSON (and a PNG with --plot).

    python bench/vision_learn.py --out bench/results/vision_learn_cpu.json --plot docs/img/vision_learn.png
"""

from __future__ import annotations

import argparse
import io
import json
import random
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

COLORS = {"red": (210, 40, 40), "green": (40, 170, 50), "blue": (40, 50, 210), "yellow": (225, 215, 40)}
QUESTION = "<image>Which color fills the picture? Answer with one word."


def reward(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """1.0 when the response's first word is the picture's color."""
    words = solution_str.strip().lower().replace(".", " ").split()
    return 1.0 if words and words[0] == str(ground_truth) else 0.0


def picture(color: str, rng: random.Random) -> bytes:
    """A PNG of `color` in a shade within +-25 per channel, 40 to 110 pixels a side."""
    from PIL import Image

    shade = tuple(max(0, min(255, c + rng.randint(-25, 25))) for c in COLORS[color])
    buf = io.BytesIO()
    Image.new("RGB", (rng.randint(40, 110), rng.randint(40, 110)), shade).save(buf, "PNG")
    return buf.getvalue()


def rows(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        color = rng.choice(sorted(COLORS))
        out.append({"data_source": "synthetic/colors", "prompt": [{"role": "user", "content": QUESTION}],
                    "images": [{"bytes": picture(color, rng)}], "ability": "vision",
                    "reward_model": {"style": "rule", "ground_truth": color}, "extra_info": {"index": i}})
    return out


def warm_up(model_dir: Path, train_rows: list[dict], steps: int, lr: float, batch: int, seed: int) -> list[float]:
    """Teacher-forced cross-entropy on `color<eos>` after each prompt, `steps` Adam steps of `batch` rows; saves the
    model in place; returns the losses."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from hybridflow.data.image_prompts import VisionPrompts

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = VisionPrompts.from_pretrained(str(model_dir), tokenizer)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    encoded = []
    for i, row in enumerate(train_rows):
        ids, vision = prompts.encode(row["prompt"], row["images"], f"row {i}")
        answer = tokenizer(row["reward_model"]["ground_truth"], add_special_tokens=False)["input_ids"]
        encoded.append((ids, answer + [tokenizer.eos_token_id], vision))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng, losses = random.Random(seed), []
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        total = 0.0
        for ids, answer, vision in rng.sample(encoded, batch):
            tokens = torch.tensor([ids + answer])
            labels = torch.tensor([[-100] * len(ids) + answer])
            loss = model(input_ids=tokens, labels=labels, **prompts.family.model_inputs(tokens, vision)).loss / batch
            loss.backward()
            total += loss.item()
        optimizer.step()
        losses.append(total)
    model.save_pretrained(model_dir)
    return losses


def grpo(model_dir: Path, train_file: Path, val_file: Path, out: Path, a: argparse.Namespace) -> list[dict]:
    """`hybridflow train` on the warmed-up model; the metrics rows it wrote."""
    from hybridflow.config.loader import load_config
    from hybridflow.trainer.rl import train

    cfg = load_config([f"model.path={model_dir}", f"data.train_files={train_file}", f"data.val_files={val_file}",
                       f"data.train_batch_size={a.prompts}", "data.max_prompt_length=256",
                       "data.max_response_length=8", f"rollout.n={a.n}", f"actor.lr={a.lr}", "actor.kl_loss_coef=0",
                       "actor.mini_batch_size=null", f"trainer.total_steps={a.steps}", f"trainer.val_every={a.val_every}",
                       "trainer.val_before_train=true", "trainer.save_every=0", "trainer.n_workers=1",
                       f"reward.function={Path(__file__).resolve()}:reward", "model.freeze_vision=false",
                       f"trainer.output_dir={out}", "trainer.total_epochs=1000"],
                      "recipes/geo3k_vl.yaml")
    train(cfg)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="qwen2_5_vl", choices=("qwen2_5_vl", "qwen3_vl"))
    p.add_argument("--train-rows", type=int, default=512)
    p.add_argument("--val-rows", type=int, default=64)
    p.add_argument("--sft-steps", type=int, default=8, help="warm-up steps: 8 leave a tiny model right ~40 %% of the time")
    p.add_argument("--sft-lr", type=float, default=1e-3)
    p.add_argument("--sft-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=40, help="GRPO steps")
    p.add_argument("--prompts", type=int, default=16, help="prompts per GRPO step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--val-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(HERE / "results" / "vision_learn_cpu.json"))
    p.add_argument("--plot", default=None, help="a PNG of the held-out reward against the GRPO step")
    a = p.parse_args()

    import pandas as pd
    import torch

    from hybridflow.utils.tiny_vlm import build_tiny_vlm

    torch.manual_seed(a.seed)
    with tempfile.TemporaryDirectory(prefix="vision_learn_") as tmp:
        work = Path(tmp)
        model_dir = build_tiny_vlm(work / "model", family=a.family, hidden=128, seed=a.seed)
        train_rows, val_rows = rows(a.train_rows, a.seed), rows(a.val_rows, a.seed + 1)
        pd.DataFrame(train_rows).to_parquet(work / "train.parquet")
        pd.DataFrame(val_rows).to_parquet(work / "val.parquet")
        start = time.perf_counter()
        losses = warm_up(model_dir, train_rows, a.sft_steps, a.sft_lr, a.sft_batch, a.seed)
        sft_s = time.perf_counter() - start
        print(f"warm-up: {a.sft_steps} steps in {sft_s:.0f} s, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        start = time.perf_counter()
        metrics = grpo(model_dir, work / "train.parquet", work / "val.parquet", work / "run", a)
        grpo_s = time.perf_counter() - start
    curve = [(r["step"], r["val/reward/mean"]) for r in metrics if "val/reward/mean" in r]
    train_reward = [(r["step"], r["reward/mean"]) for r in metrics if "reward/mean" in r]
    for step, value in curve:
        print(f"step {step:>3}: held-out reward {value:.3f}")
    report = {"family": a.family, "settings": {k: v for k, v in vars(a).items() if k not in ("out", "plot")},
              "sft_loss": losses, "sft_s": sft_s, "grpo_s": grpo_s, "val_reward": curve, "train_reward": train_reward,
              "torch": torch.__version__, "threads": torch.get_num_threads()}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {a.out}")
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([s for s, _ in curve], [v for _, v in curve], marker="o", label="held-out (greedy)")
        ax.plot([s for s, _ in train_reward], [v for _, v in train_reward], alpha=0.5, label="training samples")
        ax.set_xlabel("GRPO step")
        ax.set_ylabel("reward (color named)")
        ax.set_title(f"tiny {a.family}, {a.sft_steps} warm-up steps, then GRPO {a.prompts} x {a.n}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot, dpi=100)
        print(f"wrote {a.plot}")


if __name__ == "__main__":
    main()

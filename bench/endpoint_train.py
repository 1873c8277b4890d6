"""GRPO on a game from an installed package, played through the OpenAI-compatible endpoint: textarena's
GuessTheNumber (`agent.gym=textarena:GuessTheNumber-v0`), its reward curve over the steps.

    python bench/endpoint_train.py --device cpu                          # a tiny random model, 2 steps
    python bench/endpoint_train.py --device cuda --model SmolLM2-135M-Instruct.Q4_1.gguf --steps 50 \
        --out bench/results/endpoint_train_h200.json                      # the real model; also writes a PNG
    bash bench/h200.sh model_part1; bash bench/h200.sh model_part2 endpoint_train      # the same on the H200

Each prompt row is one game (its seed picks the number); the row's prompt is the system message, the game's
rules the first user message, and each model answer a guess (the game wins 1, anything else 0). Writes
JSON (per step: reward, turns, dropped trajectories, token mismatches, step seconds; the device's peak
memory) and, with `--out`, the reward curve as a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

SYSTEM = "You are playing a guessing game. Answer with one number in square brackets, like [10]."


def write_games(path: Path, count: int) -> Path:
    rows = [{"prompt": SYSTEM, "data_source": "textarena", "reward_model": {"ground_truth": ""},
             "extra_info": {"seed": i}} for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default=None, help="HF dir, .gguf file or a dir holding one (default: tiny)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: 50 on cuda, 2 on cpu)")
    parser.add_argument("--game", default="GuessTheNumber-v0", help="textarena environment id")
    parser.add_argument("--lr", type=float, default=None, help="actor.lr (default: 1e-6 on cuda, 1e-4 on cpu)")
    parser.add_argument("--out", default=None, help="JSON output path (the PNG goes beside it)")
    parser.add_argument("--run-dir", default=None, help="the run's output directory (default: a temporary one); "
                                                        "its metrics.jsonl holds every finished step even when "
                                                        "the run is cut short")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    steps = args.steps or (50 if cuda else 2)
    work = Path(tempfile.mkdtemp())
    run_dir = Path(args.run_dir) if args.run_dir else work / "run"
    if args.model is None:
        from hybridflow.utils.tiny_model import build_tiny_model

        model = str(build_tiny_model(work / "tiny", max_positions=1024))
    else:
        from hybridflow.utils.real_model import resolve_model

        model = str(resolve_model(args.model, "bf16" if cuda else "fp32"))
    batch, n = (32, 8) if cuda else (2, 2)
    data = write_games(work / "games.jsonl", batch * steps)
    overrides = [f"model.path={model}", f"data.train_files={data}", f"data.train_batch_size={batch}",
                 f"rollout.n={n}", "data.max_prompt_length=768", f"data.max_response_length={512 if cuda else 48}",
                 f"agent.gym=textarena:{args.game}", "agent.max_turns=6", f"agent.max_tokens_per_turn={32 if cuda else 6}",
                 "reward.function=environment", f"trainer.total_steps={steps}", "trainer.val_before_train=false",
                 "actor.mini_batch_size=null", f"actor.lr={args.lr or (1e-6 if cuda else 1e-4)}", f"trainer.device={args.device}",
                 f"trainer.output_dir={run_dir}", "trainer.save_every=0"]
    from hybridflow.config.loader import load_config
    from hybridflow.trainer.rl import train

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    train(load_config(overrides, "recipes/grpo.yaml"))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = ("reward/mean", "agent/turns/mean", "agent/dropped", "agent/token_mismatch", "agent/cut_by_budget",
            "agent/runner_errors", "timing_s/gen", "timing_s/step")
    result = dict(model=model, game=args.game, steps=steps, prompts_per_step=batch, n=n, overrides=overrides,
                  curve=[{"step": i + 1, **{k: r.get(k) for k in keys}} for i, r in enumerate(rows)],
                  peak_memory_gb=torch.cuda.max_memory_allocated() / 2**30 if cuda else None)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([c["step"] for c in result["curve"]], [c["reward/mean"] for c in result["curve"]])
        ax.set(xlabel="step", ylabel="reward/mean", title=f"GRPO on textarena {args.game} through the endpoint")
        fig.tight_layout()
        fig.savefig(Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()

"""A GRPO step of a vision-language model at the Qwen2.5-VL-3B shape (issue 59): random weights, one image per prompt
(448 x 448: 256 merged image tokens), `--prompts` x `--n` rows, `recipes/geo3k_vl.yaml` as a user runs it (its KL
term, so a reference pass too) with the device plan's defaults. Per step: its time and phases, the response length;
the device's peak (everything on the card, sampled, `bench_util.DeviceMemoryWatch`).

The model directory pairs the real shape (Qwen2.5-VL-3B-Instruct's config sizes, `vision_rollout.SHAPES`, its
151,936-token vocabulary) with the tiny byte-level tokenizer and vision tokens of `hybridflow.utils.tiny_vlm`: no
tokenizer can be downloaded here. Sampled ids past the tokenizer decode to nothing, so the reward reads the response's
token ids' count and a checksum of its text (`reward`): a spread of rewards that gives the update advantages to train on.

    python bench/vision_step.py --device cuda --out bench/results/vision_step_cuda.json
    python bench/vision_step.py --device cpu --shape tiny --prompts 2 --n 2 --new-tokens 8 --steps 2 --side 56  # smoke
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import zlib
from pathlib import Path

from bench_util import DeviceMemoryWatch, git_commit, peak_memory_gb, write_json

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from vision_rollout import MERGE, PATCH, SHAPES  # noqa: E402


def reward(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """0 or 1 from the response text's checksum: random weights answer nothing, and GRPO needs a spread."""
    return float(zlib.crc32(solution_str.encode()) % 2)


def build(shape: str, path: Path, side: int, device: str) -> None:
    """The tiny VLM's tokenizer and vision tokens under `path`, with a random Qwen2.5-VL of `shape` (bf16) and an
    image processor that keeps a `side` x `side` image whole."""
    import torch
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from hybridflow.utils.tiny_vlm import build_tiny_vlm

    build_tiny_vlm(path, family="qwen2_5_vl")
    tiny = json.loads((path / "config.json").read_text())
    text = tiny["text_config"]
    tokens = {k: tiny[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    config = Qwen2_5_VLConfig(text_config=dict(SHAPES[shape]["text"], pad_token_id=text["pad_token_id"],
                                               eos_token_id=text["eos_token_id"]),
                              vision_config=SHAPES[shape]["vision"], tie_word_embeddings=True, **tokens)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.generation_config = AutoModelForImageTextToText.from_pretrained(path).generation_config
    model.save_pretrained(path)
    del model
    unit = PATCH * MERGE
    Qwen2VLImageProcessorPil(min_pixels=unit * unit, max_pixels=side * side, patch_size=PATCH).save_pretrained(path)


def data(path: Path, prompts: int, side: int) -> None:
    """`prompts` rows in verl's geo3k layout, each with one `side` x `side` picture of a random color."""
    import random

    import pandas as pd
    from PIL import Image

    rng = random.Random(0)
    rows = []
    for i in range(prompts):
        picture = io.BytesIO()
        Image.new("RGB", (side, side), tuple(rng.randrange(256) for _ in range(3))).save(picture, format="PNG")
        rows.append({"prompt": [{"role": "user", "content": "<image>Which color fills the picture?"}],
                     "images": [{"bytes": picture.getvalue()}], "reward_model": {"ground_truth": "red"},
                     "data_source": "vision_step"})
    pd.DataFrame(rows).to_parquet(path)


def run(a: argparse.Namespace, work: Path, save) -> dict:
    from hybridflow.config.loader import load_config
    from hybridflow.trainer.rl import RLTrainer

    cfg = load_config([
        f"model.path={work}/model", f"data.train_files={work}/train.parquet", f"data.train_batch_size={a.prompts}",
        "data.max_prompt_length=512", f"data.max_response_length={a.new_tokens}", f"rollout.n={a.n}",
        f"actor.mini_batch_size={a.prompts}", f"reward.function={Path(__file__).resolve()}:reward",
        "reward.num_workers=1", f"trainer.total_steps={a.steps}", "trainer.val_before_train=false",
        "trainer.loggers=[jsonl]", f"trainer.output_dir={work}/run", "trainer.resume=never",
        f"trainer.device={a.device}", "trainer.save_every=0", *a.set,
    ], str(HERE.parent / "recipes" / "geo3k_vl.yaml"))
    trainer = RLTrainer(cfg)
    steps = []
    try:
        for _ in range(a.steps):
            m = trainer.train_step(trainer.train_loader.next_batch())
            trainer.step += 1
            steps.append({"step_s": m["timing_s/step"], "response_length_mean": m["response_length/mean"],
                          "phases_s": {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("timing_s/")},
                          "gen_tokens_per_s": m["response_length/mean"] * a.prompts * a.n / m["timing_s/gen"]})
            print(f"step {trainer.step}: {m['timing_s/step']:.2f} s", flush=True)
            save({"steps": steps})  # a device call cut short keeps the steps that ended
    finally:
        trainer.close()
    return {"steps": steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--shape", default="qwen2.5-vl-3b", choices=sorted(SHAPES))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--new-tokens", type=int, default=256, help="data.max_response_length")
    p.add_argument("--side", type=int, default=448, help="each image's side in pixels (a multiple of 28)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/vision_step_<device>.json)")
    a = p.parse_args()

    watch = DeviceMemoryWatch() if a.device == "cuda" else None
    path = a.out or HERE / "results" / f"vision_step_{a.device}.json"

    def save(result: dict) -> dict:
        later = [s["step_s"] for s in result["steps"][1:]] or [result["steps"][0]["step_s"]]
        report = {"bench": "vision_step", "commit": git_commit(), "settings": vars(a),
                  "image_tokens": (a.side // PATCH) ** 2 // MERGE ** 2, **result,
                  "first_step_s": result["steps"][0]["step_s"], "step_s_median_after_first": statistics.median(later),
                  "peak_device_memory_gb": watch.peak / 2**30 if watch else None,
                  "peak_rss_gb": None if watch else peak_memory_gb("cpu")}
        write_json(report, path)
        return report

    with tempfile.TemporaryDirectory(prefix="vision_step_") as tmp:
        work = Path(tmp)
        build(a.shape, work / "model", a.side, a.device)
        data(work / "train.parquet", a.prompts, a.side)
        result = run(a, work, save)
    if watch:
        watch.stop()
    report = save(result)
    print(f"{a.shape}: first step {report['first_step_s']:.2f} s, later {report['step_s_median_after_first']:.2f} s "
          f"(median), device peak {report['peak_device_memory_gb']} GiB -> {path}")


if __name__ == "__main__":
    main()

"""Vision-language rollout against `transformers.generate` (issue 59): random weights at the Qwen2.5-VL-3B shape, one
448 x 448 image per prompt (256 merged image tokens), `--prompts` x `--n` rows of `--new-tokens` sampled tokens each.
`VisionRolloutEngine` (one prefill per prompt shared by its n samples) and the same model's `generate` (each row
prefilled with its own copy of the image) on the same rows: tokens per second and the peak of the device's allocator.

    python bench/vision_rollout.py --device cuda --out bench/results/vision_rollout_cuda.json
    python bench/vision_rollout.py --device cpu --shape tiny --prompts 2 --n 2 --new-tokens 8   # the smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

# Qwen2.5-VL-3B-Instruct's config.json sizes; "tiny": a debug size for the smoke run
SHAPES = {
    "qwen2.5-vl-3b": dict(
        text=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                    fullatt_block_indexes=[7, 15, 23, 31], window_size=112)),
    "tiny": dict(
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1024, max_position_embeddings=2048, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}),
        vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                    fullatt_block_indexes=[1], window_size=112)),
}
PATCH, MERGE = 14, 2


def build(shape: str, path: Path, device: torch.device, dtype: torch.dtype) -> dict[str, int]:
    """Save a random Qwen2.5-VL of `shape` under `path`; its vision token ids."""
    from transformers import AutoModelForImageTextToText, GenerationConfig, Qwen2_5_VLConfig

    vocab = SHAPES[shape]["text"]["vocab_size"]
    tokens = dict(vision_start_token_id=vocab - 4, image_token_id=vocab - 3, video_token_id=vocab - 2,
                  vision_end_token_id=vocab - 1)
    config = Qwen2_5_VLConfig(text_config=dict(SHAPES[shape]["text"], pad_token_id=0, eos_token_id=None),
                              vision_config=SHAPES[shape]["vision"], tie_word_embeddings=True, **tokens)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig(pad_token_id=0)
    model.save_pretrained(path)
    del model
    return tokens


def rows(prompts: int, text_tokens: int, side: int, tokens: dict[str, int], vocab: int):
    """(token ids, VisionInputs) per prompt: text, then one side x side image's tokens, then text."""
    from hybridflow.data.image_prompts import VisionInputs

    grid = side // PATCH
    merged = grid * grid // MERGE ** 2
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(prompts):
        text = torch.randint(10, vocab - 10, (text_tokens,), generator=gen).tolist()
        ids = text[:8] + [tokens["vision_start_token_id"]] + [tokens["image_token_id"]] * merged + \
            [tokens["vision_end_token_id"]] + text[8:]
        pixels = torch.randn(grid * grid, 3 * 2 * PATCH * PATCH, generator=gen)
        out.append((ids, VisionInputs(pixels, torch.tensor([[1, grid, grid]]))))
    return out


def timed(device: torch.device, fn):
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return result, time.perf_counter() - start, peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--shape", default="qwen2.5-vl-3b", choices=sorted(SHAPES))
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--text-tokens", type=int, default=64, help="text tokens of each prompt beside its image")
    p.add_argument("--side", type=int, default=448, help="the image's side in pixels")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/vision_rollout_<device>.json)")
    a = p.parse_args()

    from hybridflow.engine.rollout import SamplingParams
    from hybridflow.engine.rollout.vision_engine import VisionRolloutEngine

    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    report: dict = {"shape": a.shape, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "settings": {k: v for k, v in vars(a).items() if k != "out"}}
    with tempfile.TemporaryDirectory(prefix="vision_rollout_") as tmp:
        tokens = build(a.shape, Path(tmp), device, dtype)
        prompts = rows(a.prompts, a.text_tokens, a.side, tokens, SHAPES[a.shape]["text"]["vocab_size"])
        engine = VisionRolloutEngine(tmp, device, dtype, [], max_num_seqs=a.prompts * a.n,
                                     max_model_len=len(prompts[0][0]) + a.new_tokens)
        params = SamplingParams(n=a.n, temperature=1.0, max_tokens=a.new_tokens, stop_token_ids=[], seed=0)
        ids, vision = [i for i, _ in prompts], [v for _, v in prompts]
        engine.generate(ids[:1], SamplingParams(n=1, max_tokens=4, stop_token_ids=[]), vision=vision[:1])  # warm-up
        outs, ours_s, ours_peak = timed(device, lambda: engine.generate(ids, params, vision=vision))
        ours_tokens = sum(len(s.token_ids) for row in outs for s in row)

        def hf() -> int:
            batch = torch.tensor([i for i in ids for _ in range(a.n)], device=device)
            pixels = torch.cat([v.pixel_values for v in vision for _ in range(a.n)]).to(device, dtype)
            grid = torch.cat([v.image_grid_thw for v in vision for _ in range(a.n)]).to(device)
            out = engine.model.generate(input_ids=batch, attention_mask=torch.ones_like(batch),
                                        mm_token_type_ids=(batch == tokens["image_token_id"]).int(),
                                        pixel_values=pixels, image_grid_thw=grid, do_sample=True, top_k=0,
                                        max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, pad_token_id=0)
            return int(out[:, batch.shape[1]:].numel())

        hf_tokens, hf_s, hf_peak = timed(device, hf)
    report.update(rows=a.prompts * a.n, ours={"tokens": ours_tokens, "seconds": ours_s, "tok_s": ours_tokens / ours_s,
                                            "peak_allocated_gib": ours_peak},
                  generate={"tokens": hf_tokens, "seconds": hf_s, "tok_s": hf_tokens / hf_s,
                            "peak_allocated_gib": hf_peak})
    report["speedup"] = report["ours"]["tok_s"] / report["generate"]["tok_s"]
    for name in ("ours", "generate"):
        r = report[name]
        peak = f", peak {r['peak_allocated_gib']:.1f} GiB" if r["peak_allocated_gib"] is not None else ""
        print(f"{name:>9}: {r['tokens']:,} tokens in {r['seconds']:.2f} s, {r['tok_s']:,.0f} tok/s{peak}")
    print(f"VisionRolloutEngine / generate: {report['speedup']:.2f}x")
    out = Path(a.out or HERE / "results" / f"vision_rollout_{a.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

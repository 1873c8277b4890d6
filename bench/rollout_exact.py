"""Exact mode's cost in the rollout (`rollout.exact`, docs/exact.md), run by `bench/rollout.py --exact`:

    python bench/rollout.py --device cuda --exact --out bench/results/rollout_exact_h200.json
    python bench/rollout.py --device cpu --exact      # toy size (4 rows, 8 new tokens): that it runs, not speed

The default engine and the exact one (the batch-invariant kernels the trainer's forward shares) over the same
random weights, at the learning race's shape (SmolLM2-135M's dimensions, 64 x 8 = 512 rows) and Qwen2-0.5B's
(256 rows): prompt 128, 256 new tokens, EOS ignored, temperature 1, decode in CUDA graphs; their runs
alternate and the median of `repeats` is reported: tokens/s of each, the exact/default ratio (target >= 0.7),
the decode step's milliseconds and the prefill seconds of each, and the device's peak allocation.
"""

from __future__ import annotations

import torch

from hybridflow.engine.rollout import SamplingParams
from rollout_util import engine_from, make_model, median, ours_generate

RUNS = {"cuda": [("smollm2-135m", 512), ("qwen2-0.5b", 256)], "cpu": [("cpu-10m", 4)]}


def bench_exact(device: torch.device, dtype: torch.dtype, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    """{shape: {"default": ..., "exact": ..., "exact_over_default": tok/s ratio}} for `RUNS[device.type]`."""
    out = {}
    for shape, batch in RUNS[device.type]:
        model = make_model(shape, dtype, device)
        engines = {mode: engine_from(model, device, dtype, max_num_seqs=batch, max_model_len=prompt_len + new_tokens,
                                     exact=mode == "exact") for mode in ("default", "exact")}
        prompts = torch.randint(4, model.config.vocab_size, (batch, prompt_len),
                                generator=torch.Generator().manual_seed(0)).tolist()
        params = SamplingParams(temperature=1.0, max_tokens=new_tokens, stop_token_ids=[], seed=0)
        runs: dict[str, list[dict]] = {mode: [] for mode in engines}
        for engine in engines.values():  # warm-up: Triton compiles, graphs replay once
            engine.generate(prompts[:4], SamplingParams(max_tokens=8, stop_token_ids=[]))
        for _ in range(repeats):
            for mode, engine in engines.items():
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                outs, seconds = ours_generate(engine, prompts, params)
                stats = engine.stats
                runs[mode].append(dict(tok_s=sum(len(o[0].token_ids) for o in outs) / seconds,
                                       decode_step_ms=1e3 * stats["decode_s"] / max(stats["decode_steps"], 1),
                                       prefill_s=stats["prefill_s"],
                                       peak_memory_gb=torch.cuda.max_memory_allocated(device) / 2**30
                                       if device.type == "cuda" else None))
        row = {mode: {key: median([r[key] for r in rs]) if rs[0][key] is not None else None for key in rs[0]}
               | {"runs_tok_s": [r["tok_s"] for r in rs]} for mode, rs in runs.items()}
        row.update(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
                   exact_over_default=row["exact"]["tok_s"] / row["default"]["tok_s"])
        print("exact", shape, {mode: round(row[mode]["tok_s"]) for mode in engines},
              f"ratio {row['exact_over_default']:.3f}", flush=True)
        out[shape] = row
        del engines, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


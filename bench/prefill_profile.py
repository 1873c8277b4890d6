"""Where the rollout engine's prompt prefill spends its time at one shape (issue 59: Qwen3.5-0.8B's prefill took 10.3 s
of a 13.0 s generation on an H100, 32,768 prompt tokens). Random weights at `--shape` (`rollout_util.SHAPES`), `--batch`
prompts of `--prompt-len` tokens, each generating one token (so the run is the prefill and one sampled token): the
time of a first run (kernels compiled and tuned), of the next runs, and a torch.profiler table of one of them (CUDA and
CPU time per op). Prints and writes JSON.

    python bench/prefill_profile.py --device cuda --shape qwen3.5-0.8b --out bench/results/prefill_profile_cuda.json
    python bench/prefill_profile.py --device cpu --shape cpu-10m --batch 4    # smoke
"""

from __future__ import annotations

import argparse

import torch

from bench_util import DeviceMemoryWatch, git_commit, write_json
from hybridflow.engine.rollout import SamplingParams
from rollout_util import SHAPES, engine_from, make_model, ours_generate

ONE_TOKEN = SamplingParams(max_tokens=1, stop_token_ids=[])  # the prefill, and one sampled token a prompt


def timed(engine, prompts: list[list[int]]) -> float:
    return ours_generate(engine, prompts, ONE_TOKEN)[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--shape", default="qwen3.5-0.8b", choices=sorted(SHAPES))
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="runs after the first (the median is reported)")
    p.add_argument("--rows", type=int, default=25, help="profiler table rows")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/prefill_profile_<device>.json)")
    a = p.parse_args()
    device = torch.device(a.device)
    watch = DeviceMemoryWatch() if device.type == "cuda" else None  # the KV cache is mapped outside the allocator
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = make_model(a.shape, dtype, device)
    engine = engine_from(model, device, dtype, max_num_seqs=a.batch, max_model_len=a.prompt_len + 8)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, model.config.vocab_size, (a.batch, a.prompt_len), generator=gen).tolist()
    first = timed(engine, prompts)
    later = sorted(timed(engine, prompts) for _ in range(a.repeats))
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        profiled = timed(engine, prompts)
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=a.rows)
    cpu_table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=a.rows)
    print(table)
    print(cpu_table)
    tokens = a.batch * a.prompt_len
    median = later[len(later) // 2]
    report = {"bench": "prefill_profile", "commit": git_commit(), "settings": vars(a),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "first_s": first, "later_s": later, "median_s": median, "profiled_s": profiled,
              "prompt_tokens": tokens, "tokens_per_s": tokens / median, "engine_prefill_s": engine.stats["prefill_s"],
              "peak_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30 if watch else None,
              "peak_device_memory_gb": watch.stop() if watch else None,
              "profile": table, "profile_by_cpu": cpu_table}
    out = write_json(report, a.out or f"bench/results/prefill_profile_{a.device}.json")
    print(f"{a.shape}: {tokens} prompt tokens, first run {first:.2f} s, then {median:.3f} s (median of {a.repeats}) "
          f"= {tokens / median:,.0f} tok/s -> {out}")


if __name__ == "__main__":
    main()

"""Actor-update throughput and MFU of hybridflow's FSDP2 engine against a plain HF eager loop (one GPU).

    python bench/train.py --out bench/results/train_h200.json [--shapes 0.5b,1.5b] [--rows 64]

Random bf16-initialised Qwen2 shapes (built with `AutoConfig.for_model`), RL-shaped batches: prompts of
128-512 tokens (left-padded), responses of 32-1024 tokens (right-padded, a quarter cut at 1024). Both
sides run the same PPO-clip loss (token-mean) with AdamW and one global grad clip per mini-batch.
- hybridflow: `TrainEngine` (FSDP2 world size 1, bf16 params / fp32 master and reduce), packed rows
  (varlen flash attention), micro-batches by token budget, lm-head only on response positions.
- HF eager: the model in bf16 with fused AdamW, padded micro-batches of 8 rows, full logits.
Only real tokens (prompt + response, no padding) count towards throughput. MFU is reported against the
dense-bf16 datasheet peak (989 TFLOP/s) with attention FLOPs counted, and, to compare with
shared/PERF.md's 46.5 %, as 6 x parameters x tokens/s over the bf16 matmul rate measured in this run.
A profiler pass over one engine step says where the time goes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from collections import defaultdict
from types import SimpleNamespace

import torch
import torch.distributed as dist

SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}


def matmul_tflops(n: int = 8192, iters: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * n ** 3 * iters / (time.perf_counter() - t) / 1e12


def build_model_dir(shape: str, root: str) -> tuple[str, int]:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen2", max_position_embeddings=4096, rms_norm_eps=1e-6, **SHAPES[shape])
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    path = os.path.join(root, shape)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path, params


def rl_batch(rows: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    P, R = 512, 1024
    plen = torch.randint(128, P + 1, (rows,), generator=g)
    rlen = torch.randint(32, R + 1, (rows,), generator=g)
    rlen[torch.rand(rows, generator=g) < 0.25] = R
    ids = torch.randint(10, vocab, (rows, P + R), generator=g)
    col = torch.arange(P + R)
    mask = ((col >= P - plen[:, None]) & (col < P + rlen[:, None])).long()
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "response_mask": mask[:, P:].float(),
            "advantages": torch.randn(rows, R, generator=g) * mask[:, P:]}


def ppo_loss(logp, mb, global_tokens):
    from hybridflow.algorithms import compute_policy_loss

    loss, metrics = compute_policy_loss("ppo", mb["old_log_probs"], logp, mb["advantages"], mb["response_mask"],
                                        global_token_count=global_tokens)
    return loss, metrics


def flops_conventions(config, params: int, seq_lens: list[int], seconds: float, ceiling: float) -> dict:
    from hybridflow.engine.train.flops import PEAK_TFLOPS, train_flops

    tokens = sum(seq_lens)
    return {"tokens_per_s": tokens / seconds,
            "mfu_datasheet": train_flops(config, seq_lens) / seconds / (PEAK_TFLOPS["H200"] * 1e12),
            "mfu_perf_md": 6 * params * tokens / seconds / (ceiling * 1e12)}


def bench_engine(path, params, batch, args, ceiling, max_tokens: int) -> dict:
    from hybridflow.engine.train import TrainEngine

    model_cfg = SimpleNamespace(path=path, dtype="bf16", gradient_checkpointing=False,
                                attn_implementation="sdpa", trust_remote_code=False)
    optim = SimpleNamespace(lr=1e-6, lr_schedule="constant", lr_warmup_steps=0, min_lr_ratio=0.0,
                            weight_decay=0.01, betas=(0.9, 0.999), grad_clip=1.0)
    engine = TrainEngine(model_cfg, optim, head="lm", total_steps=100)
    seq_lens = batch["attention_mask"].sum(-1).tolist()
    torch.cuda.synchronize()
    t = time.perf_counter()
    old = engine.infer(batch, max_tokens=max_tokens * 2)["log_probs"]
    torch.cuda.synchronize()
    infer_s = time.perf_counter() - t
    batch = dict(batch, old_log_probs=old)

    def loss_fn(out, mb, ctx):
        return ppo_loss(out["log_probs"], mb, ctx.global_tokens)

    step = lambda: engine.train_step(batch, loss_fn, max_tokens=max_tokens)  # noqa: E731
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(args.steps):
        metrics = step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - t) / args.steps
    out = flops_conventions(engine.config, params, seq_lens, seconds, ceiling)
    out.update(step_s=seconds, log_prob_pass_tokens_per_s=sum(seq_lens) / infer_s,
               peak_memory_gb=torch.cuda.max_memory_allocated() / 2**30, grad_norm=metrics["grad_norm"],
               max_tokens_per_micro_batch=max_tokens)
    out["time_breakdown"] = profile(step)
    out["parity"] = parity(engine, batch)
    del engine
    torch.cuda.empty_cache()
    return out


def profile(step) -> dict:
    """GPU time of one step by kernel family (fractions) and the top kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    by_name = defaultdict(float)
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if e.device_type.name == "CUDA" or "cuda" in str(e.device_type).lower():
            by_name[e.key] += t
    families = {"matmul (gemm)": ("gemm", "cutlass", "sm90", "nvjet", "cublas", "matmul"),
                "attention (flash)": ("flash", "fmha", "attention"),
                "optimizer (adam)": ("adam",), "copies / casts": ("copy", "cast", "convert"),
                "reductions (logsumexp, norms)": ("reduce", "logsumexp", "norm", "softmax"),
                "communication (nccl)": ("nccl",)}
    totals = defaultdict(float)
    all_t = sum(by_name.values()) or 1.0
    for name, t in by_name.items():
        low = name.lower()
        fam = next((f for f, keys in families.items() if any(k in low for k in keys)), "other elementwise")
        totals[fam] += t
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    return {"gpu_ms": all_t / 1e3, "families": {k: round(v / all_t, 4) for k, v in totals.items()},
            "top_kernels": [[k[:90], round(v / all_t, 4)] for k, v in top]}


def parity(engine, batch) -> dict:
    small = {k: v[:8] for k, v in batch.items()}
    packed = engine.infer(small, max_tokens=8192, pack=True)["log_probs"]
    padded = engine.infer(small, micro_batch_size=4, pack=False)["log_probs"]
    m = small["response_mask"].bool()
    diff = (packed - padded)[m].abs()
    return {"packed_vs_padded_max_abs": float(diff.max()), "packed_vs_padded_mean_abs": float(diff.mean())}


def bench_hf(path, params, batch, args, ceiling, rows_per_mb: int = 8) -> dict:
    """A plain HF eager loop over padded micro-batches: the baseline."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01, fused=True)
    R = batch["response_mask"].shape[1]
    gpu = {k: v.cuda() for k, v in batch.items()}
    with torch.no_grad():
        gpu["old_log_probs"] = torch.cat([_hf_logp(model, {k: v[i:i + rows_per_mb] for k, v in gpu.items()}, R)
                                          for i in range(0, len(gpu["input_ids"]), rows_per_mb)])
    global_tokens = gpu["response_mask"].sum()

    def step():
        for i in range(0, len(gpu["input_ids"]), rows_per_mb):
            mb = {k: v[i:i + rows_per_mb] for k, v in gpu.items()}
            loss, _ = ppo_loss(_hf_logp(model, mb, R), mb, global_tokens)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    seq_lens = batch["attention_mask"].sum(-1).tolist()
    out = _time(step, args.steps)
    res = flops_conventions(model.config, params, seq_lens, out, ceiling)
    res.update(step_s=out, peak_memory_gb=torch.cuda.max_memory_allocated() / 2**30)
    del model, opt, gpu
    torch.cuda.empty_cache()
    return res


def _hf_logp(model, mb, R):
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                   position_ids=mb["position_ids"]).logits[:, -R - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, mb["input_ids"][:, -R:, None]).squeeze(-1)


def _time(step, steps) -> float:
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results/train_h200.json")
    parser.add_argument("--shapes", default="0.5b,1.5b")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budgets", default="0.5b:16384/32768,1.5b:16384/24576",
                        help="max_tokens_per_micro_batch values to try per shape")
    args = parser.parse_args()
    budgets = {k: [int(b) for b in v.split("/")] for k, v in (item.split(":") for item in args.budgets.split(","))}
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    import transformers

    ceiling = matmul_tflops()
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "transformers": transformers.__version__, "bf16_matmul_tflops_measured": ceiling,
               "rows_per_mini_batch": args.rows, "shapes": {}}
    print(f"bf16 matmul: {ceiling:.0f} TFLOP/s", flush=True)
    with tempfile.TemporaryDirectory() as root:
        for shape in args.shapes.split(","):
            path, params = build_model_dir(shape, root)
            batch = rl_batch(args.rows, SHAPES[shape]["vocab_size"])
            real = int(batch["attention_mask"].sum())
            entry = {"params": params, "real_tokens_per_step": real,
                     "padded_tokens_per_step": int(batch["attention_mask"].numel())}
            runs = {}
            for budget in budgets[shape]:
                try:
                    runs[budget] = bench_engine(path, params, batch, args, ceiling, budget)
                except torch.OutOfMemoryError:
                    runs[budget] = {"error": "out of memory", "tokens_per_s": 0.0}
                gc.collect()
                torch.cuda.empty_cache()
                print(shape, "hybridflow", budget, json.dumps({k: v for k, v in runs[budget].items()
                                                               if k != "time_breakdown"}), flush=True)
            entry["hybridflow_by_budget"] = runs
            entry["hybridflow"] = max(runs.values(), key=lambda r: r["tokens_per_s"])
            entry["hf_eager"] = bench_hf(path, params, batch, args, ceiling)
            print(shape, "hf_eager", json.dumps(entry["hf_eager"]), flush=True)
            entry["speedup_tokens_per_s"] = entry["hybridflow"]["tokens_per_s"] / entry["hf_eager"]["tokens_per_s"]
            results["shapes"][shape] = entry
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out, "w") as f:  # after each shape, so a cut-short run keeps what it measured
                json.dump(results, f, indent=2)
    print(f"{'shape':6} {'engine':10} {'tok/s':>9} {'MFU(989)':>9} {'MFU(PERF.md)':>12} {'step s':>7}")
    for shape, e in results["shapes"].items():
        for name in ("hybridflow", "hf_eager"):
            r = e[name]
            print(f"{shape:6} {name:10} {r['tokens_per_s']:9.0f} {r['mfu_datasheet']:9.1%} "
                  f"{r['mfu_perf_md']:12.1%} {r['step_s']:7.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

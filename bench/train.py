"""Actor-update throughput, device peak memory and MFU of the FSDP2 engine: one forward per mini-batch
against bounded micro-batches, eager and compiled, optionally against a plain HF eager loop.

    python bench/train.py --out bench/results/train_h200.json            # 0.5B and 1.5B on one GPU
    python bench/train.py --device cpu --shapes tiny --budgets full,256 --compile off   # a toy check

The question it answers (shared/PERF.md): does a 16k-token micro-batch update reach >= 90 % of the
one-forward update's tokens/s, at what device peak? Random bf16-initialised Qwen2 shapes with the real
151,936-token vocabulary (built with `AutoConfig.for_model`), RL-shaped batches: prompts of 128-512 tokens
(left-padded), responses of 32-1024 (right-padded, a quarter cut at 1024); `--rows` per shape (64 rows at
0.5B, 32 at 1.5B, so that one forward still fits). `smollm2` is the learning race's step: SmolLM2-135M's
shape, 512 rows of 32-128 + 8-256 tokens. Every configuration (shape x `--budgets` token budget,
`full` = one forward x `--compile` on/off x `--checkpointing` off/on) builds its own `TrainEngine` (FSDP2
world size 1, bf16 over fp32 master weights, packed rows, the fused log-prob head), runs the old-log-prob
pass, `--warmup` steps (the first compiles) and `--steps` timed PPO-clip steps. An out-of-memory error or
any other failure is recorded for that configuration and the next one runs; the JSON is rewritten after
each. Each run records the allocator's peak, the device's used memory, and the device budget's estimate
for the same micro-batch (`hybridflow.engine.budget`). `ratios` compares each run with one forward
(without recomputation) at the same compile setting. Only real tokens (prompt + response) count towards
throughput. MFU: against the dense-bf16 datasheet peak (989 TFLOP/s) with attention FLOPs, and as
6 x parameters x tokens/s over the bf16 matmul rate measured in this run (shared/PERF.md's convention).
`--hf` adds the plain HF loop (padded micro-batches of 8 rows, full logits); `--profile` a profiler
breakdown of each run's step (with `gpu_busy`, kernel time over wall time); `--trace DIR` a Chrome trace
of one step of each budgeted run. `--exact off,on` adds exact mode's update (`rollout.exact`: the engine's
forward on the batch-invariant ops, eager layers; docs/exact.md) beside each eager run, keyed `.../exact`;
with `--profile` its breakdown separates the invariant kernels (GEMM, attention, rows) from the rest.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import tempfile
import time
import traceback
from collections import defaultdict

import torch
import torch.distributed as dist

from bench_util import git_commit
from hybridflow.utils.model_shapes import QWEN_SHAPES, SMOLLM2_135M

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
    "0.5b": QWEN_SHAPES["0.5b"],
    "1.5b": QWEN_SHAPES["1.5b"],
    "smollm2": SMOLLM2_135M,  # the learning race's model: 512 rows of short prompts and responses
}
MODEL_TYPES = {"smollm2": "llama"}  # the rest: qwen2
ROWS = {"tiny": 8, "0.5b": 64, "1.5b": 32, "smollm2": 512}
WIDTHS = {"tiny": (32, 64), "smollm2": (128, 256)}  # (prompt, response) columns; the rest: (512, 1024)


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


def build_model_dir(shape: str, root: str, device: str) -> tuple[str, int]:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(MODEL_TYPES.get(shape, "qwen2"), max_position_embeddings=4096, rms_norm_eps=1e-6,
                               **SHAPES[shape])
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    params = sum(p.numel() for p in model.parameters())
    path = os.path.join(root, shape)
    model.save_pretrained(path)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return path, params


def rl_batch(rows: int, vocab: int, seed: int = 0, widths: tuple[int, int] = (512, 1024)) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    P, R = widths
    plen = torch.randint(P // 4, P + 1, (rows,), generator=g)
    rlen = torch.randint(R // 32, R + 1, (rows,), generator=g)
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


def flops_conventions(config, params: int, seq_lens: list[int], seconds: float, ceiling: float | None) -> dict:
    from hybridflow.engine.train.flops import PEAK_TFLOPS, train_flops

    tokens = sum(seq_lens)
    out = {"tokens_per_s": tokens / seconds}
    if ceiling is not None:
        out.update(mfu_datasheet=train_flops(config, seq_lens) / seconds / (PEAK_TFLOPS["H200"] * 1e12),
                   mfu_perf_md=6 * params * tokens / seconds / (ceiling * 1e12))
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_gb(device: str) -> float:
    """The allocator's peak on a GPU; the process's peak RSS on a CPU."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def estimated_peak_gb(config, tokens: int, device: str, checkpointing: bool) -> float:
    """The device budget's estimate of this update's peak (no rollout engine, no other models)."""
    from hybridflow.engine.budget import ModelShape, TrainedRole

    c = 2 if device == "cuda" else 4
    role = TrainedRole("actor", "model", ModelShape.from_config(config), compute_bytes=c, master_bytes=4)
    return (sum(role.update_bytes(1).values()) + role.activation_peak(tokens, checkpointing)) / 2**30


def bench_engine(path, params, batch, args, ceiling, max_tokens: int | None, compiled: bool, checkpointing: bool,
                 check_parity: bool = False, exact: bool = False) -> dict:
    """One configuration: old-log-prob pass, warm-up, timed steps, memory (and packed-vs-padded parity)."""
    from hybridflow.config.model_schema import ModelConfig, OptimConfig
    from hybridflow.engine.train import TrainEngine

    model_cfg = ModelConfig(path=path, dtype="bf16" if args.device == "cuda" else "fp32",
                            gradient_checkpointing=checkpointing, compile=compiled)
    optim = OptimConfig(lr=1e-6)
    engine = TrainEngine(model_cfg, optim, head="lm", total_steps=100, pack_on_cpu=True,
                         exact_len=batch["input_ids"].shape[1] if exact else None)
    seq_lens = batch["attention_mask"].sum(-1).tolist()
    sync(args.device)
    t = time.perf_counter()
    old = engine.infer(batch, max_tokens=None if max_tokens is None else max_tokens * 2)["log_probs"]
    sync(args.device)
    infer_s = time.perf_counter() - t
    batch = dict(batch, old_log_probs=old)

    def loss_fn(out, mb, ctx):
        return ppo_loss(out["log_probs"], mb, ctx.global_tokens)

    step = lambda: engine.train_step(batch, loss_fn, max_tokens=max_tokens)  # noqa: E731
    t = time.perf_counter()
    for _ in range(args.warmup):
        step()
    sync(args.device)
    warmup_s = time.perf_counter() - t
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(args.steps):
        metrics = step()
    sync(args.device)
    seconds = (time.perf_counter() - t) / args.steps
    out = flops_conventions(engine.config, params, seq_lens, seconds, ceiling)
    micro = len(engine.micro_batch_rows(batch, None, max_tokens))
    out.update(step_s=seconds, warmup_s=warmup_s, log_prob_pass_tokens_per_s=sum(seq_lens) / infer_s,
               micro_batches=micro, peak_memory_gb=peak_gb(args.device), grad_norm=metrics["grad_norm"],
               estimated_peak_gb=estimated_peak_gb(engine.config, max_tokens or sum(seq_lens), args.device,
                                                 checkpointing))
    if args.device == "cuda":
        free, total = torch.cuda.mem_get_info()
        out["device_used_gb"] = (total - free) / 2**30
    if args.profile and args.device == "cuda":
        out["time_breakdown"] = profile(step)
    if args.trace and max_tokens is not None:
        trace(step, os.path.join(args.trace, f"{max_tokens}_{'compiled' if compiled else 'eager'}"
                                 f"{'_ckpt' if checkpointing else ''}"))
    if check_parity and not exact:
        out["parity"] = parity(engine, batch)
    return out  # the engine goes with this frame; the caller empties the allocator cache


def profile(step) -> dict:
    """GPU time of one step by kernel family (fractions) and the top kernels; `gpu_busy`: kernel time over
    the step's wall time (well under 1: the host sets the pace)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    by_name = defaultdict(float)
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if e.device_type.name == "CUDA" or "cuda" in str(e.device_type).lower():
            by_name[e.key] += t
    families = {"invariant gemm (exact)": ("_linear_kernel",), "invariant attention (exact)": ("_attention_kernel",),
                "invariant rows (exact)": ("_rms_norm_kernel", "_rotary_kernel", "_silu_mul_kernel",
                                           "_log_prob_kernel"),
                "matmul (gemm)": ("gemm", "cutlass", "sm90", "nvjet", "cublas", "matmul"),
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
    return {"gpu_ms": all_t / 1e3, "wall_ms": wall * 1e3, "gpu_busy": all_t / 1e6 / wall,
            "families": {k: round(v / all_t, 4) for k, v in totals.items()},
            "top_kernels": [[k[:90], round(v / all_t, 4)] for k, v in top]}


def trace(step, path: str) -> None:
    """A Chrome trace (host and device) of one step, gzipped, at `path`.json.gz."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch_profile(activities=activities) as prof:
        step()
        sync("cuda" if torch.cuda.is_available() else "cpu")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    prof.export_chrome_trace(path + ".json.gz")


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


def run_shape(shape: str, root: str, args, ceiling: float | None, results: dict, save) -> None:
    path, params = build_model_dir(shape, root, args.device)
    widths = WIDTHS.get(shape, (512, 1024))
    batch = rl_batch(args.rows[shape], SHAPES[shape]["vocab_size"], widths=widths)
    entry = results["shapes"][shape] = {"params": params, "rows": len(batch["input_ids"]),
                                        "real_tokens_per_step": int(batch["attention_mask"].sum()),
                                        "padded_tokens_per_step": int(batch["attention_mask"].numel()), "runs": {}}
    for compiled in args.compile:
        mode = "compiled" if compiled else "eager"
        for checkpointing, budget, exact in ((c, b, e) for c in args.checkpointing for b in args.budgets
                                         for e in args.exact if not (e and compiled)):
            key = f"{'full' if budget is None else budget}/{mode}{'/ckpt' if checkpointing else ''}" \
                  f"{'/exact' if exact else ''}"
            try:
                entry["runs"][key] = bench_engine(path, params, batch, args, ceiling, budget, compiled,
                                                  checkpointing, check_parity=not entry["runs"], exact=exact)
            except torch.OutOfMemoryError as e:
                entry["runs"][key] = {"error": "out of memory", "message": str(e).splitlines()[0]}
            except Exception as e:  # a failed configuration is recorded; the others still run
                entry["runs"][key] = {"error": type(e).__name__, "message": traceback.format_exc()[-3000:]}
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
            print(shape, key, json.dumps({k: v for k, v in entry["runs"][key].items() if k != "time_breakdown"}),
                  flush=True)
            save()
        full = entry["runs"].get(f"full/{mode}", {})  # one forward without recomputation: the reference
        for key, run in entry["runs"].items():
            if key.split("/")[1] == mode and not key.startswith("full/") and "tokens_per_s" in run \
                    and "tokens_per_s" in full:
                entry.setdefault("ratios", {})[key.replace("/", "_vs_full/", 1)] = \
                    run["tokens_per_s"] / full["tokens_per_s"]
    if args.hf:
        entry["hf_eager"] = bench_hf(path, params, batch, args, ceiling)
        print(shape, "hf_eager", json.dumps(entry["hf_eager"]), flush=True)
    save()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/train_<device>.json)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--shapes", default="0.5b,1.5b")
    parser.add_argument("--rows", default="", help="rows per mini-batch, per shape (shape:rows,...); default "
                        + ", ".join(f"{k}:{v}" for k, v in ROWS.items()))
    parser.add_argument("--budgets", default="full,16384", help="micro-batch token budgets; full = one forward")
    parser.add_argument("--compile", default="on,off", help="compiled decoder layers: on, off or both")
    parser.add_argument("--checkpointing", default="off", help="gradient checkpointing: off, on or both")
    parser.add_argument("--exact", default="off", help="exact mode's update beside each eager run: off, on or both")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hf", action="store_true", help="also time the plain HF eager loop")
    parser.add_argument("--profile", action="store_true", help="profiler breakdown of each run (GPU)")
    parser.add_argument("--trace", default=None, help="folder for a Chrome trace of one step of each budgeted run")
    args = parser.parse_args()
    if args.hf and args.device != "cuda":
        parser.error("--hf times the plain loop on a GPU only")
    args.rows = dict(ROWS, **{k: int(v) for k, v in (item.split(":") for item in args.rows.split(",") if item)})
    args.budgets = [None if b == "full" else int(b) for b in args.budgets.split(",")]
    args.compile = [c == "on" for c in args.compile.split(",")]
    args.checkpointing = [c == "on" for c in args.checkpointing.split(",")]
    args.exact = [c == "on" for c in args.exact.split(",")]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    import transformers

    if cuda:
        torch.cuda.set_device(0)
    ceiling = matmul_tflops() if cuda else None
    results = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
               "transformers": transformers.__version__, "commit": git_commit(),
               "bf16_matmul_tflops_measured": ceiling,
               "settings": {k: v for k, v in vars(args).items() if k != "out"}, "shapes": {}}
    out = args.out or f"bench/results/train_{'h200' if cuda else 'cpu'}.json"

    def save() -> None:  # after each configuration, so a cut-short run keeps what it measured
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(results, f, indent=2)

    if ceiling:
        print(f"bf16 matmul: {ceiling:.0f} TFLOP/s", flush=True)
    with tempfile.TemporaryDirectory() as root:
        for shape in args.shapes.split(","):
            run_shape(shape, root, args, ceiling, results, save)
    print(f"{'shape':6} {'run':28} {'tok/s':>9} {'MFU(PERF.md)':>12} {'step s':>7} {'peak GiB':>9} {'est GiB':>8}")
    for shape, e in results["shapes"].items():
        for key, r in e["runs"].items():
            if "error" in r:
                print(f"{shape:6} {key:28} {r['error']}")
                continue
            print(f"{shape:6} {key:28} {r['tokens_per_s']:9.0f} {r.get('mfu_perf_md', 0):12.1%} {r['step_s']:7.2f} "
                  f"{r['peak_memory_gb']:9.1f} {r['estimated_peak_gb']:8.1f}")
        for key, ratio in e.get("ratios", {}).items():
            print(f"{shape:6} {key}: {ratio:.1%} of one forward's tokens/s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Rollout throughput: hybridflow's RolloutEngine against `transformers.generate`, in the same run.

    python bench/rollout.py --device cpu                 # ~10M-param Qwen2 shape, fp32, batch 64, 3 runs
    python bench/rollout.py --device cpu --rl-only       # only the RL-shaped (varied lengths) run
    python bench/rollout.py --shapes olmo2-1b phi3-mini phi4-mini gemma3-4b qwen3.5-0.8b   # other families' shapes
    python bench/rollout.py --device cuda --out bench/results/rollout_h200.json
    python bench/rollout.py --device cuda --quick --skip-hf   # smoke: 0.5B, batch 256, ours only
    python bench/rollout.py --device cuda --long [--long-max 8192]   # only the long-response regime
    python bench/rollout.py --device cuda --profile           # + a torch.profiler account of a decode run
    python bench/rollout.py --device cuda --exact             # only exact mode against the default (rollout_exact.py)

On CPU: the fixed-length run at batch 64 (prompt 32, 64 new tokens; ours and `generate` alternate
three times and the medians are reported, since the 2-core machine is shared), then an RL-shaped one
(prompts of varied length, ~2 % of the vocabulary as stop ids) where `generate` pads and keeps computing
finished rows.
On CUDA: the fused kernels against torch, one layer's decode attention (flash against the Triton kernel at
several splits and tiles), a parity check (greedy on a small random Qwen2 in fp32 must match HF token for
token; in bf16 the first tokens and the log-probs are compared), the device-copy bandwidth, then at the
Qwen2-0.5B and 1.5B shapes (random bf16 weights): the weight sync (`load_weights` from the HF model's
parameters), sleep/wake, tokens/s of ours and of `generate` at batch 64 and 256 (prompt 128, 256 new tokens,
EOS ignored, temperature 1), the decode step against the bandwidth roofline, and a run with varied stop
lengths (4x as many prompts as slots; ~1 % of the vocabulary are stop ids) comparing continuous batching with
waves of static batches; then the long-response regime at both shapes (prompt 512, up to 4,096 new tokens,
batch 256: bench/rollout_long.py) and the shared prefill of n samples (32 prompts x 8). On CPU the long
regime, the shared-prefill check and the profile run at a toy size. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from bench_util import git_commit, write_json
from hybridflow.engine.rollout import SamplingParams
from rollout_exact import bench_exact
from rollout_long import bench_long, profile_decode, shared_prefill
from rollout_util import SHAPES, engine_from, hf_generate, make_model, median, ours_generate, sync

def check_kernels(device: torch.device) -> dict:
    """The fused CUDA kernels against their torch references (max abs differences, bf16 inputs)."""
    from hybridflow.engine.rollout import kernels

    torch.manual_seed(0)
    h, d = (torch.randn(37, 896, device=device, dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(896, device=device, dtype=torch.bfloat16)
    out, total = kernels.add_rms_norm(h, d, w, 1e-6)
    ref_total = h + d
    ref = kernels._rms_norm_torch(ref_total, w, 1e-6)
    qkv = torch.randn(37, 20 * 64, device=device, dtype=torch.bfloat16)
    pos = torch.randint(0, 300, (37,), device=device)
    cos, sin = torch.randn(512, 64, device=device).cos(), torch.randn(512, 64, device=device).sin()
    cos, sin = torch.cat([cos[:, :32]] * 2, 1), torch.cat([sin[:, :32]] * 2, 1)
    qk = qkv[:, :16 * 64].view(37, 16, 64)
    x1, x2 = qk.chunk(2, -1)
    c, s = cos[pos].to(qk.dtype)[:, None], sin[pos].to(qk.dtype)[:, None]
    rot_ref = qk * c + torch.cat((-x2, x1), -1) * s
    kernels.rotary_(qk, pos, cos, sin)
    gu = torch.randn(37, 2 * 4864, device=device, dtype=torch.bfloat16)
    g, u = gu.chunk(2, -1)
    logits = torch.randn(64, 151936, device=device, dtype=torch.bfloat16) * 3
    seed = torch.tensor([123], device=device)
    one, inv_07 = (torch.tensor([t], device=device) for t in (1.0, 1 / 0.7))
    greedy_tok, greedy_lp = kernels.sample_plain(logits, one, seed, True)
    ref_lp = logits.float().log_softmax(-1)
    small = torch.tensor([[2.0, 1.0, 0.0, -1.0, -2.0]], device=device).repeat(20000, 1)
    tok, lp = kernels.sample_plain(small, inv_07, seed, False)
    freq = torch.bincount(tok, minlength=5).float() / tok.numel()
    return dict(add_rms_norm=(out.float() - ref.float()).abs().max().item(),
                residual_sum=(total.float() - ref_total.float()).abs().max().item(),
                rotary=(qk.float() - rot_ref.float()).abs().max().item(),
                silu_mul=(kernels.silu_mul(gu).float() - (torch.nn.functional.silu(g) * u).float()).abs().max().item(),
                greedy_token_match=bool((greedy_tok == logits.float().argmax(-1)).all()),
                greedy_logprob=(greedy_lp - ref_lp.gather(-1, greedy_tok[:, None])[:, 0]).abs().max().item(),
                sample_freq_vs_softmax=(freq - (small[0] / 0.7).softmax(-1)).abs().max().item(),
                sample_logprob=(lp - (small[0] / 0.7).log_softmax(-1)[tok]).abs().max().item())


def decode_attention_sweep(device: torch.device) -> dict:
    """Decode attention over the slot cache: flash's varlen kernel (the path before the Triton kernel)
    against `decode_attention` at several splits, tiles and warp counts; device microseconds per layer,
    and the settings the engine picks; at the 0.5B (7 query heads per KV head, D 64) and 1.5B (6, D 128)
    shapes, rows of the mean short (256) and long (2,560) contexts, and at SmolLM2's (3 KV heads of 3 queries,
    D 64) over 8,448-position slots with contexts spread evenly up to the slot (a partial rollout's full buffer
    of long samples at every stage: a program's time is its row's length, and one row of 8,192 positions outlasts
    the rest). As in a decode step, each call reads
    another layer's cache: the graph runs one call per layer over enough layers' caches (>= 1 GiB, 2 at
    least) that none is still in L2 when its turn comes again (a single layer's cache, read 20 times,
    stayed partly in the 50 MB L2 and made short contexts look faster)."""
    from hybridflow.engine.rollout import attention, decode_attention as da

    def timed(fn, layers: int) -> float:
        for layer in range(layers):
            fn(layer)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        calls = max(layers, 24)
        with torch.cuda.graph(graph):
            for call in range(calls):
                fn(call % layers)
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / (10 * calls)

    out = {}
    for rows, kv_heads, group, dim, context, max_len in (
            (256, 2, 7, 64, 256, 384), (64, 2, 7, 64, 256, 384), (256, 2, 6, 128, 256, 384),
            (256, 2, 7, 64, 2560, 4608), (320, 3, 3, 64, "spread", 8448)):
        layer_bytes = 2 * (rows + 1) * max_len * kv_heads * dim * 2
        layers = max(2, -(-2**30 // layer_bytes))
        caches = [torch.randn(2, rows + 1, max_len, kv_heads, dim, device=device, dtype=torch.bfloat16)
                  for _ in range(layers)]
        q = torch.randn(rows, kv_heads * group, dim, device=device, dtype=torch.bfloat16)
        slots = torch.arange(rows, device=device)
        if context == "spread":  # the rows' contexts evenly spaced over 1 .. max_len, in a shuffled order
            lens = torch.linspace(1, max_len, rows)[torch.randperm(rows, generator=torch.Generator().manual_seed(0))]
            lens = lens.to(device=device, dtype=torch.int32)
        else:
            lens = torch.full((rows,), context, device=device, dtype=torch.int32)
        starts = slots * max_len
        cu_k = torch.cat([starts, starts[-1:] + max_len]).int()
        cu_q = torch.arange(rows + 1, device=device, dtype=torch.int32)
        flash = timed(lambda i: torch.ops.aten._flash_attention_forward(
            q, caches[i][0].view(-1, kv_heads, dim), caches[i][1].view(-1, kv_heads, dim), cu_q, cu_k, 1, max_len,
            0.0, False, False, scale=dim ** -0.5, seqused_k=lens), layers)
        splits = (1, 2, 4) if context != "spread" else (1, 2, 4, 8, 16)
        triton_us = {f"splits{s}_block{b}_warps{w}": timed(
            lambda i, s=s, b=b, w=w: da.decode_attention(q, caches[i][0], caches[i][1], slots, lens,
                                                         dim ** -0.5, s, b, w), layers)
            for s in splits for b in (32, 64, 128) for w in (2, 4)}
        best = min(triton_us, key=triton_us.get)
        picked = da.decode_splits(rows, kv_heads, max_len, attention._multiprocessors(device))
        # timed on its own: the engine's pick may be a split the sweep leaves out
        default = timed(lambda i: da.decode_attention(q, caches[i][0], caches[i][1], slots, lens, dim ** -0.5,
                                                      picked), layers)
        key = f"rows{rows}_group{group}_d{dim}_ctx{context}"
        kv_bytes = 2 * int(lens.sum()) * kv_heads * dim * 2  # keys and values of every row's context
        out[key] = dict(flash_us=flash, triton_us=triton_us, best=best, picked_splits=picked, default_us=default,
                        layers=layers, kv_bytes=kv_bytes, floor_us=kv_bytes / 4.8e12 * 1e6)  # at an H200's 4.8 TB/s
        rate = kv_bytes / 1e6  # TB/s at a time in microseconds
        print("decode attention", key, f"flash {flash:.1f} us, best {best} {triton_us[best]:.1f} us "
              f"({rate / triton_us[best]:.2f} TB/s), default (splits {picked}) {default:.1f} us ({rate / default:.2f} "
              f"TB/s), floor {out[key]['floor_us']:.1f} us", flush=True)
        del caches
    return out


def parity(device: torch.device) -> dict:
    """Greedy vs HF on a small spread-weight Qwen2: fp32 token-identical, bf16 first tokens + log-probs;
    sampled log-probs (T=0.8) against a full forward's log_softmax(logits / T)."""
    result = {}
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, 1000, (16, 24), generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        small = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=768, vocab_size=1024)
        model = make_model("cpu-10m", dtype, device, spread=0.15, **small)
        engine = engine_from(model, device, dtype, max_num_seqs=16, max_model_len=96)
        outs = engine.generate(prompts.tolist(), SamplingParams(temperature=0.0, max_tokens=48,
                                                                stop_token_ids=[]))
        ref, _ = hf_generate(model, prompts.to(device), 48, greedy=True)
        ours = torch.tensor([o[0].token_ids for o in outs], device=device)
        same_prefix = (ours == ref).int().cumprod(-1).sum(-1).float()
        with torch.no_grad():
            logits = model(torch.cat([prompts.to(device), ours], 1)).logits[:, 23:-1].float()
        lp_ref = logits.log_softmax(-1).gather(-1, ours[..., None])[..., 0]
        lp_ours = torch.tensor([o[0].logprobs for o in outs], device=device)
        name = str(dtype).removeprefix("torch.")
        result[name] = dict(all_tokens_identical=bool((ours == ref).all()),
                            mean_identical_prefix=same_prefix.mean().item(), of_tokens=48,
                            first8_identical_rows=int((same_prefix >= 8).sum()), rows=16,
                            logprob_max_abs_diff_vs_forward=(lp_ours - lp_ref).abs().max().item())
        outs = engine.generate(prompts.tolist(), SamplingParams(n=2, temperature=0.8, max_tokens=48,
                                                                stop_token_ids=[], seed=0))
        ours = torch.tensor([s.token_ids for o in outs for s in o], device=device)
        with torch.no_grad():
            logits = model(torch.cat([prompts.to(device).repeat_interleave(2, 0), ours], 1)).logits[:, 23:-1]
        lp_ref = (logits.float() / 0.8).log_softmax(-1).gather(-1, ours[..., None])[..., 0]
        lp_ours = torch.tensor([s.logprobs for o in outs for s in o], device=device)
        result[name]["sampled_logprob_max_abs_diff_vs_forward"] = (lp_ours - lp_ref).abs().max().item()
        del engine, model
    return result


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy, bytes read + written per second."""
    x = torch.empty(2**30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync(device)
    return 2 * 10 * x.numel() / (time.perf_counter() - start)


def bench_shape(shape: str, device, dtype, batches, prompt_len, new_tokens, skip_hf, bandwidth,
                repeats: int = 1, hf_new_tokens: int | None = None) -> dict:
    """Ours against `generate` at `shape`; `hf_new_tokens`: fewer new tokens for `generate` (its rate is per token;
    a sparse MoE's `generate` loops over its experts, minutes at 256 tokens and 512 experts), default `new_tokens`."""
    model = make_model(shape, dtype, device)
    n_params = sum(p.numel() for p in model.parameters())
    engine = engine_from(model, device, dtype, max_num_seqs=max(batches),
                         max_model_len=prompt_len + new_tokens)
    cfg = model.config
    row = dict(params_m=n_params / 1e6, graph_capture_s=engine.stats.get("graph_capture_s"),
               kv_cache_gb=engine.stats["kv_cache_gb"])
    sync_times = []
    for _ in range(3):
        sync(device)
        start = time.perf_counter()
        engine.load_weights(model.named_parameters())
        sync(device)
        sync_times.append(time.perf_counter() - start)
    row["timing_s/update_weights"] = sorted(sync_times)[1]
    start = time.perf_counter()
    engine.sleep()
    row["sleep_s"] = time.perf_counter() - start
    start = time.perf_counter()
    engine.wake()
    sync(device)
    row["wake_s"] = time.perf_counter() - start
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, stop_token_ids=[], seed=0)
    engine.generate([[5] * prompt_len] * 4, SamplingParams(max_tokens=8, stop_token_ids=[]))  # warm-up
    row["batches"] = {}
    for batch in batches:
        prompts = torch.randint(4, cfg.vocab_size, (batch, prompt_len), generator=gen)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        # the first prefill at this batch's shape compiles kernels for it (flash-linear-attention's Triton kernels
        # specialise on the packed token count: 49 s at 256 x 128 tokens of Qwen3.5-0.8B on an H100, 0.24 s after);
        # a run pays it once, so it is timed apart and the timed runs start warm
        first_use_s = ours_generate(engine, prompts.tolist(), SamplingParams(max_tokens=2, stop_token_ids=[]))[1]
        ours_runs, hf_runs = [], []
        for _ in range(repeats):  # ours and generate alternate, so a shared machine's load hits both
            outs, seconds = ours_generate(engine, prompts.tolist(), params)
            ours_runs.append(sum(len(o[0].token_ids) for o in outs) / seconds)
            # printed before `generate` runs: a call cut short in it (a 512-expert shape's) keeps our figure
            print(shape, batch, f"ours {ours_runs[-1]:,.0f} tok/s (first use {first_use_s:.2f} s)", flush=True)
            if not skip_hf:
                hf_tokens, hf_seconds = hf_generate(model, prompts.to(device), hf_new_tokens or new_tokens)
                hf_runs.append(hf_tokens.numel() / hf_seconds)
        stats = engine.stats
        step_ms = 1e3 * stats["decode_s"] / max(stats["decode_steps"], 1)
        avg_ctx = prompt_len + new_tokens / 2
        # a step reads each row's K/V (its cached layers only) and reads and writes its recurrent states (a hybrid's)
        kv_bytes = batch * (avg_ctx * engine.kv.token_bytes + 2 * engine.kv.state_bytes)
        roofline_ms = 1e3 * (n_params * dtype.itemsize + kv_bytes) / bandwidth if bandwidth else None
        entry = dict(ours_tok_s=median(ours_runs), ours_s=batch * new_tokens / median(ours_runs),
                     first_use_s=first_use_s, prefill_s=stats["prefill_s"], decode_step_ms=step_ms, roofline_step_ms=roofline_ms,
                     roofline_fraction=roofline_ms / step_ms if roofline_ms else None,
                     peak_memory_gb=torch.cuda.max_memory_allocated(device) / 2**30
                     if device.type == "cuda" else None)
        if repeats > 1:
            entry.update(ours_runs_tok_s=ours_runs, hf_runs_tok_s=hf_runs)
        if not skip_hf:
            entry.update(hf_tok_s=median(hf_runs), hf_s=batch * new_tokens / median(hf_runs),
                         hf_new_tokens=hf_new_tokens or new_tokens)
            entry["speedup"] = entry["ours_tok_s"] / entry["hf_tok_s"]
        row["batches"][batch] = entry
        print(shape, batch, {k: round(v, 4) if isinstance(v, float) else v for k, v in entry.items()},
              flush=True)
    row["timing_s/update_weights_over_step"] = row["timing_s/update_weights"] / row["batches"][max(batches)]["ours_s"]
    del engine, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def bench_varied(shape: str, device, dtype, slots: int, prompt_len: int, new_tokens: int) -> dict:
    """4 x slots prompts whose samples stop at varied lengths (random stop ids); continuous batching vs
    static waves of `slots` prompts (a wave ends with its longest sample)."""
    model = make_model(shape, dtype, device)
    engine = engine_from(model, device, dtype, max_num_seqs=slots, max_model_len=prompt_len + new_tokens)
    vocab = model.config.vocab_size
    stop_ids = list(range(4, 4 + vocab // 100))
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, stop_token_ids=stop_ids, seed=0)
    gen = torch.Generator().manual_seed(2)
    prompts = torch.randint(4 + len(stop_ids), vocab, (4 * slots, prompt_len), generator=gen).tolist()
    engine.generate(prompts[:4], SamplingParams(max_tokens=8, stop_token_ids=[]))  # warm-up
    outs, cont_s = ours_generate(engine, prompts, params)
    lengths = [len(o[0].token_ids) for o in outs]
    wave_s = 0.0
    for start in range(0, len(prompts), slots):
        wave_s += ours_generate(engine, prompts[start:start + slots], params)[1]
    useful = sum(lengths)
    result = dict(prompts=len(prompts), slots=slots, mean_length=useful / len(lengths), max_length=max(lengths),
                  stopped_fraction=sum(o[0].finish_reason == "stop" for o in outs) / len(outs),
                  continuous_tok_s=useful / cont_s, static_waves_tok_s=useful / wave_s,
                  continuous_gain=wave_s / cont_s)
    print("varied", result, flush=True)
    del engine, model
    return result


def bench_rl_shaped(shape: str, device, dtype, batch: int, new_tokens: int) -> dict:
    """RL-shaped: prompts of 8-32 tokens (left-padded for `generate`), ~2 % of the vocabulary as stop
    ids; useful tokens (up to and including the stop token) per second, ours against `generate`."""
    model = make_model(shape, dtype, device)
    engine = engine_from(model, device, dtype, max_num_seqs=batch, max_model_len=32 + new_tokens)
    vocab = model.config.vocab_size
    stop_ids = list(range(4, 4 + vocab // 50))
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(8, 33, (batch,), generator=gen).tolist()
    prompts = [torch.randint(4 + len(stop_ids), vocab, (n,), generator=gen).tolist() for n in lengths]
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, stop_token_ids=stop_ids, seed=0)
    engine.generate(prompts[:4], SamplingParams(max_tokens=4, stop_token_ids=[]))  # warm-up
    outs, ours_s = ours_generate(engine, prompts, params)
    ours_useful = sum(len(o[0].token_ids) for o in outs)
    width = max(lengths)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = (torch.arange(width)[None, :] >= width - torch.tensor(lengths)[:, None]).long().to(device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=True,
                         temperature=1.0, top_k=0, top_p=1.0, eos_token_id=stop_ids, pad_token_id=0)
    hf_s = time.perf_counter() - start
    stop = set(stop_ids)
    hf_useful = 0
    for row in out[:, width:].tolist():
        hf_useful += next((k + 1 for k, t in enumerate(row) if t in stop), len(row))
    result = dict(batch=batch, ours_mean_length=ours_useful / batch, hf_mean_length=hf_useful / batch,
                  ours_tok_s=ours_useful / ours_s, hf_tok_s=hf_useful / hf_s,
                  speedup=(ours_useful / ours_s) / (hf_useful / hf_s))
    print("rl_shaped", result, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument("--quick", action="store_true", help="0.5B at batch 256 only (CUDA)")
    parser.add_argument("--skip-hf", action="store_true", help="do not time transformers.generate")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (CPU runs)")
    parser.add_argument("--rl-only", action="store_true", help="CPU: only the RL-shaped run")
    parser.add_argument("--long", action="store_true", help="only the long-response regime and shared prefill")
    parser.add_argument("--skip-long", action="store_true", help="leave out the long-response regime")
    parser.add_argument("--long-max", type=int, default=4096, help="most new tokens in the long regime (CUDA)")
    parser.add_argument("--hf-new-tokens", type=int, default=None,
                        help="--shapes: new tokens `generate` is timed for (default: as ours, 256)")
    parser.add_argument("--hf-long-tokens", type=int, default=512,
                        help="new tokens `generate` is timed for in the long regime")
    parser.add_argument("--profile", action="store_true", help="torch.profiler over a decode run, into the JSON "
                                                                   "(of exact mode's engine with --exact)")
    parser.add_argument("--attention-only", action="store_true", help="CUDA: only the decode attention sweep")
    parser.add_argument("--exact", action="store_true", help="only exact mode's engine against the default")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=None,
                        help="only these shapes' tok/s against generate at batch 256 (prompt 128, 256 new tokens): "
                             "e.g. olmo2-1b phi3-mini phi4-mini gemma3-4b qwen3.5-0.8b, the other families' fast paths")
    args = parser.parse_args()
    device = torch.device(args.device)
    result = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                  torch=torch.__version__, commit=git_commit())
    import transformers

    result["transformers"] = transformers.__version__
    cpu = device.type == "cpu"
    if cpu:
        torch.set_num_threads(args.threads)
        result["threads"] = args.threads
    if args.shapes:
        batches, bandwidth = [256] if not cpu else [16], None if cpu else copy_bandwidth(device)
        result["shapes"] = {s: bench_shape(s, device, torch.float32 if cpu else torch.bfloat16, batches, 128, 256,
                                           args.skip_hf, bandwidth, hf_new_tokens=args.hf_new_tokens)
                            for s in args.shapes}
    elif args.exact:
        result["exact"] = bench_exact(device, torch.float32 if cpu else torch.bfloat16, 8 if cpu else 128,
                                      8 if cpu else 256, 1 if cpu else 3)
    elif cpu and not args.long:
        if not args.rl_only:
            result["shapes"] = {"cpu-10m": bench_shape("cpu-10m", device, torch.float32, [64], 32, 64,
                                                       args.skip_hf, None, repeats=3)}
        result["rl_shaped"] = bench_rl_shaped("cpu-10m", device, torch.float32, 64, 128)
    elif args.attention_only:
        result["decode_attention"] = decode_attention_sweep(device)
    elif not args.long:
        result["kernels"] = check_kernels(device)
        print("kernels", result["kernels"], flush=True)
        result["decode_attention"] = decode_attention_sweep(device)
        result["parity"] = parity(device)
        print("parity", result["parity"], flush=True)
        bandwidth = copy_bandwidth(device)
        result["copy_bandwidth_tb_s"] = bandwidth / 1e12
        shapes = ["qwen2-0.5b"] if args.quick else ["qwen2-0.5b", "qwen2-1.5b"]
        batches = [256] if args.quick else [64, 256]
        result["shapes"] = {s: bench_shape(s, device, torch.bfloat16, batches, 128, 256, args.skip_hf,
                                           bandwidth) for s in shapes}
        result["varied_stop"] = bench_varied("qwen2-0.5b", device, torch.bfloat16, 256, 128, 256)
    dtype = torch.float32 if cpu else torch.bfloat16
    if args.long or not (args.skip_long or args.quick or args.rl_only or args.attention_only or args.exact
                         or args.shapes):
        if cpu:  # toy size: prompt 32, up to 128 new tokens, batch 16
            result["long"] = {"cpu-10m": bench_long("cpu-10m", device, dtype, 16, 32, 128, (16, 32), 32,
                                                    args.skip_hf)}
        else:
            result["long"] = {s: bench_long(s, device, dtype, 256, 512, args.long_max, (128, 256),
                                            args.hf_long_tokens, args.skip_hf) for s in ("qwen2-0.5b", "qwen2-1.5b")}
        result["shared_prefill"] = shared_prefill("cpu-10m" if cpu else "qwen2-0.5b", device, dtype,
                                                  8 if cpu else 32, 4 if cpu else 8, 16 if cpu else 256)
    if args.profile:
        result["profile"] = profile_decode("cpu-10m" if cpu else "qwen2-0.5b", device, dtype, 16 if cpu else 256,
                                           32 if cpu else 128, 16 if cpu else 256, exact=args.exact)
    print(json.dumps(result, indent=1))
    if args.out:
        write_json(result, args.out)


if __name__ == "__main__":
    main()

"""The long-response regime of bench/rollout.py, its decode profile, and the shared-prefill check.

- `bench_long`: prompt 512, up to `max_new` new tokens (4,096; 8,192 with --long-max 8192), batch 256,
  on one engine: (a) every row runs to max_new (EOS ignored): decode at long context; (b) per-row
  lengths drawn from a clipped log-normal (median max_new / 4, ~4 % at the cap), as RL responses
  spread: tokens/s with the tail (fewer rows left) included, and the mean length; both against the
  short-response rate (prompt 128, 256 new tokens) on the same engine. KV-cache GiB and device peak
  (the HF model's weights included). `generate` at the same prompt length and batch, for its first
  `hf_tokens` new tokens only: an upper bound on its rate over the whole length (its step slows as its
  cache grows), since the whole length would take minutes.
- `profile_decode`: torch.profiler over one generate call: the top device kernels (time, calls, per
  decode step) and device-busy against wall time per decode step; on CPU the top ops by self time.
- `shared_prefill`: the GRPO shape (prompts x n samples): each prompt is prefilled once (prefill tokens
  equal the prompts' tokens, not n times them), asserted.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from hybridflow.engine.rollout import SamplingParams
from rollout_util import engine_from, hf_generate, make_model, ours_generate, sync


def spread_lengths(count: int, max_new: int, seed: int = 5) -> list[int]:
    """Response lengths from a log-normal with median max_new / 4 (sigma 0.8), clipped to [32, max_new]."""
    gen = torch.Generator().manual_seed(seed)
    lengths = (max_new / 4) * torch.exp(0.8 * torch.randn(count, generator=gen))
    return lengths.clamp(32, max_new).long().tolist()


def run_lengths(engine, prompts: list[list[int]], lengths: list[int], params: SamplingParams) -> tuple[list, float]:
    """One session with a per-row max_tokens; (completions, seconds)."""
    sync(engine.device)
    start = time.perf_counter()
    session = engine.session(params)
    seqs = [session.add(p, max_tokens=m)[0] for p, m in zip(prompts, lengths)]
    done = session.run()
    sync(engine.device)
    seconds = time.perf_counter() - start
    engine.stats.update(decode_steps=session.stats["decode_steps"], prefill_s=session.stats["prefill_s"],
                        decode_s=seconds - session.stats["prefill_s"])
    return [done[s] for s in seqs], seconds


def rate(engine, outs: list, seconds: float, device: torch.device) -> dict:
    tokens = sum(len(o.token_ids) for o in outs)
    stats = engine.stats
    return dict(tok_s=tokens / seconds, seconds=seconds, mean_length=tokens / len(outs),
                max_length=max(len(o.token_ids) for o in outs), decode_steps=stats["decode_steps"],
                decode_step_ms=1e3 * stats["decode_s"] / max(stats["decode_steps"], 1),
                mean_rows_per_step=tokens / max(stats["decode_steps"], 1),
                peak_memory_gb=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None)


def bench_long(shape: str, device, dtype, batch: int, prompt_len: int, max_new: int, short: tuple[int, int],
               hf_tokens: int, skip_hf: bool) -> dict:
    model = make_model(shape, dtype, device, max_position_embeddings=prompt_len + max_new)
    vocab = model.config.vocab_size
    engine = engine_from(model, device, dtype, max_num_seqs=batch, max_model_len=prompt_len + max_new)
    gen = torch.Generator().manual_seed(4)
    prompts = torch.randint(4, vocab, (batch, prompt_len), generator=gen)
    params = SamplingParams(temperature=1.0, max_tokens=max_new, stop_token_ids=[], seed=0)
    engine.generate(prompts[:4].tolist(), SamplingParams(max_tokens=8, stop_token_ids=[]))  # warm-up
    row = dict(batch=batch, prompt=prompt_len, max_new=max_new, kv_cache_gb=engine.stats["kv_cache_gb"],
               kv_cache_slots=engine.stats["num_slots"])
    short_prompts = torch.randint(4, vocab, (batch, short[0]), generator=gen).tolist()
    outs, seconds = ours_generate(engine, short_prompts, SamplingParams(temperature=1.0, max_tokens=short[1],
                                                                        stop_token_ids=[], seed=0))
    row["short"] = dict(prompt=short[0], new_tokens=short[1], **rate(engine, [o[0] for o in outs], seconds, device))
    for name, lengths in (("fixed", [max_new] * batch), ("spread", spread_lengths(batch, max_new))):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        outs, seconds = run_lengths(engine, prompts.tolist(), lengths, params)
        row[name] = rate(engine, outs, seconds, device)
        row[name]["of_short_tok_s"] = row[name]["tok_s"] / row["short"]["tok_s"]
        print(shape, "long", name, {k: round(v, 4) if isinstance(v, float) else v for k, v in row[name].items()},
              flush=True)
    if not skip_hf:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        hf_out, hf_seconds = hf_generate(model, prompts.to(device), hf_tokens)
        row["hf_first_tokens"] = dict(new_tokens=hf_tokens, tok_s=hf_out.numel() / hf_seconds,
                                      peak_memory_gb=torch.cuda.max_memory_allocated(device) / 2**30
                                      if device.type == "cuda" else None)
        row["spread_over_hf_upper_bound"] = row["spread"]["tok_s"] / row["hf_first_tokens"]["tok_s"]
        print(shape, "long hf", row["hf_first_tokens"], flush=True)
    del engine, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def profile_decode(shape: str, device, dtype, batch: int, prompt_len: int, new_tokens: int, top: int = 20,
                   exact: bool = False) -> dict:
    """torch.profiler over one generate call (prompt_len, new_tokens, EOS ignored, temperature 1), of the default
    engine or, with `exact`, of exact mode's (`rollout.exact`)."""
    model = make_model(shape, dtype, device)
    engine = engine_from(model, device, dtype, max_num_seqs=batch, max_model_len=prompt_len + new_tokens, exact=exact)
    prompts = torch.randint(4, model.config.vocab_size, (batch, prompt_len),
                            generator=torch.Generator().manual_seed(6)).tolist()
    result = dict(shape=shape, exact=exact, **profile_generate(engine, prompts, new_tokens, top))
    del engine, model
    return result


def profile_generate(engine, prompts: list[list[int]], new_tokens: int, top: int = 20) -> dict:
    """torch.profiler over one `engine.generate` of `prompts` (new_tokens each, EOS ignored, temperature 1) after a
    short warm-up: the wall time, the host ops' table and, on CUDA, the device's busy time and its top kernels per
    decode step. Prints a summary."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, stop_token_ids=[], seed=0)
    engine.generate(prompts[:4], SamplingParams(max_tokens=8, stop_token_ids=[]))  # warm-up
    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        _, seconds = ours_generate(engine, prompts, params)
    stats = engine.stats
    steps = max(stats["decode_steps"], 1)
    result = dict(batch=len(prompts), prompt=len(prompts[0]), new_tokens=new_tokens, wall_s=seconds,
                  prefill_s=stats["prefill_s"], decode_steps=stats["decode_steps"],
                  wall_ms_per_decode_step=1e3 * stats["decode_s"] / steps,
                  host_ops=prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
    if cuda:
        kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for event in prof.events():
            if event.device_type == DeviceType.CUDA:
                kernels[event.name][0] += event.time_range.elapsed_us()
                kernels[event.name][1] += 1
        busy_us = sum(us for us, _ in kernels.values())
        result.update(device_busy_s=busy_us / 1e6, device_busy_fraction=busy_us / 1e6 / seconds,
                      device_busy_ms_per_decode_step=busy_us / 1e3 / steps,
                      top_kernels=[dict(name=name[:120], total_ms=us / 1e3, calls=calls,
                                        ms_per_decode_step=us / 1e3 / steps, share=us / busy_us)
                                   for name, (us, calls) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]])
    print("profile", {k: v for k, v in result.items() if k not in ("host_ops", "top_kernels")}, flush=True)
    print(result["host_ops"], flush=True)
    for kernel in result.get("top_kernels", []):
        print(f"  {kernel['ms_per_decode_step']:8.4f} ms/step {kernel['share']:6.1%} {kernel['calls']:7d}x "
              f"{kernel['name'][:90]}", flush=True)
    return result


def shared_prefill(shape: str, device, dtype, prompts_n: int, n: int, new_tokens: int) -> dict:
    """prompts_n prompts of varied length x n samples: prefill tokens must equal the prompts' tokens."""
    model = make_model(shape, dtype, device)
    engine = engine_from(model, device, dtype, max_num_seqs=prompts_n * n, max_model_len=160 + new_tokens)
    gen = torch.Generator().manual_seed(7)
    lengths = torch.randint(64, 161, (prompts_n,), generator=gen).tolist()
    prompts = [torch.randint(4, model.config.vocab_size, (k,), generator=gen).tolist() for k in lengths]
    # warm-up with n > 1: several samples of a prompt take their own prefill kernels (one Triton compile)
    engine.generate(prompts[:2], SamplingParams(n=2, max_tokens=4, stop_token_ids=[]))
    outs, seconds = ours_generate(engine, prompts, SamplingParams(n=n, temperature=1.0, max_tokens=new_tokens,
                                                                   stop_token_ids=[], seed=0))
    stats = engine.stats
    result = dict(prompts=prompts_n, n=n, prompt_tokens=sum(lengths), prefill_tokens=stats["prefill_tokens"],
                  prefill_forwards=stats["prefill_forwards"], prefill_s=stats["prefill_s"],
                  tok_s=sum(len(s.token_ids) for row in outs for s in row) / seconds)
    assert result["prefill_tokens"] == result["prompt_tokens"], f"prompts were prefilled more than once: {result}"
    print("shared_prefill", result, flush=True)
    del engine, model
    return result

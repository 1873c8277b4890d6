"""Multi-turn rollout: the agent loop's turns/s and tokens/s against a single-turn rollout of the same
model and prompts, and what continuing sequences in their KV cache saves.

    python bench/multiturn.py --device cpu                       # a tiny random model built here, fp32
    python bench/multiturn.py --device cuda --model SmolLM2-135M-Instruct.Q4_1.gguf \
        --out bench/results/multiturn_h200.json                  # bf16, 64 prompts x 4 samples
    bash bench/h200.sh model_part1; bash bench/h200.sh model_part2 multiturn    # the same on the H200

`--model` is a Hugging Face directory, a `.gguf` file or a directory holding one (converted once with
`hybridflow.utils.real_model`).

Three runs, each after a warm-up, on the same chat prompts and sampling (temperature 1, the model's stop ids):
1. single_turn: `engine.generate`, up to --turn-tokens tokens per sample;
2. multi_turn: `AgentLoop` with `Feedback` (below) answering every model turn with a short user message,
   --turns model turns of up to --turn-tokens tokens each; each continuation prefills only the new
   tokens and attends over the cached conversation;
3. multi_turn_no_reuse: the same episodes, but every continuation releases its sequence and prefills
   the whole conversation again as a new prompt (what an engine without continuation has to do);
4. endpoint: the same episodes written as agent code (`bench/endpoint_agent.py`) with an OpenAI client,
   run by `EndpointRollout` through the OpenAI-compatible endpoint (HTTP on 127.0.0.1, the runner in its
   own process); `endpoint_vs_loop` is its model tokens/s over run 2's (the target is >= 0.8).
Reported per run: seconds, model turns and tokens, turns/s, model tokens/s, all tokens/s (environment
tokens included), prefill tokens and forwards, decode steps; `kv_reuse`: the prefill tokens avoided
and the time against run 3; device peak memory. Each run is repeated (`--repeats`, 3 on a GPU) and the one of
median seconds reported, with every repeat's seconds. Prints and writes JSON.

    python bench/multiturn.py --device cuda --model ... --only-endpoint --prompts 256 --n 4 --turn-tokens 64
        # 1,024 trajectories at once through the endpoint: `errors` counts failed requests and trajectories
    python bench/multiturn.py --device cpu --only-endpoint --prompts 32 --n 1 --big-message-mb 5
        # run 4 again with row 0's trajectory sending a 5 MB message (refused: no prompt holds it);
        # `big_message.others_latency_ratio`: the other trajectories' mean request latency against run 4's

Run 4 reports the runners' request latency (`request_s_mean`: the mean over trajectories of each one's mean
request seconds, `request_s_max`: the longest request), measured in the runner by the agent.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_util import write_json

from hybridflow.agents import Environment, EnvStep
from hybridflow.agents.loop import agent_loop
from hybridflow.agents.loop.engine_driver import EngineDriver
from hybridflow.engine.rollout import RolloutEngine, SamplingParams


class Feedback(Environment):
    """Answers every model turn with the same short request to check and go on (no reward)."""

    def step(self, text: str, turn: int) -> EnvStep:
        return EnvStep(f"Check step {turn + 1} of your answer and continue.")


class ReprefillDriver(EngineDriver):
    """The agent loop's driver with KV reuse off: a continued sequence is released and its whole
    conversation (prompt, turns, appended ids) prefilled again as a new prompt."""

    def __init__(self, session) -> None:
        super().__init__(session)
        self.current: dict[int, int] = {}  # the episode's sequence id -> the engine's current one
        self.context: dict[int, list[int]] = {}

    def _track(self, seq: int, future):
        future.add_done_callback(lambda f: f.cancelled() or f.exception() or
                                 self.context[seq].extend(f.result().token_ids))
        return future

    def start(self, prompt, n, max_tokens):
        pairs = super().start(prompt, n, max_tokens)
        for seq, future in pairs:
            self.current[seq], self.context[seq] = seq, list(prompt)
            self._track(seq, future)
        return pairs

    def extend(self, seq, tokens, max_tokens):
        self.context[seq] += tokens
        with self.lock:
            self.session.release(self.current[seq])
            (self.current[seq],) = self.session.add(self.context[seq], 1, max_tokens)
        return self._track(seq, self._future(self.current[seq]))

    def release(self, seq):
        super().release(self.current[seq])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def agent_config(turns: int, turn_tokens: int):
    from hybridflow.config.schema import AgentConfig

    return AgentConfig(environment=f"{Path(__file__).resolve()}:Feedback", max_turns=turns,
                       max_tokens_per_turn=turn_tokens)


def run_single(engine, prompts, params) -> dict:
    sync(engine.device)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    sync(engine.device)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for row in outs for c in row)
    turns = sum(len(row) for row in outs)
    stats = engine.stats
    return dict(seconds=seconds, model_turns=turns, model_tokens=tokens, turns_per_s=turns / seconds,
                model_tokens_per_s=tokens / seconds, all_tokens_per_s=tokens / seconds,
                prefill_tokens=stats["prefill_tokens"], prefill_forwards=stats["prefill_forwards"],
                decode_steps=stats["decode_steps"], mean_turn_tokens=tokens / turns)


def run_multi(engine, loop, prompts, rows, params, reuse: bool) -> dict:
    sessions = []
    make_session = engine.session

    def recording(*args, **kwargs):  # keep the loop's session to read its counters
        sessions.append(make_session(*args, **kwargs))
        return sessions[-1]

    engine.session = recording
    if not reuse:
        agent_loop.EngineDriver = ReprefillDriver
    try:
        sync(engine.device)
        start = time.perf_counter()
        outs = loop.run(engine, prompts, rows, params)
        sync(engine.device)
        seconds = time.perf_counter() - start
    finally:
        agent_loop.EngineDriver = EngineDriver
        del engine.session
    trajectories = [t for row in outs for t in row]
    turns = sum(t.turns for t in trajectories)
    model_tokens = sum(sum(t.response_mask) for t in trajectories)
    all_tokens = sum(len(t.token_ids) for t in trajectories)
    stats = sessions[-1].stats
    return dict(seconds=seconds, model_turns=turns, model_tokens=model_tokens, env_tokens=all_tokens - model_tokens,
                turns_per_s=turns / seconds, model_tokens_per_s=model_tokens / seconds,
                all_tokens_per_s=all_tokens / seconds, mean_turns=turns / len(trajectories),
                mean_turn_tokens=model_tokens / turns, cut_by_budget=sum(t.cut_by_budget for t in trajectories),
                prefill_tokens=stats["prefill_tokens"], reused_tokens=stats["reused_tokens"],
                prefill_forwards=stats["prefill_forwards"], decode_steps=stats["decode_steps"],
                prefill_s=stats["prefill_s"], decode_s=stats["decode_s"])


def runner_cpu_s(rollout) -> float:
    """CPU seconds (user + system) the runner processes have used so far (Linux /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    return sum(sum(map(int, Path(f"/proc/{host.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[11:13]))
               for host in rollout.hosts) / ticks


def run_endpoint(engine, tokenizer, budget: int, turns: int, turn_tokens: int, rows, params,
                 runner_processes: int | None, big_mb: float = 0.0) -> dict:
    """Run 4: the episodes through the endpoint (`EndpointRollout` with `bench/endpoint_agent.py:feedback`); with
    `big_mb`, row 0's trajectories send a message of that many MB (its latency is left out of `request_s_*`)."""
    from hybridflow.agents.endpoint.endpoint_rollout import EndpointRollout
    from hybridflow.config.schema import AgentConfig

    cfg = AgentConfig(runner=f"{Path(__file__).resolve().parent / 'endpoint_agent.py'}:feedback",
                      max_tokens_per_turn=turn_tokens, max_concurrent_requests=4096, timeout_s=600.0,
                      runner_processes=runner_processes)
    rollout = EndpointRollout(cfg, tokenizer, budget, 4096, cfg.runner, {"turns": turns, "big_mb": big_mb})
    rollout.run(engine, [[1]] * 2, rows[:2], SamplingParams(n=1, max_tokens=8, seed=1))  # starts the runner process
    sessions = []
    make_session = engine.session

    def recording(*args, **kwargs):
        sessions.append(make_session(*args, **kwargs))
        return sessions[-1]

    engine.session = recording
    try:
        sync(engine.device)
        cpu_before = runner_cpu_s(rollout)
        start = time.perf_counter()
        outs = rollout.run(engine, [[1]] * len(rows), rows, params)
        sync(engine.device)
        seconds = time.perf_counter() - start
        runner_cpu = runner_cpu_s(rollout) - cpu_before
    finally:
        del engine.session
        rollout.close()
    trajectories = [t for row in outs for t in row]
    latencies = [t.metrics for row in (outs[1:] if big_mb else outs) for t in row if "request_s" in t.metrics]
    turns_done = sum(t.turns for t in trajectories)
    model_tokens = sum(sum(t.response_mask) for t in trajectories)
    all_tokens = sum(len(t.token_ids) for t in trajectories)
    stats = sessions[-1].stats
    return dict(seconds=seconds, trajectories=len(trajectories), model_turns=turns_done, model_tokens=model_tokens,
                env_tokens=all_tokens - model_tokens, turns_per_s=turns_done / seconds,
                model_tokens_per_s=model_tokens / seconds, all_tokens_per_s=all_tokens / seconds,
                mean_turns=turns_done / len(trajectories), segments=sum(t.segments for t in trajectories),
                token_mismatch=sum(t.token_mismatch for t in trajectories),
                cut_by_budget=sum(t.cut_by_budget for t in trajectories),
                errors=dict(dropped=sum(t.dropped is not None for t in trajectories),
                            runner_errors=sum(t.runner_errors for t in trajectories),
                            failed_requests=rollout.stats["errors"]),
                requests=rollout.stats["requests"], peak_concurrent_requests=rollout.stats["peak_concurrent"],
                prefill_tokens=stats["prefill_tokens"], reused_tokens=stats["reused_tokens"],
                prefill_forwards=stats["prefill_forwards"], decode_steps=stats["decode_steps"],
                prefill_s=stats["prefill_s"], decode_s=stats["decode_s"], runner_processes=len(rollout.hosts),
                runner_cpu_s=runner_cpu, runner_cpu_ms_per_request=1000 * runner_cpu / rollout.stats["requests"],
                request_s_mean=sum(m["request_s"] for m in latencies) / max(len(latencies), 1),
                request_s_max=max((m["request_s_max"] for m in latencies), default=0.0))


def repeated(run, repeats: int) -> dict:
    """`run()` `repeats` times: the run of the median seconds, with every run's seconds (`seconds_runs`). One run
    of a few seconds varied by up to 15 % from the next on the H100 (the endpoint's order of arrivals, the host)."""
    runs = sorted((run() for _ in range(repeats)), key=lambda r: r["seconds"])
    return {**runs[len(runs) // 2], "seconds_runs": [r["seconds"] for r in runs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default=None, help="HF dir, .gguf file or a dir holding one (default: a tiny "
                                                      "random model)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts (default: 64 on cuda, 4 on cpu)")
    parser.add_argument("--n", type=int, default=None, help="samples per prompt (default: 4 on cuda, 2 on cpu)")
    parser.add_argument("--turns", type=int, default=3, help="model turns per episode")
    parser.add_argument("--turn-tokens", type=int, default=None, help="tokens per model turn (default 256 / 16)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (CPU runs)")
    parser.add_argument("--only-endpoint", action="store_true", help="run 4 alone (the concurrency check)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="KV slots (default: every trajectory)")
    parser.add_argument("--runner-processes", default=None,
                        help="agent.runner_processes of run 4, or several comma-separated (run 4 once each; "
                             "`endpoint` is the first's, `endpoint_runs` all); default: the schema's, min(16, "
                             "CPU cores)")
    parser.add_argument("--switch-interval", default=None,
                        help="Python's thread switch interval (s) during run 4, or several comma-separated (run 4 "
                             "once each per runner-process count): how long the engine's worker thread may wait "
                             "for the interpreter while the event loop serves requests; default: Python's, 0.005")
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs of each kind, the median's reported (default: 3 on cuda, 1 on cpu)")
    parser.add_argument("--big-message-mb", type=float, default=0.0,
                        help="after run 4, run it again with row 0's trajectories sending a message of this many MB")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    prompts_n, n = args.prompts or (64 if cuda else 4), args.n or (4 if cuda else 2)
    turn_tokens = args.turn_tokens or (256 if cuda else 16)
    repeats = args.repeats or (3 if cuda else 1)
    if not cuda:
        torch.set_num_threads(args.threads)
    if args.model is None:
        from hybridflow.utils.tiny_model import build_tiny_model

        model_dir = str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", hidden=128, layers=4))
    else:
        from hybridflow.utils.real_model import resolve_model

        model_dir = str(resolve_model(args.model, "fp32"))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    questions = [f"Question {i}: a shop sells {i + 3} boxes of {2 * i + 5} pencils. How many pencils is that? "
                 "Think step by step." for i in range(prompts_n)]
    prompts = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                       add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"] for q in questions]
    budget = args.turns * turn_tokens + (args.turns - 1) * 64
    dtype = torch.bfloat16 if cuda else torch.float32
    engine = RolloutEngine.from_pretrained(model_dir, device=device, dtype=dtype,
                                           max_num_seqs=args.max_num_seqs or prompts_n * n,
                                           max_model_len=max(map(len, prompts)) + budget + 8)
    loop = agent_loop.AgentLoop(agent_config(args.turns, turn_tokens), tokenizer, budget)
    rows = [{"index": i, "raw_prompt": q, "extra_info": {}} for i, q in enumerate(questions)]
    params = SamplingParams(n=n, temperature=1.0, max_tokens=turn_tokens, seed=0)
    engine.generate(prompts[:2], SamplingParams(max_tokens=8))  # warm-up
    loop.run(engine, prompts[:2], rows[:2], SamplingParams(n=1, max_tokens=8, seed=1))
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    result = dict(device=torch.cuda.get_device_name(device) if cuda else platform.processor(), torch=torch.__version__,
                  model=model_dir, dtype=str(dtype).removeprefix("torch."), prompts=prompts_n, n=n, turns=args.turns,
                  turn_tokens=turn_tokens, budget=budget, mean_prompt_tokens=sum(map(len, prompts)) / len(prompts))
    counts = [int(c) for c in args.runner_processes.split(",")] if args.runner_processes else [None]

    intervals = [float(i) for i in args.switch_interval.split(",")] if args.switch_interval else [None]

    def endpoint_run(count: int | None, interval: float | None) -> dict:
        default = sys.getswitchinterval()
        sys.setswitchinterval(interval or default)
        try:
            run = repeated(lambda: run_endpoint(engine, tokenizer, budget, args.turns, turn_tokens, rows, params, count),
                           repeats)
        finally:
            sys.setswitchinterval(default)
        return {**run, "switch_interval": interval or default}

    def endpoint_runs() -> None:
        runs = [endpoint_run(c, i) for c in counts for i in intervals]
        result["endpoint"] = runs[0]
        if len(runs) > 1:
            result["endpoint_runs"] = runs
        for run in runs:
            print("endpoint", run, flush=True)
        if args.big_message_mb:
            big = repeated(lambda: run_endpoint(engine, tokenizer, budget, args.turns, turn_tokens, rows, params,
                                                counts[0], args.big_message_mb), repeats)
            result["big_message"] = dict(big, mb=args.big_message_mb, others_latency_ratio=(
                big["request_s_mean"] / result["endpoint"]["request_s_mean"]))
            print("big_message", result["big_message"], flush=True)

    if args.only_endpoint:
        endpoint_runs()
        result["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
        print(json.dumps(result, indent=1))
        if args.out:
            write_json(result, args.out)
        return
    result["single_turn"] = repeated(lambda: run_single(engine, prompts, params), repeats)
    print("single_turn", result["single_turn"], flush=True)
    result["multi_turn"] = repeated(lambda: run_multi(engine, loop, prompts, rows, params, reuse=True), repeats)
    print("multi_turn", result["multi_turn"], flush=True)
    result["multi_turn_no_reuse"] = repeated(lambda: run_multi(engine, loop, prompts, rows, params, reuse=False),
                                             repeats)
    print("multi_turn_no_reuse", result["multi_turn_no_reuse"], flush=True)
    endpoint_runs()
    reuse, again = result["multi_turn"], result["multi_turn_no_reuse"]
    result["endpoint_vs_loop"] = dict(
        model_tokens_per_s_ratio=result["endpoint"]["model_tokens_per_s"] / reuse["model_tokens_per_s"],
        turns_per_s_ratio=result["endpoint"]["turns_per_s"] / reuse["turns_per_s"])
    if "endpoint_runs" in result:
        result["endpoint_vs_loop"]["model_tokens_per_s_ratio_by_run"] = {
            f"{run['runner_processes']} processes, switch {run['switch_interval']:g} s":
                run["model_tokens_per_s"] / reuse["model_tokens_per_s"] for run in result["endpoint_runs"]}
    result["kv_reuse"] = dict(
        prefill_tokens_avoided=reuse["reused_tokens"],
        avoided_fraction_of_no_reuse_prefill=reuse["reused_tokens"] / max(again["prefill_tokens"], 1),
        model_tokens_per_s_gain=reuse["model_tokens_per_s"] / again["model_tokens_per_s"],
        prefill_s_reuse=reuse["prefill_s"], prefill_s_no_reuse=again["prefill_s"])
    result["multi_vs_single"] = dict(
        model_tokens_per_s_ratio=reuse["model_tokens_per_s"] / result["single_turn"]["model_tokens_per_s"],
        turns_per_s_ratio=reuse["turns_per_s"] / result["single_turn"]["turns_per_s"])
    result["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    print(json.dumps(result, indent=1))
    if args.out:
        write_json(result, args.out)


if __name__ == "__main__":
    main()

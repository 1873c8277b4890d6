"""The Tinker service against our own trainer and engine (issue 57), on the learning race's task.

    python bench/serve_tinker.py --device cpu                                  # toy scale on 2 CPU cores
    python bench/serve_tinker.py --device cuda --model PATH --budget-s 120     # one GPU, the real SmolLM2

Two measurements, each in a subprocess of its own (its device peak its own):
1. **sampling**: `--concurrency` requests at once through the `tinker` SDK's `sample` against
   `hybridflow serve` (its own process on 127.0.0.1), each one prompt of the race's data and one sample
   of up to `--max-new-tokens` tokens at temperature 1; then the same prompts through our `RolloutEngine`
   directly, in one `generate`. Reported: each one's generated tokens/s and their ratio (target >= 0.8).
2. **the race**: GRPO on the race's data (`bench/learn_vs_trl.py`: GSM8K-style prompts, the `gsm8k` reward,
   `--prompts` x `--n` a step, LoRA rank `--rank` at lr `--lr`) for `--budget-s` seconds of training, twice:
   - `service`: a loop written against the `tinker` SDK as tinker-cookbook's RL loop is (sample the group from
     `save_weights_and_get_sampling_client()`, group-centred advantages, `forward_backward(...,
     "importance_sampling")` with the sampled log-probs, `optim_step`);
   - `trainer`: `hybridflow train` (the race's recipe with `actor.lora.rank=--rank`).
   Greedy validation accuracy on the held-out prompts at 0, every `--eval-every-s` and at the end, with the
   clock paused (the service's through its own sampler, the trainer's through its rollout). Reported: steps,
   steps/s and their ratio (target >= 0.7), accuracy against time.
Writes JSON (`--out`) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from bench_util import DeviceMemoryWatch, git_commit, write_json  # noqa: E402
from learn_vs_trl import (RACE_DEFAULTS, RaceClock, add_race_arguments, device_defaults,  # noqa: E402
                          race_hybridflow, race_inputs, score)

API_KEY = "tml-bench"


def rows(path: Path) -> list[dict]:
    import pandas as pd

    return pd.read_parquet(path).to_dict("records")


class Server:
    """`hybridflow serve` in a process of its own on a free port of 127.0.0.1, as a user runs it: the SDK's client
    loop in this process does not share the server's interpreter (an in-process app measured 0.62 s against 0.25 s
    for 64 concurrent samples of a tiny model on 2 CPU cores, the engine alone 0.15 s; docs/tinker.md)."""

    def __init__(self, model_dir: str, device: str, max_num_seqs: int, max_model_len: int, checkpoints: Path) -> None:
        from hybridflow.serve.config import ServeConfig

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        # the service's defaults (forward_backward's micro-batches follow the free memory), with slots as long as the
        # task's sequences (as `hybridflow train` sizes its engine); `config` tells the engine comparison the same
        self.config = ServeConfig({"m": Path(model_dir)}, device=device, max_num_seqs=max_num_seqs,
                                  max_model_len=max_model_len, checkpoint_dir=checkpoints)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "hybridflow.cli", "serve", "--model", f"m={model_dir}", "--port", str(self.port),
             "--api-key", API_KEY, "--device", device, "--max-num-seqs", str(max_num_seqs),
             "--max-model-len", str(max_model_len), "--checkpoint-dir", str(checkpoints)],
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
        deadline = time.monotonic() + 300
        while True:
            try:
                health = urllib.request.Request(f"http://127.0.0.1:{self.port}/api/v1/healthz",
                                                headers={"X-API-Key": API_KEY})
                urllib.request.urlopen(health, timeout=5).close()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"hybridflow serve did not come up (exit code {self.process.returncode})")
                time.sleep(0.2)

    def client(self):
        import tinker

        return tinker.ServiceClient(base_url=f"http://127.0.0.1:{self.port}", api_key=API_KEY)

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def chat_prompts(tokenizer, records: list[dict]) -> list[list[int]]:
    return [list(tokenizer.apply_chat_template(list(r["prompt"]), add_generation_prompt=True, tokenize=True,
                                               return_dict=False)) for r in records]


def sampling(a: argparse.Namespace) -> dict:
    """Tokens/s of `a.concurrency` concurrent SDK sample requests against the engine's own `generate`."""
    from tinker import types
    from transformers import AutoTokenizer

    from hybridflow.engine.rollout import RolloutEngine, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(a.model_dir)
    prompts = chat_prompts(tokenizer, rows(Path(a.work) / "train.parquet")[:a.concurrency])
    server = Server(a.model_dir, a.device, a.concurrency, a.max_prompt_length + a.max_new_tokens,
                    Path(a.work) / "checkpoints")
    try:
        sampler = server.client().create_sampling_client(base_model="m").result()
        # no seed, as tinker-cookbook's completers send: the server runs a seeded request alone (its draws must not
        # depend on the requests beside it), so seeded requests would be 64 engine batches, not one
        params = types.SamplingParams(max_tokens=a.max_new_tokens, temperature=1.0)

        async def burst() -> tuple[float, int]:
            start = time.perf_counter()
            out = await asyncio.gather(*(sampler.sample(types.ModelInput.from_ints(p), 1, params)
                                         for p in prompts))
            return time.perf_counter() - start, sum(len(r.sequences[0].tokens) for r in out)

        asyncio.run(burst())  # warm-up: the engine's first batch (graphs, caches)
        service_runs = [asyncio.run(burst()) for _ in range(a.repeats)]
    finally:
        server.close()
    # the engine as the service builds it (precision, slots), driven directly
    engine = RolloutEngine.from_pretrained(a.model_dir, device=a.device, max_num_seqs=a.concurrency,
                                           dtype=server.config.sampler_torch_dtype(),
                                           max_model_len=server.config.max_model_len)
    own = SamplingParams(n=1, temperature=1.0, max_tokens=a.max_new_tokens, seed=a.seed)
    engine.generate(prompts, own)
    engine_runs = []
    for _ in range(a.repeats):
        start = time.perf_counter()
        outs = engine.generate(prompts, own)
        engine_runs.append((time.perf_counter() - start, sum(len(o[0].token_ids) for o in outs)))

    def rate(runs: list[tuple[float, int]]) -> dict:
        seconds, tokens = sorted(runs)[len(runs) // 2]
        return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "runs": runs}

    service, own_rate = rate(service_runs), rate(engine_runs)
    return {"service": service, "engine": own_rate, "ratio": service["tokens_per_s"] / own_rate["tokens_per_s"]}


def race_service(a: argparse.Namespace) -> dict:
    """GRPO through the `tinker` SDK against `hybridflow serve`, for `a.budget_s` seconds of training."""
    from tinker import types
    from transformers import AutoTokenizer

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(a.model_dir)
    train, val = rows(Path(a.work) / "train.parquet"), rows(Path(a.work) / "val.parquet")
    train_prompts, val_prompts = chat_prompts(tokenizer, train), chat_prompts(tokenizer, val)
    server = Server(a.model_dir, a.device, max(a.prompts * a.n, len(val)), a.max_prompt_length + a.max_new_tokens,
                    Path(a.work) / "checkpoints")
    service = server.client()
    trainer = service.create_lora_training_client(base_model="m", rank=a.rank, seed=a.seed).result()
    setup_s = time.perf_counter() - started

    async def generate(sampler, prompts: list[list[int]], n: int, temperature: float):
        params = types.SamplingParams(max_tokens=a.max_new_tokens, temperature=temperature)  # unseeded: see sampling
        return await asyncio.gather(*(sampler.sample(types.ModelInput.from_ints(p), n, params)
                                      for p in prompts))

    def evaluate() -> float:
        out = asyncio.run(generate(trainer.save_weights_and_get_sampling_client().result(), val_prompts, 1, 0.0))
        texts = [tokenizer.decode(r.sequences[0].tokens, skip_special_tokens=True) for r in out]
        return score(texts, [str(r["reward_model"]["ground_truth"]) for r in val])

    def step(index: int) -> dict:
        t0 = time.perf_counter()
        picks = [(index * a.prompts + i) % len(train) for i in range(a.prompts)]
        sampler = trainer.save_weights_and_get_sampling_client().result()
        groups = asyncio.run(generate(sampler, [train_prompts[i] for i in picks], a.n, 1.0))
        t1 = time.perf_counter()
        data, rewards = [], []
        for i, group in zip(picks, groups):
            texts = [tokenizer.decode(s.tokens, skip_special_tokens=True) for s in group.sequences]
            r = [score([t], [str(train[i]["reward_model"]["ground_truth"])]) for t in texts]
            mean = sum(r) / len(r)
            rewards += r
            for seq, reward in zip(group.sequences, r):
                if reward == mean or not seq.tokens:
                    continue  # no signal: a zero advantage everywhere
                prompt, tokens = train_prompts[i], list(seq.tokens)
                full = prompt + tokens
                pad = [0.0] * (len(prompt) - 1)
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={"target_tokens": full[1:], "logprobs": pad + list(seq.logprobs),
                                    "advantages": pad + [(reward - mean)] * len(tokens)}))
        if data:
            trainer.forward_backward(data, "importance_sampling").result()
            trainer.optim_step(types.AdamParams(learning_rate=a.lr)).result()
        row = {"reward/mean": sum(rewards) / len(rewards), "timing_s/generate": t1 - t0,
               "timing_s/step": time.perf_counter() - t0, "trained_sequences": len(data)}
        print(f"  service step {index + 1}: {row['timing_s/step']:.2f}s (sampling {row['timing_s/generate']:.2f}s), "
              f"{len(data)} sequences trained", flush=True)
        return row

    clock, steps = RaceClock(a.budget_s, a.eval_every_s), []
    try:
        done = clock.check(evaluate, 0)
        while not done:
            steps.append(step(len(steps)))
            done = clock.check(evaluate, len(steps))
    finally:
        server.close()
    return {"setup_s": setup_s, "points": clock.points, "steps": steps}


def child(a: argparse.Namespace) -> dict:
    watch = None if a.device == "cpu" else DeviceMemoryWatch()
    if a.child == "sampling":
        result = sampling(a)
    elif a.child == "service":
        result = race_service(a)
    else:
        result = race_hybridflow(a, [f"actor.lora.rank={a.rank}", f"actor.lora.alpha={a.rank}"], name="trainer")
    if watch is not None:
        import torch

        result["peak_device_memory_gb"] = watch.stop()
        result["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_race_arguments(p)
    p.add_argument("--rank", type=int, default=32)
    p.set_defaults(lr=2e-5)  # LoRA's rate (recipes/grpo_lora.yaml's order), not the race's full-parameter one
    p.add_argument("--budget-s", type=float, default=None, help="training seconds each (default 120 cuda / 20 cpu)")
    p.add_argument("--eval-every-s", type=float, default=None, help="default 30 cuda / 10 cpu")
    p.add_argument("--concurrency", type=int, default=None, help="sampling requests at once (default 64 / 4 cpu)")
    p.add_argument("--repeats", type=int, default=3, help="sampling bursts timed (the median reported)")
    p.add_argument("--only", nargs="+", choices=("sampling", "service", "trainer"),
                   default=["sampling", "service", "trainer"])
    p.add_argument("--out", default=None, help="JSON path (default bench/results/serve_tinker_<device>.json)")
    p.add_argument("--child", choices=("sampling", "service", "trainer"), help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    device_defaults(a, {**RACE_DEFAULTS, "budget_s": (120.0, 20.0), "eval_every_s": (30.0, 10.0),
                        "concurrency": (64, 4)})
    if a.child:
        Path(a.result).write_text(json.dumps(child(a)))
        return
    model_dir, work = race_inputs(a, "serve_tinker_")
    settings = ("device", "prompts", "n", "max_new_tokens", "max_prompt_length", "lr", "weight_decay", "budget_s",
                "eval_every_s", "n_train", "n_val", "seed", "rank", "concurrency", "repeats")
    results: dict[str, dict] = {}
    for name in a.only:
        print(f"{name}:", flush=True)
        res = work / f"{name}.json"
        cmd = [sys.executable, __file__, "--child", name, "--work", str(work), "--model-dir", str(model_dir),
               "--result", str(res)]
        cmd += [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k in settings]
        subprocess.run(cmd, check=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        results[name] = json.loads(res.read_text())
        # each measurement is printed and written as soon as it ends: a device call cut short keeps the finished ones
        summarize(a, name, results)
        write_report(a, model_dir, settings, results)


def summarize(a: argparse.Namespace, name: str, results: dict[str, dict]) -> None:
    """Prints the measurement `name` just finished (with the service / trainer ratio once both are in)."""
    r = results[name]
    if name == "sampling":
        print(f"sampling, {a.concurrency} requests at once: service {r['service']['tokens_per_s']:,.0f} tok/s, "
              f"engine {r['engine']['tokens_per_s']:,.0f} tok/s: {r['ratio']:.2f}x (target >= 0.8)", flush=True)
        return
    r["steps_done"] = r["points"][-1]["step"]
    r["steps_per_s"] = r["steps_done"] / r["points"][-1]["train_s"]
    print(f"{name:<8} setup {r['setup_s']:.1f}s, {r['steps_done']} steps ({r['steps_per_s']:.3f}/s), accuracy "
          + " -> ".join(f"{p['accuracy']:.1%}@{p['train_s']:.0f}s" for p in r["points"])
          + (f", device peak {r['peak_device_memory_gb']:.2f} GiB" if "peak_device_memory_gb" in r else ""),
          flush=True)
    if {"service", "trainer"} <= set(results):
        ratio = results["service"]["steps_per_s"] / results["trainer"]["steps_per_s"]
        print(f"service / trainer steps per second: {ratio:.2f}x (target >= 0.7)", flush=True)


def write_report(a: argparse.Namespace, model_dir: Path, settings: tuple[str, ...], results: dict[str, dict]) -> None:
    import torch

    summary = {}
    if "sampling" in results:
        summary["sampling_ratio"] = results["sampling"]["ratio"]
    if {"service", "trainer"} <= set(results):
        summary["steps_per_s_ratio"] = results["service"]["steps_per_s"] / results["trainer"]["steps_per_s"]
    report = {"device": torch.cuda.get_device_name() if a.device == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "model": str(model_dir), "commit": git_commit(),
              "settings": {k: v for k, v in vars(a).items() if k in settings}, "summary": summary, "results": results}
    write_json(report, a.out or HERE / "results" / f"serve_tinker_{a.device}.json")


if __name__ == "__main__":
    main()

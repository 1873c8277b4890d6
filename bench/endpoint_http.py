"""The endpoint's own cost per request, without the engine: requests/s and request latency through the HTTP
server, the request checks, the chat template's rendering and tokenizing, with an engine stand-in that answers
every turn at once. Optionally one trajectory sends one very large message.

    python bench/endpoint_http.py --out bench/results/endpoint_http_cpu.json   # 64 trajectories x 4 turns
    python bench/endpoint_http.py --trajectories 32 --big-mb 5                 # one of them sends 5 MB

The clients are the `openai` client on aiohttp's transport (as the runners use), in child processes, so the
endpoint's event loop is alone in this one: trajectory 0 in one, the others in another (so the big message's
own cost in its client, building and sending 5 MB of JSON, does not delay the others' clients: in a run, the
runners are spread over `agent.runner_processes` processes). Each trajectory asks a question, then answers
each reply with a short user message (`--turns` requests). With `--big-mb`, trajectory 0's second request
appends a user message of that many MB; the report gives the other trajectories' latency with and without it
(the same run is made first without). Each run repeats `--repeats` times; the median run (by seconds) is
reported with every run's seconds. `endpoint_cpu_ms_per_request` is the CPU time of the endpoint's process
(its event loop and the renderers' thread) per request: on a shared machine it varies much less than the
seconds, and it bounds the requests/s one core can serve. Prints and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench_util import write_json

from hybridflow.agents.endpoint.http_server import JSONServer
from hybridflow.agents.endpoint.routes import Endpoint
from hybridflow.engine.rollout import Completion, SamplingParams

TOKEN = "bench-token"


class InstantDriver:
    """The engine driver's interface answering every turn at once with the same short reply."""

    max_group = 8

    def __init__(self, reply: list[int]) -> None:
        self.reply, self.next = reply, 0

    def _done(self) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        future.set_result(Completion(list(self.reply), [-0.5] * len(self.reply), "stop"))
        return future

    def start(self, prompt, n, max_tokens):
        self.next += n
        return [(seq, self._done()) for seq in range(self.next - n, self.next)]

    def extend(self, seq, tokens, max_tokens):
        return self._done()

    def shorten(self, seq, drop, last_token):
        pass

    def release(self, seq):
        pass


async def _trajectory(client, key: int, turns: int, big: str | None, latencies: list[tuple[int, float]]) -> None:
    messages = [{"role": "user", "content": f"Question {key}: how many pencils are in {key + 3} boxes of 12?"}]
    for turn in range(turns):
        start = time.perf_counter()
        try:
            reply = await client.chat.completions.create(model="policy", messages=messages)
            content = reply.choices[0].message.content or ""
        except Exception as e:  # noqa: BLE001 - the big message may be refused; its latency still counts
            content = f"refused: {type(e).__name__}"
        latencies.append((key, time.perf_counter() - start))
        messages.append({"role": "assistant", "content": content})
        messages.append({"role": "user", "content": big if big is not None and turn == 0 else "Go on."})
        if content.startswith("refused"):
            return


def _clients(port: int, keys: dict[int, str], turns: int, big_mb: float, out) -> None:
    """A child process: its trajectories (number -> key) at once, trajectory 0 with the big message; sends back
    [(trajectory, seconds)] and the wall time."""
    import openai

    from hybridflow.agents.endpoint.runner_child import http_client

    async def main() -> tuple[list, float]:
        http = http_client(openai)
        latencies: list[tuple[int, float]] = []
        big = "x" * int(big_mb * 2**20) if big_mb else None
        start = time.perf_counter()
        await asyncio.gather(*(_trajectory(openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/t/{key}/v1",
                                                              api_key=TOKEN, http_client=http, max_retries=0,
                                                              timeout=600), i, turns, big if i == 0 else None,
                                           latencies) for i, key in keys.items()))
        seconds = time.perf_counter() - start
        await http.aclose()
        return latencies, seconds

    out.send(asyncio.run(main()))


def run_once(tokenizer, trajectories: int, turns: int, big_mb: float) -> dict:
    async def main() -> dict:
        reply = tokenizer("Fine, that is 36.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        params = SamplingParams(temperature=1.0, max_tokens=16)
        endpoint = Endpoint(tokenizer, InstantDriver(reply), params, budget=4096, max_prompt_length=4096,
                            vocab_size=len(tokenizer), max_concurrent=1024, token=TOKEN)
        server = JSONServer(endpoint.handle)
        port = await server.start()
        keys = [f"k{i}" for i in range(trajectories)]
        for key in keys:
            endpoint.open(key)
        cpu = time.process_time()  # this process's threads: the event loop and the renderers' thread
        spawn = mp.get_context("spawn")
        pipes = [spawn.Pipe(duplex=False) for _ in range(2)]
        shares = ({0: keys[0]}, {i: key for i, key in enumerate(keys) if i})
        children = [spawn.Process(target=_clients, args=(port, share, turns, big_mb, send))
                    for share, (_, send) in zip(shares, pipes)]
        for child in children:
            child.start()
        try:
            results = [await asyncio.to_thread(receive.recv) for receive, _ in pipes]
        finally:
            for child in children:
                child.join()
            await server.close()
            endpoint.close()
        cpu = time.process_time() - cpu
        latencies = [pair for got, _ in results for pair in got]
        seconds = max(took for _, took in results)
        others = [s for key, s in latencies if key != 0 or not big_mb]
        return dict(seconds=seconds, requests=len(latencies), requests_per_s=len(latencies) / seconds,
                    endpoint_cpu_ms_per_request=1000 * cpu / len(latencies),
                    errors=endpoint.stats["errors"], others_latency_mean_s=statistics.mean(others),
                    others_latency_p95_s=sorted(others)[int(0.95 * (len(others) - 1))],
                    others_latency_max_s=max(others))

    return asyncio.run(main())


def repeated(run, repeats: int) -> dict:
    runs = sorted((run() for _ in range(repeats)), key=lambda r: r["seconds"])
    return {**runs[len(runs) // 2], "seconds_runs": [r["seconds"] for r in runs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--big-mb", type=float, default=0.0, help="MB of trajectory 0's second message (0: none)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from hybridflow.utils.tiny_model import build_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", hidden=64, layers=1))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = dict(machine=platform.machine(), commit=commit, trajectories=args.trajectories, turns=args.turns)
    run_once(tokenizer, 4, 2, 0.0)  # warm-up
    result["plain"] = repeated(lambda: run_once(tokenizer, args.trajectories, args.turns, 0.0), args.repeats)
    print("plain", result["plain"], flush=True)
    if args.big_mb:
        result["big_mb"] = args.big_mb
        result["big"] = repeated(lambda: run_once(tokenizer, args.trajectories, args.turns, args.big_mb), args.repeats)
        print("big", result["big"], flush=True)
        result["others_latency_ratio"] = (result["big"]["others_latency_mean_s"]
                                          / result["plain"]["others_latency_mean_s"])
    print(json.dumps(result, indent=1))
    if args.out:
        write_json(result, args.out)


if __name__ == "__main__":
    main()

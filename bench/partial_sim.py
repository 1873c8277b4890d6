"""A model of partial rollouts against synchronous steps, for choosing which settings to measure on the GPU (a
simulation, not a measurement).

    python bench/partial_sim.py --run bench/results/long_rl_4096_sync.json        # the lengths of that run
    python bench/partial_sim.py --run ... --check bench/results/long_rl_4096_partial.json --out sim.json

The real in-flight buffer (`hybridflow.workers.partial_rollout.PartialRollouts`) and the trainer's order of a
step (drop the stale groups, top the buffer up, take the complete groups, update) drive an engine double: its
samples have lengths drawn from a measured run's length histogram (`--run`, `bench/long_rl.py`'s JSON: the share
at the limit, the rest uniform within each power-of-two bin), its KV slots admit groups first come first served,
and its clock advances by a cost model: a prefill forward `--prefill-ms`, a decode step `--decode-ms` plus
`--row-us` per running row plus `--context-ns` per token of context each running row reads from the KV cache
(its prompt, `--prompt-tokens`, and what it has generated), with 8 decode steps between two looks for finished
rows as the engine does; an update `--update-s` plus `--update-us-per-token` per trained token, and `--other-s`
per step. The decode terms are fitted to the synchronous H100 run at 0f5c68f (SmolLM2-135M, 4,096 tokens, 64
prompts x 8, 512 slots), the update terms to the H200 runs at b9d6530, which the H100 run matches. The context
term is what a long decode is made of: 12.5 ns per context token is the 23 KB of keys and values SmolLM2 keeps
per token read at 1.8 TB/s. Without it (the first version of this model: 1.75 ms + 4 us per row, fitted
to the H200 runs) the model predicted 1.68x sync for `finish` at max_staleness 4 with 3 extra batches, which
measured 1.03x: filling the slots adds rows whose decoding costs as much per token as the tail's. `--check`
prints the simulated synchronous and partial runs beside a measured partial run's figures, to see how far the
model is off before reading anything into it.

It reports, per setting, response tokens trained per second of simulated time, occupancy, staleness, samples
dropped and finished at the bound, and writes JSON. Each setting runs `--budget-s` of simulated time.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from hybridflow.engine.rollout import Completion, SamplingParams  # noqa: E402
from hybridflow.workers.partial_rollout import PartialRollouts  # noqa: E402

STEPS_PER_LOOK = 8  # decode steps between two looks for finished rows (`decode_steps_per_sync`'s default)


@dataclass
class Cost:
    """Seconds of each kind of work (see the module docstring)."""

    prefill_ms: float = 15.0
    decode_ms: float = 0.4
    row_us: float = 0.5
    context_ns: float = 12.5
    prompt_tokens: float = 100.0
    update_s: float = 0.4
    update_us_per_token: float = 8.0
    other_s: float = 0.3


def length_sampler(run: dict, rng: random.Random):
    """A draw of a response length like `run`'s (`bench/long_rl.py` JSON: its `lengths` summary)."""
    lengths, limit = run["lengths"], run["limit"]
    at_limit = lengths["at_limit_share"]
    bins = [(int(lo), int(hi), count) for lo, hi, count in
            ((*key.split("-"), c) for key, c in lengths["histogram"].items())]
    # the last bin holds the samples at the limit: take them out of it
    bins[-1] = (bins[-1][0], bins[-1][1], max(0, bins[-1][2] - round(at_limit * lengths["count"])))
    total = sum(c for _, _, c in bins)

    def draw() -> int:
        if rng.random() < at_limit:
            return limit
        pick = rng.random() * total
        for lo, hi, count in bins:
            if pick < count:
                return rng.randint(max(lo, 1), max(hi - 1, lo, 1))
            pick -= count
        return limit

    return draw


@dataclass
class Row:
    seq: int
    target: int
    limit: int
    generated: int = 0
    runs: list[list[int]] = field(default_factory=list)  # [version, tokens] runs of the versions sampled at

    def sample(self, tokens: int, version: int) -> None:
        if self.runs and self.runs[-1][0] == version:
            self.runs[-1][1] += tokens
        else:
            self.runs.append([version, tokens])
        self.generated += tokens

    def completion(self, reason: str) -> Completion:
        versions = [v for v, count in self.runs for _ in range(count)]
        return Completion([0] * self.generated, [0.0] * self.generated, reason, versions=versions)


class SimEngine:
    """The slots, clock and weight version `PartialRollouts` reads; `session` makes a `SimSession`."""

    def __init__(self, slots: int, draw, cost: Cost) -> None:
        self.kv = SimpleNamespace(num_slots=slots, token_bytes=23040)  # SmolLM2's keys and values per position
        self.weight_version, self.clock, self.draw, self.cost = 0, 0.0, draw, cost
        self.next_seq = 0

    def session(self, params: SamplingParams) -> "SimSession":
        return SimSession(self, params)


class SimSession:
    """A session double: `add`, `step`, `suspend`, `started`, `has_work`, `stats`, as `PartialRollouts` uses
    them. A sample's length is drawn when it is added (capped at what is left of `max_tokens`)."""

    def __init__(self, engine: SimEngine, params: SamplingParams) -> None:
        self.engine, self.params = engine, params
        self.waiting: list[list[Row]] = []
        self.running: dict[int, Row] = {}
        self.stats = dict(busy_s=0.0, row_steps=0, context_steps=0.0, decode_steps=0, generated_tokens=0)

    def reseed(self, seed: int) -> None:
        pass

    def add(self, prompt: list[int], n: int, max_tokens: int | None = None) -> list[int]:
        limit = max_tokens if max_tokens is not None else self.params.max_tokens
        rows = []
        for _ in range(n):
            rows.append(Row(self.engine.next_seq, min(self.engine.draw(), limit), limit))
            self.engine.next_seq += 1
        self.waiting.append(rows)
        return [r.seq for r in rows]

    @property
    def has_work(self) -> bool:
        return bool(self.running) or bool(self.waiting) and len(self.waiting[0]) <= self._free()

    def _free(self) -> int:
        return self.engine.kv.num_slots - len(self.running)

    def started(self) -> set[int]:
        return set(self.running)

    def step(self) -> list[tuple[int, Completion]]:
        engine, version = self.engine, self.engine.weight_version
        if self.waiting and len(self.waiting[0]) <= self._free():
            while self.waiting and len(self.waiting[0]) <= self._free():
                for row in self.waiting.pop(0):
                    row.sample(1, version)
                    self.running[row.seq] = row
            engine.clock += engine.cost.prefill_ms / 1e3
            self.stats["busy_s"] += engine.cost.prefill_ms / 1e3
        else:
            steps = min(STEPS_PER_LOOK, min(r.limit - r.generated for r in self.running.values()))
            cost = engine.cost
            # each running row reads its whole context (prompt and tokens so far) from the KV cache every step
            context = sum(cost.prompt_tokens + r.generated for r in self.running.values()) + \
                len(self.running) * (steps - 1) / 2
            seconds = steps * (cost.decode_ms / 1e3 + len(self.running) * cost.row_us / 1e6
                               + context * cost.context_ns / 1e9)
            engine.clock += seconds
            self.stats["busy_s"] += seconds
            self.stats["decode_steps"] += steps
            self.stats["row_steps"] += steps * len(self.running)
            self.stats["context_steps"] += steps * context
            for row in self.running.values():
                row.sample(min(steps, row.target - row.generated), version)
        done = [r for r in self.running.values() if r.generated >= r.target]
        for row in done:
            del self.running[row.seq]
            self.stats["generated_tokens"] += row.generated
        return [(r.seq, r.completion("length" if r.generated >= r.limit else "stop")) for r in done]

    def suspend(self, seqs=None) -> dict[int, Completion]:
        wanted = None if seqs is None else set(seqs)
        out = {}
        for rows in list(self.waiting):
            if wanted is None or rows[0].seq in wanted:
                self.waiting.remove(rows)
                out.update({r.seq: Completion([], [], "suspended") for r in rows})
        for seq in [s for s in self.running if wanted is None or s in wanted]:
            row = self.running.pop(seq)
            self.stats["generated_tokens"] += row.generated
            out[seq] = row.completion("suspended")
        return out


def simulate(setting: dict, run: dict, cost: Cost, budget_s: float, prompts: int, n: int, slots: int,
             seed: int) -> dict:
    """One setting: `{"mode": "sync"}` or `{"mode": "partial", "stale": "finish"|"drop", "max_staleness": s,
    "extra_batches": e}`, for `budget_s` simulated seconds."""
    engine = SimEngine(slots, length_sampler(run, random.Random(seed)), cost)
    params = SamplingParams(n=n, temperature=1.0, max_tokens=run["limit"])
    partial = setting["mode"] == "partial"
    buffer = PartialRollouts(engine, "continue")  # type: ignore[arg-type]
    trained = dropped = stale_finished = steps = 0
    occupancy, staleness, gen_s = [], [], 0.0
    while engine.clock < budget_s:
        version = engine.weight_version = steps
        start = engine.clock
        if partial:
            s = setting["max_staleness"]
            counts = buffer.in_flight(version - s)
            dropped += counts["dropped"]
            have = counts["groups"]
            while have < (1 + setting["extra_batches"]) * prompts:
                buffer.add([[1] * 8] * prompts, [{"uid": i} for i in range(prompts)], n)
                have += prompts
            groups, stats = buffer.take(prompts, version, params,
                                        version + 1 - s if setting["stale"] == "finish" else None)
            stale_finished += stats.get("stale_finished", 0)
        else:
            buffer = PartialRollouts(engine, "continue")  # type: ignore[arg-type]
            buffer.add([[1] * 8] * prompts, [{"uid": i} for i in range(prompts)], n)
            groups, stats = buffer.take(prompts, version, params)
        gen_s += engine.clock - start
        if stats["decode_steps"]:
            occupancy.append((stats["row_steps"] / (stats["decode_steps"] * slots), engine.clock - start))
        tokens = sum(len(s.tokens) for g in groups for s in g.samples)
        staleness += [version - g.oldest_version for g in groups]
        engine.clock += cost.update_s + cost.update_us_per_token * tokens / 1e6 + cost.other_s
        trained += tokens
        steps += 1
    weight = sum(w for _, w in occupancy)
    return {**setting, "steps": steps, "seconds": engine.clock, "response_tokens_per_s": trained / engine.clock,
            "gen_share_of_step": gen_s / engine.clock,
            "batch_occupancy": sum(o * w for o, w in occupancy) / weight if weight else None,
            "staleness_mean": sum(staleness) / len(staleness), "dropped": dropped, "stale_finished": stale_finished,
            "dropped_share": dropped / max(dropped + steps * prompts * n, 1)}


def settings(staleness: list[int], extra: list[int]) -> list[dict]:
    """sync, then partial rollouts at each (rollout.partial_stale, max_staleness, partial_extra_batches)."""
    return [{"mode": "sync"}] + [{"mode": "partial", "stale": stale, "max_staleness": s, "extra_batches": e}
                                 for stale in ("drop", "finish") for s in staleness for e in extra]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="a bench/long_rl.py JSON whose first run's lengths to draw from")
    p.add_argument("--check", default=None, help="a measured partial run's JSON (long_rl.py) to print beside")
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--slots", type=int, default=512, help="KV slots (rollout.max_num_seqs; 512 in the recipe)")
    p.add_argument("--staleness", default="1,2,4", help="rollout.max_staleness values")
    p.add_argument("--extra", default="1,2,3", help="rollout.partial_extra_batches values")
    p.add_argument("--seeds", type=int, default=2)
    for name, value in vars(Cost()).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=value)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    run = json.loads(Path(a.run).read_text())["runs"][0]
    cost = Cost(**{k: getattr(a, k) for k in vars(Cost())})
    results = []
    for setting in settings([int(v) for v in a.staleness.split(",")], [int(v) for v in a.extra.split(",")]):
        per_seed = [simulate(setting, run, cost, a.budget_s, a.prompts, a.n, a.slots, seed) for seed in range(a.seeds)]
        mean = {k: sum(r[k] for r in per_seed) / len(per_seed) for k in per_seed[0]
                if isinstance(per_seed[0][k], (int, float)) and k not in setting and per_seed[0][k] is not None}
        results.append({**setting, **mean})
    sync = results[0]["response_tokens_per_s"]
    print(f"{'setting':<34}{'tok/s':>9}{'x sync':>8}{'occup':>7}{'stale':>7}{'dropped':>9}{'finished':>9}")
    for r in results:
        name = r["mode"] if r["mode"] == "sync" else f"{r['stale']} s={r['max_staleness']} extra={r['extra_batches']}"
        print(f"{name:<34}{r['response_tokens_per_s']:>9.0f}{r['response_tokens_per_s'] / sync:>8.2f}"
              f"{r.get('batch_occupancy') or 0:>7.2f}{r['staleness_mean']:>7.2f}{r['dropped_share']:>9.1%}"
              f"{r['stale_finished'] / max(r['steps'], 1):>9.1f}")
    measured = {}
    if a.check:
        m = json.loads(Path(a.check).read_text())["runs"][0]
        measured = {"sync": {k: run.get(k) for k in ("response_tokens_per_s", "batch_occupancy")},
                    "partial": {k: m.get(k) for k in ("response_tokens_per_s", "batch_occupancy", "staleness_mean")}
                    | {"dropped_share": m["dropped"] / max(m["dropped"] + m["steps_done"] * a.prompts * a.n, 1)}}
        print("measured:", json.dumps(measured))
    out = {"about": "a simulation (bench/partial_sim.py), not a measurement", "run": a.run, "cost": vars(cost),
           "budget_s": a.budget_s, "seeds": a.seeds, "measured": measured, "results": results}
    text = json.dumps(out, indent=1)
    if a.out:
        Path(a.out).write_text(text)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

"""Exact mode's invariant linear (`hybridflow.engine.invariant.triton_gemm`) at other tilings: speed, and
whether the bits change.

    python bench/invariant_gemm.py --out bench/results/invariant_gemm_h200.json   # one H200 (bash bench/h200.sh
                                                                                  # invariant_gemm)

    python bench/invariant_gemm.py --summarize bench/results/invariant_gemm_h100.json \
        --write-table hybridflow/engine/invariant/tiles.json                       # no GPU: the table again

Exact mode runs every linear layer as one Triton GEMM with no split-K, for decode's few rows and the
trainer's thousands alike, its tiling from a table (`hybridflow/engine/invariant/tiles.py`). Batch invariance
needs every tiling the table names for a K to give the bits of that K's per-K tiling. The tensor cores sum
an output's K products in the same k16 steps from k = 0 whatever the tile, so they should; this measures it.
For each projection of the SmolLM2-135M and Qwen2-0.5B shapes as each engine runs it (the rollout's fused
q|k|v and gate|up at decode's row counts, the trainer's q, k, v, gate and up apart at a training
micro-batch's, o, down and the LM head at both), it records each candidate tiling's time (in a CUDA graph over
distinct per-layer weights, so they stream from HBM, as `bench/decode_gemm.py` does), cuBLAS's, and whether
its output equals, bit for bit, that of the per-K tiling the current table gives (`current`). The summary
names the tile parameters that never changed a bit, chooses the tiling per K, and per (N, K) and M the
fastest tiling bit-equal to that per-K one, and gives the time per decode step and per training pass of the
layers' GEMMs with the current tiling, the per-K one, the table's and cuBLAS. Prints a table and writes JSON;
`--write-table` writes the table in tiles.json's format.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from hybridflow.engine.invariant.tiles import DEFAULT, Tile  # noqa: E402

# (hidden, q heads, kv heads, head dim, intermediate, layers, vocabulary)
SHAPES = {"smollm2": (576, 9, 3, 64, 1536, 30, 49152), "0.5b": (896, 14, 2, 64, 4864, 24, 151936)}
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the current bf16 tiling with one of warps or stages changed, and
# every (BLOCK_M, BLOCK_N, BLOCK_K) at 3 stages (36 + 2; the current table's per-K tilings are among them)
CANDIDATES = [(m, n, k, 8 if m * n >= 16384 else 4, 3)
              for m, n, k in itertools.product((16, 32, 64, 128), (64, 128, 256), (32, 64, 128))] \
    + [(64, 128, 64, 8, 3), (64, 128, 64, 4, 4)]


def projections(shape: str) -> dict[str, tuple[int, int, int, str]]:
    """name -> (N, K, how many per forward, at which rows) of y = x @ W.T, as each engine runs them: the rollout
    fuses q|k|v and gate|up ("decode" rows), the trainer runs their parts apart ("train" rows), and both run
    o, down and the LM head ("both")."""
    h, hq, hkv, d, inter, layers, vocab = SHAPES[shape]
    return {"qkv": ((hq + 2 * hkv) * d, h, layers, "decode"), "gate_up": (2 * inter, h, layers, "decode"),
            "q": (hq * d, h, layers, "train"), "k": (hkv * d, h, layers, "train"), "v": (hkv * d, h, layers, "train"),
            "gate": (inter, h, layers, "train"), "up": (inter, h, layers, "train"),
            "o": (h, hq * d, layers, "both"), "down": (h, inter, layers, "both"), "head": (vocab, h, 1, "both")}


def measure(shape: str, decode_rows: list[int], train_rows: int, candidates: list[Tile]) -> list[dict]:
    """One record per (projection, M): cuBLAS's time and each candidate tiling's time and whether its output
    equals, bit for bit, that of the per-K tiling the current table gives its K (`current_us`: that tiling's)."""
    from decode_gemm import time_graph

    from hybridflow.engine.invariant.tiles import per_k_tile
    from hybridflow.engine.invariant.triton_gemm import linear

    out = []
    for name, (n, k, layers, regime) in projections(shape).items():
        reference_tile = per_k_tile(torch.bfloat16, k)
        tiles = candidates + [reference_tile] * (reference_tile not in candidates)
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(layers)]
        for m in {"decode": decode_rows, "train": [train_rows], "both": [*decode_rows, train_rows]}[regime]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            reference = linear(x, weights[0], None, reference_tile)
            rec: dict = {"shape": shape, "proj": name, "M": m, "N": n, "K": k, "layers": layers,
                   "cublas_us": time_graph(F.linear, weights, x), "tiles": []}
            for tile in tiles:
                try:
                    got = linear(x, weights[0], None, tile)
                    us = time_graph(lambda a, b, t=tile: linear(a, b, None, t), weights, x)
                except Exception as e:  # noqa: BLE001 - a tiling that does not fit the shared memory
                    rec["tiles"].append({"tile": list(tile), "error": type(e).__name__})
                    continue
                rec["tiles"].append({"tile": list(tile), "us": us, "bits_equal": bool(torch.equal(got, reference))})
            rec["current_us"] = next(t["us"] for t in rec["tiles"] if as_tile(t["tile"]) == reference_tile)
            out.append(rec)
            equal = sum(bool(t.get("bits_equal")) for t in rec["tiles"])
            print(f"{shape:<8}{name:<8}{m:>6}{n:>7}{k:>6}  current {rec['current_us']:8.2f} us  cublas "
                  f"{rec['cublas_us']:8.2f} us  bit-equal tilings {equal}/{len(tiles)}", flush=True)
            del x, reference
        del weights
    return out


def as_tile(values: list[int] | tuple[int, ...]) -> Tile:
    """A tiling as JSON holds it (a list) as `Tile`."""
    block_m, block_n, block_k, warps, stages = values
    return block_m, block_n, block_k, warps, stages


def equal_bits(record: dict, tile: Tile) -> set[Tile]:
    """The tilings that ran at `record` and gave the bits `tile` gave. Records compare every tiling with one
    reference: two tilings both equal to it are equal to each other; of one that was not, only itself is known."""
    ran = {as_tile(t["tile"]): t for t in record["tiles"] if "us" in t}
    if tile in ran and ran[tile]["bits_equal"]:
        return {t for t, x in ran.items() if x["bits_equal"]}
    return {tile} & set(ran)


def summarize(results: list[dict], references: dict[int, Tile], decode_rows: list[int], train_rows: int,
              decode_steps: int = 256, train_passes: int = 6) -> dict:
    """From records whose bits were compared with `references` (K -> the tiling the table gave when measured,
    "current"): which tile parameters never changed a bit; the tiling per K (`per_k`); the fastest tiling per
    (N, K) and M bit-equal to that per-K tiling (`per_shape`); `table`, the two in tiles.json's format; and
    the GEMM time per decode step / training pass (per forward: records times their `layers`) with the
    current tiling, the per-K one, the table's (`per_shape_ms`), and cuBLAS.

    A K's tiling is the one, among those that ran at every record of that K, with the least GEMM time over a
    step of `decode_steps` decode steps (the mean over `decode_rows`) and `train_passes` training forwards of
    `train_rows` rows, summed over the shapes measured; where it does not beat the current one, the current
    one stays. The table names it where it is not `DEFAULT`. An (N, K) gets a table entry, {"<M>": tiling} for
    every M measured, where at some M a tiling bit-equal to the per-K one (in every record of that N, K and M)
    is faster than it."""
    names = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "warps", "stages")
    harmless = {}
    for i, name in enumerate(names):  # harmless: changing it alone (in a tiling that ran) never changed a bit
        alone = [t for r in results for t in r["tiles"] if "bits_equal" in t
                 and t["tile"][i] != references[r["K"]][i]
                 and sum(a != b for a, b in zip(t["tile"], references[r["K"]])) == 1]
        harmless[name] = bool(alone) and all(t["bits_equal"] for t in alone)
    times: list[dict[Tile, float]] = [{as_tile(t["tile"]): t["us"] for t in r["tiles"] if "us" in t} for r in results]

    def weight(m: int) -> float:  # how many forwards of m rows one step runs
        return decode_steps / len(decode_rows) if m in decode_rows else train_passes if m == train_rows else 0.0

    per_k: dict[int, dict] = {}
    for k in sorted({r["K"] for r in results}):
        group = [i for i, r in enumerate(results) if r["K"] == k]
        ran = set.intersection(*(set(times[i]) for i in group))

        def cost(tile: Tile) -> float:  # microseconds of this K's GEMMs in one step of the model(s)
            return sum(results[i]["layers"] * weight(results[i]["M"]) * times[i][tile] for i in group)

        best, current = min(ran, key=cost), references[k]
        chosen = best if cost(best) < cost(current) else current
        per_k[k] = {"tile": list(chosen), "step_ms": cost(chosen) / 1e3, "current_step_ms": cost(current) / 1e3,
                    "projections": sorted({f"{results[i]['shape']}/{results[i]['proj']}" for i in group})}
    table: dict[str, dict] = {"bfloat16": {str(k): v["tile"] for k, v in per_k.items()
                                           if as_tile(v["tile"]) != DEFAULT[torch.bfloat16]}}
    per_shape: dict[str, dict[str, dict]] = {}
    best_at: dict[tuple[int, int, int], Tile] = {}
    for n, k, m in sorted({(r["N"], r["K"], r["M"]) for r in results}):
        group = [i for i, r in enumerate(results) if (r["N"], r["K"], r["M"]) == (n, k, m)]
        reference = as_tile(per_k[k]["tile"])
        equal = set.intersection(*(equal_bits(results[i], reference) for i in group))

        def forward_us(tile: Tile) -> float:  # microseconds of this shape's GEMMs at m rows in one forward
            return sum(results[i]["layers"] * times[i][tile] for i in group)

        best = best_at[n, k, m] = min(equal, key=lambda t: (forward_us(t), t != reference))
        per_shape.setdefault(f"{n},{k}", {})[str(m)] = {
            "tile": list(best), "forward_us": forward_us(best), "per_k_forward_us": forward_us(reference),
            "projections": sorted({f"{results[i]['shape']}/{results[i]['proj']}" for i in group})}
    for key, by_m in per_shape.items():
        if any(v["forward_us"] < v["per_k_forward_us"] for v in by_m.values()):
            table["bfloat16"][key] = {m: v["tile"] for m, v in by_m.items()}
    us_with = {"current_ms": lambda i: results[i]["current_us"], "cublas_ms": lambda i: results[i]["cublas_us"],
               "per_k_ms": lambda i: times[i][as_tile(per_k[results[i]["K"]]["tile"])],
               "per_shape_ms": lambda i: times[i][best_at[results[i]["N"], results[i]["K"], results[i]["M"]]]}
    totals = {}
    for shape in sorted({r["shape"] for r in results}):
        for regime, ms in (("decode", decode_rows), ("train", [train_rows])):
            t = dict.fromkeys(us_with, 0.0)
            for proj in {r["proj"] for r in results if r["shape"] == shape}:
                at = {r["M"]: i for i, r in enumerate(results) if (r["shape"], r["proj"]) == (shape, proj)}
                if not all(m in at for m in ms):
                    continue  # an engine that does not run this projection at these rows
                for key, us in us_with.items():
                    t[key] += results[at[ms[0]]]["layers"] * sum(us(at[m]) for m in ms) / len(ms) / 1e3
            totals[f"{shape}/{regime}"] = t
    return {"harmless_parameters": harmless, "layer_gemm_time": totals, "per_k": per_k, "per_shape": per_shape,
            "table": table}


def report(summary: dict) -> None:
    for key, t in summary["layer_gemm_time"].items():
        print(f"{key:<16} current {t['current_ms']:7.3f} ms  per-K {t['per_k_ms']:7.3f} ms  per-shape "
              f"{t['per_shape_ms']:7.3f} ms  cublas {t['cublas_ms']:7.3f} ms")
    for k, v in summary["per_k"].items():
        print(f"K={k:<6} {v['tile']}  {v['step_ms']:8.2f} ms a step against {v['current_step_ms']:8.2f} ms "
              f"({', '.join(v['projections'])})")
    for key, by_m in summary["per_shape"].items():
        named = "table" if key in summary["table"]["bfloat16"] else "per-K"
        print(f"N,K={key:<12} ({named}) " + "  ".join(f"M={m} {v['tile']} {v['forward_us']:.1f}/"
                                                     f"{v['per_k_forward_us']:.1f} us" for m, v in by_m.items()))
    print("tile parameters that never changed a bit:", summary["harmless_parameters"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="smollm2,0.5b")
    p.add_argument("--decode-rows", default="64,128,256,512")
    p.add_argument("--train-rows", type=int, default=16384)
    p.add_argument("--decode-steps", type=int, default=256, help="decode steps per step, for the per-K choice")
    p.add_argument("--train-passes", type=int, default=6, help="training forwards of --train-rows per step")
    p.add_argument("--summarize", default=None, metavar="JSON",
                   help="summarize this results JSON again (no GPU, nothing measured) instead of measuring")
    p.add_argument("--write-table", default=None, metavar="JSON",
                   help="write the per-K and per-shape tilings in tiles.json's format "
                        "(hybridflow/engine/invariant/tiles.py)")
    p.add_argument("--out", default=None, help="the results JSON (with --summarize: only where given)")
    a = p.parse_args()
    from bench_util import git_commit, write_json

    decode_rows = [int(r) for r in a.decode_rows.split(",")]
    if a.summarize:
        data = json.loads(Path(a.summarize).read_text())
        if "reference_tiles" in data:
            references = {int(k): as_tile(v) for k, v in data["reference_tiles"].items()}
        else:  # measured before the table existed: one reference tiling for every K
            references = {r["K"]: as_tile(data["reference_tile"]) for r in data["results"]}
        results, measured = data["results"], f"{data['device']} at {data['commit']} ({a.summarize})"
    else:
        from hybridflow.engine.invariant.tiles import per_k_tile

        results = [r for s in a.shapes.split(",") for r in measure(s, decode_rows, a.train_rows, CANDIDATES)]
        references = {r["K"]: per_k_tile(torch.bfloat16, r["K"]) for r in results}
        data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": git_commit(),
                "reference_tiles": {str(k): list(v) for k, v in references.items()}, "candidates": CANDIDATES,
                "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30, "results": results}
        measured = f"{data['device']} at {data['commit']}"
    summary = summarize(results, references, decode_rows, a.train_rows, a.decode_steps, a.train_passes)
    report(summary)
    if a.write_table:
        write_json({"about": f"exact mode's GEMM tilings per K and per (N,K) and M (hybridflow/engine/invariant/"
                             f"tiles.py); written by bench/invariant_gemm.py --write-table from {measured}",
                    **summary["table"]}, a.write_table)
    if a.out or not a.summarize:
        write_json({**data, "summary": summary, **({"summarized_at": git_commit()} if a.summarize else {})},
                   a.out or HERE / "results" / "invariant_gemm_h200.json")


if __name__ == "__main__":
    main()

"""Exact mode's invariant linear (`hybridflow.engine.invariant.triton_gemm`) at other tilings: speed, and
whether the bits change.

    python bench/invariant_gemm.py --out bench/results/invariant_gemm_h200.json   # one H200 (bash bench/h200.sh
                                                                                  # invariant_gemm)

Exact mode runs every linear layer as one Triton GEMM with one tiling per dtype (`TILES`), for decode's few
rows and the trainer's thousands alike; at the 0.5B shape that costs the rollout ~1.9x the default engine's
decode step and the update ~1.8x (docs/exact.md). Batch invariance only needs the tiling not to depend on
the rows (M). Whether it may depend on the weight's shape (N, K), or even on M, depends on which tile
parameters change the bits of an output: BLOCK_K sets the order in which K's products are summed, but the
tensor-core instruction Triton picks (wgmma or mma) follows BLOCK_M, BLOCK_N and the warps too. This
measures, for each projection of the SmolLM2-135M and Qwen2-0.5B shapes at decode's row counts and a
training micro-batch's, each candidate tiling's time (in a CUDA graph over distinct per-layer weights, so they
stream from HBM, as `bench/decode_gemm.py` does), cuBLAS's, and whether its output equals the current
tiling's bit for bit. The summary names the tile parameters that never changed a bit, and the time per decode
step and per training pass of the layers' GEMMs with the current tiling, the fastest bit-equal tiling per
(N, K), and cuBLAS. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

# (hidden, q heads, kv heads, head dim, intermediate, layers, vocabulary)
SHAPES = {"smollm2": (576, 9, 3, 64, 1536, 30, 49152), "0.5b": (896, 14, 2, 64, 4864, 24, 151936)}
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the current bf16 tiling with one of warps or stages changed, and
# every (BLOCK_M, BLOCK_N, BLOCK_K) at 3 stages (36 + 2, ~5 minutes on an H200)
CANDIDATES = [(m, n, k, 8 if m * n >= 16384 else 4, 3)
              for m, n, k in itertools.product((16, 32, 64, 128), (64, 128, 256), (32, 64, 128))] \
    + [(64, 128, 64, 8, 3), (64, 128, 64, 4, 4)]


def projections(shape: str) -> dict[str, tuple[int, int, int]]:
    """name -> (N, K, how many per forward) of y = x @ W.T: a decoder layer's four projections (as the rollout
    fuses them) and the LM head."""
    h, hq, hkv, d, inter, layers, vocab = SHAPES[shape]
    return {"qkv": ((hq + 2 * hkv) * d, h, layers), "o": (h, hq * d, layers), "gate_up": (2 * inter, h, layers),
            "down": (h, inter, layers), "head": (vocab, h, 1)}


def measure(shape: str, rows: list[int], candidates: list[tuple]) -> list[dict]:
    """One record per (projection, M): cuBLAS's time and each candidate tiling's time and bits."""
    from decode_gemm import time_graph

    from hybridflow.engine.invariant.tiles import DEFAULT
    from hybridflow.engine.invariant.triton_gemm import linear

    reference_tile = DEFAULT[torch.bfloat16]
    out = []
    for name, (n, k, layers) in projections(shape).items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(layers)]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            reference = linear(x, weights[0], None, reference_tile)
            rec = {"shape": shape, "proj": name, "M": m, "N": n, "K": k, "layers": layers,
                   "cublas_us": time_graph(F.linear, weights, x), "tiles": []}
            for tile in candidates:
                try:
                    got = linear(x, weights[0], None, tile)
                    us = time_graph(lambda a, b, t=tile: linear(a, b, None, t), weights, x)
                except Exception as e:  # noqa: BLE001 - a tiling that does not fit the shared memory
                    rec["tiles"].append({"tile": list(tile), "error": type(e).__name__})
                    continue
                rec["tiles"].append({"tile": list(tile), "us": us, "bits_equal": bool(torch.equal(got, reference))})
            rec["current_us"] = next(t["us"] for t in rec["tiles"] if tuple(t["tile"]) == reference_tile)
            out.append(rec)
            equal = sum(bool(t.get("bits_equal")) for t in rec["tiles"])
            print(f"{shape:<8}{name:<8}{m:>6}{n:>7}{k:>6}  current {rec['current_us']:8.2f} us  cublas "
                  f"{rec['cublas_us']:8.2f} us  bit-equal tilings {equal}/{len(candidates)}", flush=True)
            del x, reference
        del weights
    return out


def summarize(results: list[dict], reference_tile: tuple, decode_rows: list[int], train_rows: int,
              decode_steps: int = 256, train_passes: int = 6) -> dict:
    """Which tile parameters never changed a bit; the tiling per K for `tiles.json` (`per_k`, `table`); and
    the GEMM time per decode step / training pass (per forward: records times their `layers`) with the current
    tiling, the fastest bit-equal tiling per (N, K), the per-K table's, and cuBLAS.

    A K's tiling is the one, among those that ran at every projection and M of that K, with the least GEMM
    time over a step of `decode_steps` decode steps (the mean over `decode_rows`) and `train_passes` training
    forwards of `train_rows` rows, summed over the shapes measured; the table names it where it beats the
    current tiling."""
    names = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "warps", "stages")
    harmless = {}
    for i, name in enumerate(names):  # harmless: changing it alone (in a tiling that ran) never changed a bit
        alone = [t for r in results for t in r["tiles"] if "bits_equal" in t and t["tile"][i] != reference_tile[i]
                 and sum(a != b for a, b in zip(t["tile"], reference_tile)) == 1]
        harmless[name] = bool(alone) and all(t["bits_equal"] for t in alone)
    times = {(r["shape"], r["proj"], r["M"]): {tuple(t["tile"]): t["us"] for t in r["tiles"] if "us" in t}
             for r in results}
    per_k: dict[int, dict] = {}
    for k in sorted({r["K"] for r in results}):
        group = {(r["shape"], r["proj"], r["layers"]) for r in results if r["K"] == k}
        ran = set.intersection(*(set(times[s, p, r["M"]]) for s, p, _ in group for r in results
                                 if (r["shape"], r["proj"]) == (s, p)))

        def cost(tile: tuple) -> float:  # microseconds of this K's GEMMs in one step of the model(s)
            return sum(layers * (decode_steps * sum(times[s, p, m][tile] for m in decode_rows) / len(decode_rows)
                                 + train_passes * times[s, p, train_rows][tile]) for s, p, layers in group)

        best = min(ran, key=cost)
        per_k[k] = {"tile": list(best), "step_ms": cost(best) / 1e3,
                    "current_step_ms": cost(tuple(reference_tile)) / 1e3,
                    "projections": sorted(f"{s}/{p}" for s, p, _ in group)}
    chosen = {k: tuple(v["tile"]) for k, v in per_k.items()}
    per_nk: dict[tuple, dict] = {}
    for r in results:
        per_nk.setdefault((r["shape"], r["proj"]), {})[r["M"]] = r
    totals = {}
    for shape in sorted({r["shape"] for r in results}):
        for regime, ms in (("decode", decode_rows), ("train", [train_rows])):
            t = dict.fromkeys(("current_ms", "per_nk_bit_equal_ms", "per_k_ms", "cublas_ms"), 0.0)
            for (s, proj), by_m in per_nk.items():
                if s != shape:
                    continue
                layers, k = by_m[ms[0]]["layers"], by_m[ms[0]]["K"]
                # one tiling per (N, K), bit-equal to the current one at every M measured, fastest over these rows
                tiles = {m: {tuple(x["tile"]): x for x in by_m[m]["tiles"]} for m in by_m}
                ok = [x for x in tiles[ms[0]] if all(tiles[m][x].get("bits_equal") for m in by_m)]
                best = min(ok, key=lambda x: sum(tiles[m][x]["us"] for m in ms))
                for key, us in (("current_ms", [by_m[m]["current_us"] for m in ms]),
                                ("cublas_ms", [by_m[m]["cublas_us"] for m in ms]),
                                ("per_nk_bit_equal_ms", [tiles[m][best]["us"] for m in ms]),
                                ("per_k_ms", [times[s, proj, m][chosen[k]] for m in ms])):
                    t[key] += layers * sum(us) / len(us) / 1e3
            totals[f"{shape}/{regime}"] = t
    table = {"bfloat16": {str(k): v["tile"] for k, v in per_k.items()
                          if tuple(v["tile"]) != tuple(reference_tile) and v["step_ms"] < v["current_step_ms"]}}
    return {"harmless_parameters": harmless, "layer_gemm_time": totals, "per_k": per_k, "table": table}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="smollm2,0.5b")
    p.add_argument("--decode-rows", default="64,128,256,512")
    p.add_argument("--train-rows", type=int, default=16384)
    p.add_argument("--decode-steps", type=int, default=256, help="decode steps per step, for the per-K choice")
    p.add_argument("--train-passes", type=int, default=6, help="training forwards of --train-rows per step")
    p.add_argument("--write-table", default=None, metavar="JSON",
                   help="write the per-K tilings in tiles.json's format (hybridflow/engine/invariant/tiles.py)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from grpo_vs_trl import git_commit, write_json

    from hybridflow.engine.invariant.tiles import DEFAULT

    decode_rows = [int(r) for r in a.decode_rows.split(",")]
    results = [r for s in a.shapes.split(",") for r in measure(s, [*decode_rows, a.train_rows], CANDIDATES)]
    summary = summarize(results, DEFAULT[torch.bfloat16], decode_rows, a.train_rows, a.decode_steps, a.train_passes)
    for key, t in summary["layer_gemm_time"].items():
        print(f"{key:<16} current {t['current_ms']:7.3f} ms  per-(N,K) bit-equal {t['per_nk_bit_equal_ms']:7.3f} ms"
              f"  per-K {t['per_k_ms']:7.3f} ms  cublas {t['cublas_ms']:7.3f} ms")
    for k, v in summary["per_k"].items():
        print(f"K={k:<6} {v['tile']}  {v['step_ms']:8.2f} ms a step against {v['current_step_ms']:8.2f} ms "
              f"({', '.join(v['projections'])})")
    print("tile parameters that never changed a bit:", summary["harmless_parameters"])
    commit = git_commit()
    if a.write_table:
        write_json({"about": f"exact mode's GEMM tiling per K (hybridflow/engine/invariant/tiles.py); written by "
                             f"bench/invariant_gemm.py --write-table on {torch.cuda.get_device_name()} at {commit}",
                    **summary["table"]}, a.write_table)
    write_json({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit,
                "reference_tile": DEFAULT[torch.bfloat16], "candidates": CANDIDATES, "summary": summary,
                "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30, "results": results},
               a.out or HERE / "results" / "invariant_gemm_h200.json")


if __name__ == "__main__":
    main()

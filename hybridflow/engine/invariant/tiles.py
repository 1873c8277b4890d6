"""Which tiling exact mode's invariant GEMM (`triton_gemm.linear`) runs for a [M, K] @ [N, K].T product.

A tiling is (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages). Whatever the tiling, each program walks K from 0 with
no split-K, accumulating `tl.dot` in fp32, and the tensor cores sum an output's K products in the same k16
steps in the same order: a tile's shape changes which program computes an output element and how fast, not
the order of its additions. So a tiling should not change an output's bits, and it may depend on M, N and K.
That was measured, not only argued: `bench/invariant_gemm.py` ran every candidate tiling at each projection
of two model shapes, at decode's rows and a training micro-batch's, and every tiling that compiled gave an
output bit-equal to the reference's (H100, bf16; docs/exact.md). The bench compares each candidate against the per-K
tiling below, and writes a shape entry only with tilings it measured bit-equal to that per-K tiling at every
M the entry names. That is what keeps a fused projection (the rollout's q|k|v, gate|up) and its parts (the
trainer's q, k, v, gate, up) on one set of bits although they run at different N and M.

`tiles.json` beside this module holds the measured choices (`bench/invariant_gemm.py --write-table`), per
dtype: "<K>" -> a tiling, the per-K choice; and "<N>,<K>" -> {"<M upper bound>": tiling, ...}, per weight
shape and row count. `tile_for` takes the shape entry's tiling of the smallest bound >= M (the largest
bound's past it), else the per-K one, else `DEFAULT`, the tiling per dtype that exact mode was built and
tested with. Both engines read the same table. A new table should change no bits; the GPU tests
(`bash bench/h200.sh exact_tests`) are what show it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import torch

Tile = tuple[int, int, int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages

DEFAULT: dict[torch.dtype, Tile] = {torch.bfloat16: (64, 128, 64, 4, 3), torch.float16: (64, 128, 64, 4, 3),
                                    torch.float32: (32, 64, 32, 4, 3)}
TABLE_PATH = Path(__file__).with_name("tiles.json")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class Tiles(NamedTuple):
    """One dtype's table: K -> tiling, and (N, K) -> (M upper bound, tiling) pairs in increasing bound."""
    per_k: dict[int, Tile]
    per_shape: dict[tuple[int, int], tuple[tuple[int, Tile], ...]]


def _tile(path: Path, where: str, value: object) -> Tile:
    if not (isinstance(value, list) and len(value) == 5
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ValueError(f"{path}: {where} = {value!r} is not a tiling: five positive ints "
                         f"(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)")
    return (value[0], value[1], value[2], value[3], value[4])


def _positive_ints(text: str) -> list[int] | None:
    parts = text.split(",")
    return [int(p) for p in parts] if all(p.strip().isdigit() and int(p) > 0 for p in parts) else None


def load(path: Path = TABLE_PATH) -> dict[torch.dtype, Tiles]:
    """The table at `path`: {"bfloat16": {"<K>": [BLOCK_M, BLOCK_N, BLOCK_K, warps, stages], "<N>,<K>":
    {"<M upper bound>": [...], ...}, ...}, ...} (other top-level keys, such as where it was measured, are notes)."""
    raw = json.loads(path.read_text())
    table: dict[torch.dtype, Tiles] = {}
    for name, dtype in DTYPES.items():
        tiles = Tiles({}, {})
        for key, value in raw.get(name, {}).items():
            dims = _positive_ints(key)
            if dims is not None and len(dims) == 1:
                tiles.per_k[dims[0]] = _tile(path, f"{name}[{key}]", value)
            elif dims is not None and len(dims) == 2:
                if not isinstance(value, dict) or not value:
                    raise ValueError(f"{path}: {name}[{key}] = {value!r} is not a shape entry: a non-empty "
                                     f"{{\"<M upper bound>\": tiling}}")
                buckets = []
                for bound, tile in value.items():
                    m = _positive_ints(bound)
                    if m is None or len(m) != 1:
                        raise ValueError(f"{path}: {name}[{key}] has the bound {bound!r}: an M upper bound is "
                                         f"a positive int")
                    buckets.append((m[0], _tile(path, f"{name}[{key}][{bound}]", tile)))
                tiles.per_shape[dims[0], dims[1]] = tuple(sorted(buckets))
            else:
                raise ValueError(f"{path}: {name} has the key {key!r}: a key is \"<K>\" (a tiling) or "
                                 f"\"<N>,<K>\" ({{\"<M upper bound>\": tiling}}), positive ints")
        table[dtype] = tiles
    return table


TABLE = load()


def per_k_tile(dtype: torch.dtype, k: int) -> Tile:
    """The tiling of a GEMM of depth `k` in `dtype` that no shape entry names: the table's per-K one, else
    `DEFAULT`. Shape entries hold tilings measured bit-equal to it."""
    tiles = TABLE.get(dtype)
    return tiles.per_k.get(k, DEFAULT[dtype]) if tiles else DEFAULT[dtype]


def tile_for(dtype: torch.dtype, m: int, n: int, k: int) -> Tile:
    """The tiling of a [m, k] @ [n, k].T GEMM in `dtype`: the (n, k) entry's of the smallest M bound >= m (its
    largest bound's past them all), else `per_k_tile`."""
    tiles = TABLE.get(dtype)
    buckets = tiles.per_shape.get((n, k)) if tiles else None
    if not buckets:
        return per_k_tile(dtype, k)
    return next((tile for bound, tile in buckets if bound >= m), buckets[-1][1])

"""Which tiling exact mode's invariant GEMM (`triton_gemm.linear`) runs for a weight: one per (dtype, K).

A tiling (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) fixes how an output element's K products are summed
(the K steps, the tensor-core instruction), so batch invariance needs only that it never depends on M, the
rows: decode's few rows and the trainer's thousands then round alike. It may depend on the weight. It is
chosen by K alone, not by N, because the rollout fuses projections the trainer runs apart (q|k|v, gate|up):
they share K, so the fused weight and each of its parts get one tiling, and each output column keeps the
bits its own projection gives it. The LM head shares K with the layers' input projections, and their tiling.

`tiles.json` beside this module holds the measured choices (`bench/invariant_gemm.py --write-table`, from the
GEMM times of each candidate tiling at a model shape's projections, decode's rows and a training
micro-batch's); a K it does not name uses `DEFAULT`, the one tiling per dtype that exact mode was built and
tested with. Both engines read the same table, so changing it changes the bits of every exact run (not
whether they match): the GPU tests (`pytest -m gpu tests/engine/rollout/test_rollout_exact.py`) must pass
after any change to it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

Tile = tuple[int, int, int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages

DEFAULT: dict[torch.dtype, Tile] = {torch.bfloat16: (64, 128, 64, 4, 3), torch.float16: (64, 128, 64, 4, 3),
                                    torch.float32: (32, 64, 32, 4, 3)}
TABLE_PATH = Path(__file__).with_name("tiles.json")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load(path: Path = TABLE_PATH) -> dict[torch.dtype, dict[int, Tile]]:
    """The table at `path`: {"bfloat16": {"<K>": [BLOCK_M, BLOCK_N, BLOCK_K, warps, stages], ...}, ...} (other
    top-level keys, such as where it was measured, are notes)."""
    raw = json.loads(path.read_text())
    table: dict[torch.dtype, dict[int, Tile]] = {}
    for name, dtype in DTYPES.items():
        for k, tile in raw.get(name, {}).items():
            if len(tile) != 5 or not all(isinstance(v, int) and v > 0 for v in tile):
                raise ValueError(f"{path}: {name}[{k}] = {tile!r} is not a tiling: five positive ints "
                                 f"(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)")
            table.setdefault(dtype, {})[int(k)] = (tile[0], tile[1], tile[2], tile[3], tile[4])
    return table


TABLE = load()


def tile_for(dtype: torch.dtype, k: int) -> Tile:
    """The tiling of a [*, k] @ [N, k].T GEMM in `dtype`, for every M and N."""
    return TABLE.get(dtype, {}).get(k, DEFAULT[dtype])

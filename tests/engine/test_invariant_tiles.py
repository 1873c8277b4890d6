"""Exact mode's GEMM tiling per (dtype, K) (`hybridflow.engine.invariant.tiles`): the shipped table loads, a K
it does not name runs the default tiling, and a malformed entry is refused naming the file and the entry."""

from __future__ import annotations

import json

import pytest
import torch

from hybridflow.engine.invariant import tiles


def test_the_shipped_table_loads_and_unnamed_ks_run_the_default():
    table = tiles.load()
    assert set(table) <= set(tiles.DTYPES.values())
    unnamed = next(k for k in range(1, 10**6) if k not in table.get(torch.bfloat16, {}))
    assert tiles.tile_for(torch.bfloat16, unnamed) == tiles.DEFAULT[torch.bfloat16]
    assert tiles.tile_for(torch.float32, unnamed) == tiles.DEFAULT[torch.float32]


def test_a_table_names_a_tiling_per_k_and_rejects_what_is_not_one(tmp_path, monkeypatch):
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"about": "test", "bfloat16": {"896": [128, 64, 64, 8, 3]}}))
    monkeypatch.setattr(tiles, "TABLE", tiles.load(path))
    # the fused q|k|v and each of its parts share K, so one tiling serves them all
    assert tiles.tile_for(torch.bfloat16, 896) == (128, 64, 64, 8, 3)
    assert tiles.tile_for(torch.bfloat16, 4864) == tiles.DEFAULT[torch.bfloat16]
    assert tiles.tile_for(torch.float32, 896) == tiles.DEFAULT[torch.float32]
    path.write_text(json.dumps({"bfloat16": {"896": [128, 64, 64]}}))
    with pytest.raises(ValueError, match=r"tiles.json: bfloat16\[896\] = \[128, 64, 64\] is not a tiling"):
        tiles.load(path)

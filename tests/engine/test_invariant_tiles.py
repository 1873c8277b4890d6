"""Exact mode's GEMM tilings (`hybridflow.engine.invariant.tiles`): the shipped table loads; a shape entry picks
the tiling of the smallest M bound at or above the rows (its largest past them all); a shape it does not name
runs the per-K tiling, a K it does not name the default; a malformed entry is refused naming the file and the
entry."""

from __future__ import annotations

import json
import re

import pytest
import torch

from hybridflow.engine.invariant import tiles

PER_K, SMALL, MID, LARGE = (128, 128, 64, 8, 3), (16, 64, 128, 4, 3), (64, 64, 128, 4, 3), (128, 256, 64, 8, 3)


def use_table(tmp_path, monkeypatch, bf16: dict) -> None:
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"about": "test", "bfloat16": bf16}))
    monkeypatch.setattr(tiles, "TABLE", tiles.load(path))


def test_the_shipped_table_loads_and_unnamed_shapes_run_the_per_k_or_default_tiling():
    table = tiles.load()
    assert set(table) <= set(tiles.DTYPES.values())
    bf16 = table[torch.bfloat16]
    unnamed = next(k for k in range(1, 10**6) if k not in bf16.per_k and all(key[1] != k for key in bf16.per_shape))
    assert tiles.tile_for(torch.bfloat16, 64, 128, unnamed) == tiles.DEFAULT[torch.bfloat16]
    assert tiles.tile_for(torch.float32, 64, 128, unnamed) == tiles.DEFAULT[torch.float32]
    for (n, k), buckets in bf16.per_shape.items():  # every bound of a shipped entry is the tiling it names
        assert [tiles.tile_for(torch.bfloat16, m, n, k) for m, _ in buckets] == [tile for _, tile in buckets]


def test_a_shape_entry_picks_the_smallest_bound_at_or_above_m(tmp_path, monkeypatch):
    use_table(tmp_path, monkeypatch, {"896": list(PER_K),
                                      "1152,896": {"16384": list(LARGE), "64": list(SMALL), "256": list(MID)}})
    picked = {m: tiles.tile_for(torch.bfloat16, m, 1152, 896) for m in (1, 64, 65, 256, 257, 16384, 10**6)}
    assert picked == {1: SMALL, 64: SMALL, 65: MID, 256: MID, 257: LARGE, 16384: LARGE, 10**6: LARGE}


def test_without_a_shape_entry_the_per_k_tiling_then_the_default(tmp_path, monkeypatch):
    use_table(tmp_path, monkeypatch, {"896": list(PER_K), "1152,896": {"64": list(SMALL)}})
    # the trainer's k projection shares K with the rollout's fused q|k|v but not N: the per-K tiling
    assert tiles.tile_for(torch.bfloat16, 64, 128, 896) == PER_K == tiles.per_k_tile(torch.bfloat16, 896)
    assert tiles.tile_for(torch.bfloat16, 64, 1152, 4864) == tiles.DEFAULT[torch.bfloat16]
    assert tiles.tile_for(torch.float16, 64, 1152, 896) == tiles.DEFAULT[torch.float16]
    assert tiles.tile_for(torch.float32, 64, 1152, 896) == tiles.DEFAULT[torch.float32]


@pytest.mark.parametrize("entry, message", [
    ({"896": [128, 64, 64]}, r"bfloat16\[896\] = \[128, 64, 64\] is not a tiling"),
    ({"896": [128, 64, 64, 0, 3]}, r"bfloat16\[896\] = \[128, 64, 64, 0, 3\] is not a tiling: five positive ints"),
    ({"1152,896": {"64": [64, 64, True, 4, 3]}},
     r"bfloat16\[1152,896\]\[64\] = \[64, 64, True, 4, 3\] is not a tiling"),
    ({"1152,896": [64, 64, 128, 4, 3]}, r"bfloat16\[1152,896\] = \[64, 64, 128, 4, 3\] is not a shape entry"),
    ({"1152,896": {}}, r"bfloat16\[1152,896\] = \{\} is not a shape entry"),
    ({"1152,896": {"-64": [64, 64, 128, 4, 3]}}, r"bfloat16\[1152,896\] has the bound '-64'"),
    ({"1152,896,3": [64, 64, 128, 4, 3]}, r"bfloat16 has the key '1152,896,3': a key is \"<K>\""),
    ({"q_proj": [64, 64, 128, 4, 3]}, r"bfloat16 has the key 'q_proj'"),
])
def test_a_malformed_entry_is_refused_naming_the_file_and_the_entry(tmp_path, entry, message):
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"bfloat16": entry}))
    with pytest.raises(ValueError, match=re.escape(f"{path}: ") + message):
        tiles.load(path)

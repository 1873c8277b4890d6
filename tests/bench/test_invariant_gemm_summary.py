"""`bench/invariant_gemm.py`'s summary from measured records: which tile parameters never changed a bit, the
tiling per K and the per-(N, K)-and-M tilings bit-equal to it that `tiles.json` takes, and the layers' GEMM time
with the current tiling, the per-K one, the table's and cuBLAS; and `--summarize`, which makes the table again
from a results JSON without a GPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import invariant_gemm  # noqa: E402
from invariant_gemm import summarize  # noqa: E402

from hybridflow.engine.invariant import tiles  # noqa: E402

REF = (64, 128, 64, 4, 3)
assert REF == tiles.DEFAULT[torch.bfloat16]


def record(proj, m, measured, cublas, k=8, n=8, current=REF):
    return {"shape": "s", "proj": proj, "M": m, "N": n, "K": k, "layers": 10, "cublas_us": cublas,
            "current_us": next(us for t, us, _ in measured if t == current),
            "tiles": [{"tile": list(t), "us": us, "bits_equal": eq} for t, us, eq in measured]
            + [{"tile": [128, 256, 128, 8, 3], "error": "OutOfResources"}]}


def test_summary_names_harmless_parameters_and_the_per_k_tiling_bits_or_not():
    small_m, other_k, more_warps = (16, 128, 64, 4, 3), (64, 128, 32, 4, 3), (64, 128, 64, 8, 3)
    results = [
        # qkv: a smaller BLOCK_M is faster at decode and equal bits at every M; another BLOCK_K changes the bits
        record("qkv", 64, [(REF, 10.0, True), (small_m, 4.0, True), (other_k, 1.0, False), (more_warps, 9.0, True)],
               3.0),
        record("qkv", 4096, [(REF, 100.0, True), (small_m, 120.0, True), (other_k, 90.0, False),
                             (more_warps, 95.0, True)], 60.0),
        # o: the smaller BLOCK_M changes the bits at the training M
        record("o", 64, [(REF, 6.0, True), (small_m, 2.0, True), (other_k, 1.0, False), (more_warps, 5.0, True)], 2.0),
        record("o", 4096, [(REF, 50.0, True), (small_m, 40.0, False), (other_k, 30.0, False),
                           (more_warps, 55.0, True)], 30.0),
    ]
    s = summarize(results, {8: REF}, [64], 4096)
    assert s["harmless_parameters"] == {"BLOCK_M": False, "BLOCK_N": False, "BLOCK_K": False, "warps": True,
                                        "stages": False}
    decode, train = s["layer_gemm_time"]["s/decode"], s["layer_gemm_time"]["s/train"]
    assert decode["current_ms"] == pytest.approx(0.16) and train["current_ms"] == pytest.approx(1.5)
    assert decode["cublas_ms"] == pytest.approx(0.05)
    # per K (both share K 8): the least time over 256 decode steps and 6 training passes, bits or not: BLOCK_K 32
    assert s["per_k"][8]["tile"] == [64, 128, 32, 4, 3]
    assert s["per_k"][8]["step_ms"] == pytest.approx(12.32) and s["per_k"][8]["current_step_ms"] == pytest.approx(49.96)
    assert decode["per_k_ms"] == pytest.approx(0.02) and train["per_k_ms"] == pytest.approx(1.2)
    # no other tiling is known to give BLOCK_K 32's bits (it differs from the reference), so no shape entry
    assert s["table"] == {"bfloat16": {"8": [64, 128, 32, 4, 3]}}
    assert s["per_shape"]["8,8"]["64"]["tile"] == [64, 128, 32, 4, 3]
    assert decode["per_shape_ms"] == decode["per_k_ms"] and train["per_shape_ms"] == train["per_k_ms"]


def test_a_shape_entry_holds_only_tilings_bit_equal_to_the_per_k_one_and_only_where_one_is_faster():
    fast_equal, fastest_other_bits, table_k32 = (16, 64, 128, 4, 3), (32, 64, 32, 4, 3), (128, 128, 64, 8, 3)
    results = [
        # the rollout's fused projection at decode's rows: a bit-equal tiling beats the per-K one, a faster one
        # that changes the bits does not count
        record("qkv", 64, [(REF, 10.0, True), (fast_equal, 5.0, True), (fastest_other_bits, 1.0, False)], 3.0),
        # the trainer's part of it at the training rows: the per-K tiling is the fastest bit-equal one
        record("q", 4096, [(REF, 100.0, True), (fast_equal, 500.0, True), (fastest_other_bits, 1000.0, False)],
               60.0, n=16),
        # K 32, measured with the table's per-K tiling as the reference: it stays, and stays in the table
        record("down", 64, [(REF, 30.0, True), (table_k32, 20.0, True)], 9.0, k=32, current=table_k32),
        record("down", 4096, [(REF, 300.0, True), (table_k32, 200.0, True)], 90.0, k=32, current=table_k32),
    ]
    s = summarize(results, {8: REF, 32: table_k32}, [64], 4096)
    assert s["per_k"][8]["tile"] == list(REF) and s["per_k"][32]["tile"] == list(table_k32)
    assert s["table"] == {"bfloat16": {"32": list(table_k32), "8,8": {"64": list(fast_equal)}}}
    assert s["per_shape"]["8,8"]["64"] == {"tile": list(fast_equal), "forward_us": 50.0, "per_k_forward_us": 100.0,
                                           "projections": ["s/qkv"]}
    assert s["per_shape"]["16,8"]["4096"]["tile"] == list(REF)
    decode, train = s["layer_gemm_time"]["s/decode"], s["layer_gemm_time"]["s/train"]
    # decode runs qkv and down, training q and down (each engine's own projections)
    assert decode["per_k_ms"] == pytest.approx(0.3) and decode["per_shape_ms"] == pytest.approx(0.25)
    assert train["per_k_ms"] == pytest.approx(3.0) and train["per_shape_ms"] == pytest.approx(3.0)
    assert decode["cublas_ms"] == pytest.approx(0.12) and train["cublas_ms"] == pytest.approx(1.5)


def test_a_shape_entry_names_every_m_measured_and_follows_a_per_k_change_through_the_reference():
    faster_decode = (16, 128, 64, 4, 3)
    results = [record("qkv", 64, [(REF, 10.0, True), (faster_decode, 4.0, True)], 3.0),
               record("qkv", 4096, [(REF, 100.0, True), (faster_decode, 120.0, True)], 60.0),
               record("down", 64, [(REF, 10.0, True), (faster_decode, 9.0, True)], 3.0, k=16),
               record("down", 4096, [(REF, 100.0, True), (faster_decode, 500.0, True)], 60.0, k=16)]
    s = summarize(results, {8: REF, 16: REF}, [64], 4096, decode_steps=10, train_passes=1)
    # K 8: 10 x 4 + 120 = 160 against 10 x 10 + 100 = 200; K 16: 590 against 200, so it stays the default
    assert s["per_k"][8]["tile"] == list(faster_decode)
    assert s["per_k"][16]["tile"] == list(REF) and s["per_k"][16]["projections"] == ["s/down"]
    # at 4096 rows the reference is bit-equal to K 8's new per-K tiling (both equal the reference) and faster;
    # the entry names 64 too, or the 4096 bound would take those rows; K 16's decode rows take the faster tiling
    # its per-K choice turned down
    assert s["table"] == {"bfloat16": {"8": list(faster_decode), "8,8": {"64": list(faster_decode), "4096": list(REF)},
                                       "8,16": {"64": list(faster_decode), "4096": list(REF)}}}


@pytest.mark.parametrize("references", ["one reference_tile", "reference_tiles per K"])
def test_summarize_makes_the_table_again_from_a_results_json(tmp_path, monkeypatch, references):
    fast_equal = (16, 64, 128, 4, 3)
    results = [record("qkv", 64, [(REF, 10.0, True), (fast_equal, 5.0, True)], 3.0),
               record("q", 4096, [(REF, 100.0, True), (fast_equal, 500.0, True)], 60.0, n=16)]
    measured = {"device": "NVIDIA H100 80GB HBM3", "commit": "abc1234", "results": results,
                **({"reference_tile": list(REF)} if references == "one reference_tile"
                   else {"reference_tiles": {"8": list(REF)}})}
    (tmp_path / "measured.json").write_text(json.dumps(measured))
    monkeypatch.setattr(sys, "argv", ["invariant_gemm.py", "--summarize", str(tmp_path / "measured.json"),
                                      "--decode-rows", "64", "--train-rows", "4096", "--write-table",
                                      str(tmp_path / "tiles.json"), "--out", str(tmp_path / "summary.json")])
    invariant_gemm.main()
    table = tiles.load(tmp_path / "tiles.json")[torch.bfloat16]
    assert table.per_k == {} and table.per_shape == {(8, 8): ((64, fast_equal),)}
    assert "H100" in json.loads((tmp_path / "tiles.json").read_text())["about"]
    again = json.loads((tmp_path / "summary.json").read_text())
    assert again["results"] == results and again["summary"]["table"]["bfloat16"] == {"8,8": {"64": list(fast_equal)}}

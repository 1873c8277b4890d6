"""`bench/invariant_gemm.py`'s summary from measured records: which tile parameters never changed a bit, the
tiling per K that `tiles.json` takes, and the layers' GEMM time with the current tiling, the fastest bit-equal
tiling per (N, K), the per-K one, and cuBLAS."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from invariant_gemm import summarize  # noqa: E402

REF = (64, 128, 64, 4, 3)


def record(proj, m, tiles, cublas, k=8):
    return {"shape": "s", "proj": proj, "M": m, "N": 8, "K": k, "layers": 10, "cublas_us": cublas,
            "current_us": next(us for t, us, _ in tiles if t == REF),
            "tiles": [{"tile": list(t), "us": us, "bits_equal": eq} for t, us, eq in tiles]
            + [{"tile": [128, 256, 128, 8, 3], "error": "OutOfResources"}]}


def test_summary_keeps_one_bit_equal_tiling_per_weight_and_names_harmless_parameters():
    small_m, other_k, more_warps = (16, 128, 64, 4, 3), (64, 128, 32, 4, 3), (64, 128, 64, 8, 3)
    results = [
        # qkv: a smaller BLOCK_M is faster at decode and equal bits at every M; another BLOCK_K changes the bits
        record("qkv", 64, [(REF, 10.0, True), (small_m, 4.0, True), (other_k, 1.0, False), (more_warps, 9.0, True)], 3.0),
        record("qkv", 4096, [(REF, 100.0, True), (small_m, 120.0, True), (other_k, 90.0, False),
                             (more_warps, 95.0, True)], 60.0),
        # o: the smaller BLOCK_M changes the bits at the training M, so only the current and more warps qualify
        record("o", 64, [(REF, 6.0, True), (small_m, 2.0, True), (other_k, 1.0, False), (more_warps, 5.0, True)], 2.0),
        record("o", 4096, [(REF, 50.0, True), (small_m, 40.0, False), (other_k, 30.0, False),
                           (more_warps, 55.0, True)], 30.0),
    ]
    s = summarize(results, REF, [64], 4096)
    assert s["harmless_parameters"] == {"BLOCK_M": False, "BLOCK_N": False, "BLOCK_K": False, "warps": True,
                                        "stages": False}
    decode, train = s["layer_gemm_time"]["s/decode"], s["layer_gemm_time"]["s/train"]
    # decode: qkv picks BLOCK_M 16 (4 us), o picks more warps (5 us); x 10 layers, in ms
    assert decode["current_ms"] == pytest.approx(0.16) and decode["per_nk_bit_equal_ms"] == pytest.approx(0.09)
    assert decode["cublas_ms"] == pytest.approx(0.05)
    # train: qkv's more warps (95) beats the current (100) and BLOCK_M 16 (120); o keeps the current (50)
    assert train["current_ms"] == pytest.approx(1.5) and train["per_nk_bit_equal_ms"] == pytest.approx(1.45)
    # per K (both share K 8): the least time over 256 decode steps and 6 training passes, bits or not: BLOCK_K 32
    assert s["per_k"][8]["tile"] == [64, 128, 32, 4, 3] and s["table"] == {"bfloat16": {"8": [64, 128, 32, 4, 3]}}
    assert s["per_k"][8]["step_ms"] == pytest.approx(12.32) and s["per_k"][8]["current_step_ms"] == pytest.approx(49.96)
    assert decode["per_k_ms"] == pytest.approx(0.02) and train["per_k_ms"] == pytest.approx(1.2)


def test_a_k_whose_current_tiling_is_fastest_stays_out_of_the_table():
    faster_decode = (16, 128, 64, 4, 3)
    results = [record("qkv", 64, [(REF, 10.0, True), (faster_decode, 4.0, True)], 3.0),
               record("qkv", 4096, [(REF, 100.0, True), (faster_decode, 120.0, True)], 60.0),
               record("down", 64, [(REF, 10.0, True), (faster_decode, 9.0, True)], 3.0, k=16),
               record("down", 4096, [(REF, 100.0, True), (faster_decode, 500.0, True)], 60.0, k=16)]
    s = summarize(results, REF, [64], 4096, decode_steps=10, train_passes=1)
    # K 8: 10 x 4 + 120 = 160 against 10 x 10 + 100 = 200; K 16: 590 against 200
    assert s["table"] == {"bfloat16": {"8": [16, 128, 64, 4, 3]}}
    assert s["per_k"][16]["tile"] == list(REF) and s["per_k"][16]["projections"] == ["s/down"]

"""The MoE experts' Triton kernels compiled for an H100/H200 (sm_90) on the CPU, through ptxas, as a GPU session
would: each must compile and keep its registers (no spill to local memory). The interpreter tests check their
maths; this checks what only the GPU compiler sees (layouts, register pressure), in every `make test`."""

from __future__ import annotations

import os
import subprocess
import tempfile

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hybridflow.engine.rollout import grouped_gemm  # noqa: E402

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
LAYOUT_SIGNATURE = {"ids_ptr": "*i64", "counts_ptr": "*i32", "through_ptr": "*i32", "slot_pair_ptr": "*i32",
                    "block_expert_ptr": "*i32", "num_pairs": "i32", "num_chunks": "i32", "num_blocks": "i32"}
GEMM_SIGNATURE = {"a_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "slot_pair_ptr": "*i32",
                  "block_expert_ptr": "*i32", "scale_ptr": "*bf16", "num_pairs": "i32", "n": "i32", "top_k": "i32",
                  "stride_a": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_out": "i32"}


def _resources(fn, signature: dict[str, str], constants: dict[str, object], **options) -> dict[str, int]:
    """REG, STACK, LOCAL, ... of `fn` compiled for sm_90 (cuobjdump's resource usage of the cubin)."""
    signature = {**signature, **{name: "constexpr" for name in constants}}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                            target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        dump = subprocess.run([CUOBJDUMP, "--dump-resource-usage", cubin.name], capture_output=True, text=True,
                              check=True).stdout
    line = next(line for line in dump.splitlines() if "REG:" in line)
    return {key: int(value) for key, value in (field.split(":") for field in line.split()) if value.isdigit()}


@pytest.mark.skipif(not os.path.exists(CUOBJDUMP), reason="Triton without its CUDA tools")
def test_the_moe_kernels_compile_for_sm90_without_spilling():
    for experts in (8, 128, 256):  # Mixtral, Qwen3-MoE, the most a supported model has
        count = _resources(grouped_gemm._count_kernel, {k: LAYOUT_SIGNATURE[k] for k in ("ids_ptr", "counts_ptr",
                           "num_pairs")}, dict(EXPERTS=experts, CHUNK=grouped_gemm.LAYOUT_CHUNK))
        place = _resources(grouped_gemm._place_kernel, LAYOUT_SIGNATURE, dict(
            EXPERTS=experts, CHUNK=grouped_gemm.LAYOUT_CHUNK, BLOCK_M=32, BLOCKS=128))
        assert count["STACK"] == place["STACK"] == 0, (experts, count, place)
    tiles = {key: value for key, value in grouped_gemm.TILES.items() if key not in ("num_warps", "num_stages")}
    for scale in (None, "*bf16", "*fp32"):  # no weight, Qwen's bf16 routing weights, Mixtral's fp32 ones
        signature = {**GEMM_SIGNATURE, "scale_ptr": scale or "*bf16", "out_ptr": "*fp32" if scale == "*fp32" else "*bf16"}
        constants = dict(KDIM=2048, BLOCK_M=tiles["block_m"], BLOCK_N=tiles["block_n"], BLOCK_K=tiles["block_k"],
                         SCALED=scale is not None)
        usage = _resources(grouped_gemm._grouped_kernel, signature, constants,
                           num_warps=grouped_gemm.TILES["num_warps"], num_stages=grouped_gemm.TILES["num_stages"])
        assert usage["STACK"] == 0 and usage["LOCAL"] == 0, (scale, usage)

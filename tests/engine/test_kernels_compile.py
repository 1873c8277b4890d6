"""Every Triton kernel of hybridflow compiled for an H100/H200 (sm_90) on the CPU, through ptxas, as a GPU session
would, at the shapes of the models we serve (Qwen2.5 0.5B / 1.5B / 7B, SmolLM2, Qwen3-30B-A3B): each must compile
and keep its registers (no spill to local memory). The wrappers run as the engines call them, on meta tensors
(shapes, no memory), with a stand-in driver: each launch is compiled and its resources read instead of run.
The interpreter tests (`test_kernels_interpreted.py`) check the kernels' maths; this checks what only the GPU
compiler sees (layouts, register pressure), in every `make test`."""

from __future__ import annotations

import os
import subprocess
import tempfile

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from hybridflow.engine.invariant import triton_attention, triton_gemm, triton_rows  # noqa: E402
from hybridflow.engine.rollout import decode_attention, delta_step, fp8, grouped_gemm, kernels  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
MODULES = (kernels, decode_attention, delta_step, fp8, grouped_gemm, triton_rows, triton_gemm, triton_attention)
BF16 = torch.bfloat16


class _Driver:
    """What a Triton launch asks of the active driver before it compiles."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return TARGET


def _resources(cubin: bytes) -> dict[str, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        dump = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    line = next(line for line in dump.splitlines() if "REG:" in line)
    return {key: int(value) for key, value in (field.split(":") for field in line.split()) if value.isdigit()}


@pytest.fixture
def launches(monkeypatch):
    """{(module.kernel, its constexprs, the launch's cache key): cuobjdump's resources} of every launch in the
    test, compiled for sm_90."""
    found: dict[tuple[str, str], dict[str, int]] = {}

    def compile_instead(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        options = {name: compile[name] for name in ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion")}
        source = ASTSource(fn.jit_function, compile["signature"], compile["constants"], compile["configs"][0])
        name = (f"{fn.module}.{fn.name}", str(compile["constants"]), str(key))
        if name not in found:
            found[name] = _resources(triton.compile(source, target=TARGET, options=options).asm["cubin"])
        return True  # compiled here: the launch itself is skipped

    monkeypatch.setattr(triton.runtime.driver, "_active", _Driver())
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", compile_instead)
    monkeypatch.setattr(kernels, "use_triton", lambda x: True)
    for module in MODULES:  # binders made for another target would not see this one
        for value in vars(module).values():
            if isinstance(value, JITFunction):
                monkeypatch.setattr(value, "device_caches", type(value.device_caches)(value.create_binder))
    return found


def _meta(*shape, dtype=BF16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def _rollout_launches() -> None:
    """The rollout engine's kernels as a decode step and a prefill call them."""
    for hidden, inter, heads, kv_heads, dim in ((896, 4864, 14, 2, 64), (1536, 8960, 12, 2, 128),
                                                (3584, 18944, 28, 4, 128), (2048, 768, 32, 4, 128)):
        rows, max_len, slots = 256, 4096, 8
        h = _meta(rows, hidden)
        kernels.add_rms_norm(h, h, _meta(hidden), 1e-6)
        kernels.add_rms_norm(h, None, _meta(hidden), 1e-6)
        kernels.silu_mul(_meta(rows, 2 * inter))
        for width in (hidden, inter):  # FP8 rollout: a decode step's activations, a weight sync's rows
            for count in (rows, 2 * inter):
                fp8.quantize_rows(_meta(count, width), _meta(count, width, dtype=fp8.FP8),
                                  _meta(count, dtype=torch.float32))
        cos, sin = _meta(max_len, dim, dtype=torch.float32), _meta(max_len, dim, dtype=torch.float32)
        positions = _meta(rows, dtype=torch.long)
        kernels.rotary_(_meta(rows, heads, dim), positions, cos, sin)
        cache = _meta(slots + 1, max_len, kv_heads, dim)
        qkv = _meta(rows, (heads + 2 * kv_heads) * dim)
        kernels.head_rms_norm_(qkv.view(rows, -1, dim)[:, :heads], _meta(dim), 1e-6)
        # OLMo 2's norms: scaled before their rounding, over the whole q in place
        kernels.add_rms_norm(h, h, _meta(hidden), 1e-6, round_first=False)
        kernels.head_rms_norm_(qkv[:, :heads * dim].view(rows, 1, -1), _meta(heads * dim), 1e-6, round_first=False)
        decode_attention.rotary_store_(qkv, positions, cos, sin, cache, cache, positions, heads, kv_heads)
        slot_ids, lens = _meta(rows, dtype=torch.long), _meta(rows, dtype=torch.int32)
        for splits in (1, 8):  # a full batch in one piece each, a few rows over long contexts in pieces
            decode_attention.decode_attention(_meta(rows, heads, dim), cache, cache, slot_ids, lens, 0.1, splits)
            decode_attention.rotary_decode_attention(qkv, cos, sin, cache, cache, slot_ids, lens, 0.1, splits, heads)
    _gemma3_launches()
    for vocab in (49152, 151936):
        for greedy in (True, False):
            kernels.sample_plain(_meta(256, vocab), _meta(1, dtype=torch.float32), _meta(1, dtype=torch.long),
                                 greedy)
    for hidden, inter, experts, k in ((2048, 768, 128, 8), (4096, 14336, 8, 2)):  # Qwen3-30B-A3B, Mixtral
        for tokens in (1, 256):
            x = _meta(tokens, hidden)
            weights = _meta(tokens, k, dtype=torch.float32 if experts == 8 else BF16)
            ids = _meta(tokens, k, dtype=torch.long)
            grouped_gemm.expert_mlp(x, weights, ids, _meta(experts, 2 * inter, hidden), _meta(experts, hidden, inter),
                                    kernels.silu_mul, "triton")


def _gemma3_launches() -> None:
    """Gemma 3 4B's (hidden 2560, 8 heads of 256 over 4 KV heads, a 1,024-token window): norms by 1 + weight,
    per-head q/k norms in place, and the decode kernels within the window, rotating by one layer type's columns of
    the two tables side by side."""
    hidden, heads, kv_heads, dim, rows, max_len = 2560, 8, 4, 256, 256, 4096
    h, qkv = _meta(rows, hidden), _meta(rows, (heads + 2 * kv_heads) * dim)
    kernels.add_rms_norm(h, h, _meta(hidden), 1e-6, plus_one=True)
    kernels.head_rms_norm_(qkv.view(rows, -1, dim)[:, :heads], _meta(dim), 1e-6, plus_one=True)
    cos = _meta(max_len, 2 * dim, dtype=torch.float32)[:, dim:]
    positions, cache = _meta(rows, dtype=torch.long), _meta(9, max_len, kv_heads, dim)
    decode_attention.rotary_store_(qkv, positions, cos, cos, cache, cache, positions, heads, kv_heads)
    slot_ids, lens = _meta(rows, dtype=torch.long), _meta(rows, dtype=torch.int32)
    for splits in (1, 8):
        decode_attention.decode_attention(_meta(rows, heads, dim), cache, cache, slot_ids, lens, 0.1, splits,
                                          window=1024)
        decode_attention.rotary_decode_attention(qkv, cos, cos, cache, cache, slot_ids, lens, 0.1, splits, heads, 1024)


def _hybrid_launches() -> None:
    """The Gated DeltaNet's decode step in place over slots (`delta_step`) at Qwen3.5-0.8B's heads (16 key and 16
    value heads of 128) and Qwen3-Next's (16 key heads, 32 value heads), q, k and v views of the conv's output."""
    rows = 256
    for heads, value_heads, dim in ((16, 16, 128), (16, 32, 128)):
        q, k, v = _meta(rows, (2 * heads + value_heads) * dim).split([heads * dim, heads * dim, value_heads * dim], -1)
        delta_step.step_(q.reshape(rows, heads, dim), k.reshape(rows, heads, dim), v.reshape(rows, value_heads, dim),
                         _meta(rows, value_heads, dtype=torch.float32), _meta(rows, value_heads),
                         _meta(9, value_heads, dim, dim, dtype=torch.float32), _meta(rows, dtype=torch.long),
                         _meta(rows, dtype=torch.bool), _meta(rows, dtype=torch.bool))


def _invariant_launches() -> None:
    """Exact mode's kernels as both engines call them, decode rows and a packed prefill."""
    for hidden, inter, heads, kv_heads, dim in ((576, 1536, 9, 3, 64), (896, 4864, 14, 2, 64),
                                                (1536, 8960, 12, 2, 128)):
        for rows in (64, 8192):
            x = _meta(rows, hidden)
            triton_gemm.linear(x, _meta(inter, hidden), None)
            triton_gemm.linear(_meta(rows, inter), _meta(hidden, inter), _meta(hidden))
            triton_rows.rms_norm(x, _meta(hidden), 1e-6)
            triton_rows.add_rms_norm(x, x, _meta(hidden), 1e-6)
            triton_rows.silu_mul(_meta(rows, inter), _meta(rows, inter))
            cos = _meta(rows, dim, dtype=torch.float32)
            fused = _meta(rows, heads + 2 * kv_heads, dim)
            triton_rows.rotary(fused, cos, cos, torch.empty_like(fused))
            store = _meta(rows, kv_heads, dim)
            triton_rows.rotary_store(fused, cos, cos, store, store, _meta(rows, dtype=torch.long), heads)
            starts = _meta(3, dtype=torch.int32)
            table = _meta(2, rows, dtype=torch.int32)
            triton_attention.attention(_meta(rows, heads, dim), store, store, starts, _meta(2, dtype=torch.long),
                                       _meta(2, dtype=torch.int32), 0.1, table)
    for vocab in (49152, 151936):
        triton_rows.token_log_probs(_meta(512, vocab), _meta(512, dtype=torch.long), _meta(1, dtype=torch.float32))


@pytest.mark.skipif(not os.path.exists(CUOBJDUMP), reason="Triton without its CUDA tools")
def test_every_kernel_compiles_for_sm90_without_spilling(launches):
    _rollout_launches()
    _hybrid_launches()
    _invariant_launches()
    kernels_found = {f"{module.__name__}.{name}" for module in MODULES for name, value in vars(module).items()
                     if isinstance(value, JITFunction) and name.endswith("_kernel")}
    assert kernels_found - {kernel for kernel, _, _ in launches} == set(), "kernels this test does not launch: add them"
    spills = {name: usage for name, usage in launches.items() if usage["STACK"] or usage["LOCAL"]}
    assert not spills, spills

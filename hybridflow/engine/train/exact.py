"""Exact mode in the training engine: a causal LM's forward moved onto the batch-invariant ops the rollout
engine samples with (`hybridflow.engine.invariant`), so every response token's log-prob equals, bit for bit,
the one the rollout engine reported for it (docs/exact.md).

`make_exact(model, dtype, max_len)` patches the modules of a loaded Llama / Qwen2 / Qwen3 / Mistral model in
place, as `kernels.fuse_rms_norms` does: the model keeps its class, names and parameters, so LoRA, FSDP2,
checkpoints and export are unchanged.
- The embedding's output is cast to the compute dtype `dtype` (the rollout's residual stream is in it; with
  fp32 master weights under autocast it would be fp32).
- Every RMSNorm runs `invariant.rms_norm`; the residual adds stay Hugging Face's (one rounded add each, as
  the rollout's).
- The rotary embedding returns each position's fp32 row of `invariant.rope_table`, the rollout's table.
- Each attention block projects q, k and v with one `invariant.linear` over their stacked weights, as the
  rollout's fused projection does (a LoRA layer multiplies by its merged weight W + s·B·A, `lora.merge`, the
  weight a sync sends), normalises q and k (Qwen3), rotates them, attends with `invariant.attention` over the
  packed rows and projects out.
- Each MLP runs gate and up as one `invariant.linear`, then `invariant.silu_mul` and the down projection.
- The log-prob head computes its logits and log-softmax with the invariant ops (`head.LogProbHead.exact`).
Forwards must be packed (`[1, T]` rows with `cu_seq_lens_q`); the engine packs every forward in exact mode.

Only the forward has to be invariant. A linear layer's backward is the usual pair of matmuls; RMSNorm, SwiGLU
and the rotation have closed-form backward formulas (compiled where the engine compiles: `make_exact`'s
`compile_backend`); attention recomputes the standard expression (flash varlen attention on CUDA) in the
backward and differentiates that. So gradients are the default engine's up to rounding. For the same reason gradient
checkpointing's recomputation runs the standard ops too (cuBLAS, flash attention; `recompute_contexts`, which
the engine hands `load_model`): it only refills the tensors the backward reads, which need no particular bits,
and each op saves the same tensors either way, so the checkpoint's metadata check holds.
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F

from hybridflow.engine import invariant
from hybridflow.engine.invariant.torch_ops import rotary as rotary_reference
from hybridflow.engine.train.attention import packed_attention
from hybridflow.engine.train.kernels import STANDARD_RMS_NORMS, keep_patched_forwards
from hybridflow.engine.train.lora import ADAPTER, merge
from hybridflow.engine.train.model import decoder_layers

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_recomputation = threading.local()  # autograd runs a recomputation on its own thread (CUDA's device thread)


def _standard() -> bool:
    """Whether this thread is inside gradient checkpointing's recomputation (`recompute_contexts`)."""
    return getattr(_recomputation, "active", False)


@contextlib.contextmanager
def _recomputing() -> Iterator[None]:
    _recomputation.active = True
    try:
        yield
    finally:
        _recomputation.active = False


def recompute_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """`torch.utils.checkpoint`'s `context_fn`: the forward as patched, its recomputation on the standard ops."""
    return contextlib.nullcontext(), _recomputing()


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias) if _standard() else invariant.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        flat = grad.reshape(-1, grad.shape[-1])
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w = flat.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        grad_b = flat.float().sum(0).to(grad.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


class _Recomputed(torch.autograd.Function):
    """`op(*inputs)` forward (`reference(*inputs)` in a checkpoint's recomputation); the backward is
    `gradient(*inputs, grad)` (a gradient per input, None where none is wanted) where given, else it
    differentiates `reference(*inputs)`, recomputed."""

    @staticmethod
    def forward(ctx, op: Callable, reference: Callable, gradient: Callable | None, *inputs):
        ctx.reference, ctx.gradient = reference, gradient
        ctx.save_for_backward(*inputs)
        return (reference if _standard() else op)(*inputs)

    @staticmethod
    def backward(ctx, grad):
        wants = ctx.needs_input_grad[3:]
        if ctx.gradient is not None:
            grads = ctx.gradient(*ctx.saved_tensors, grad)
            return (None, None, None, *(g if want else None for g, want in zip(grads, wants)))
        inputs = [t.detach().requires_grad_(needs) for t, needs in zip(ctx.saved_tensors, wants)]
        wanted = [t for t in inputs if t.requires_grad]
        with torch.enable_grad():
            found = iter(torch.autograd.grad(ctx.reference(*inputs), wanted, grad) if wanted else ())
        return (None, None, None, *(next(found) if t.requires_grad else None for t in inputs))


def _rms_norm_grad(h: torch.Tensor, w: torch.Tensor, grad: torch.Tensor, eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """d/dh, d/dw of `rms_norm`'s reference, w * (h * r) with r = rsqrt(mean(h^2) + eps), in fp32:
    dh = r * (g w - n * mean(g w n)) for n = h * r."""
    h32, g32 = h.float(), grad.float()
    r = torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    n = h32 * r
    gw = g32 * w.float()
    dh = r * (gw - n * (gw * n).mean(-1, keepdim=True))
    dw = (g32 * n.to(h.dtype).float()).flatten(0, -2).sum(0)
    return dh.to(h.dtype), dw.to(w.dtype)


def _silu_mul_grad(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """d/dgate, d/dup of silu(gate) * up: silu'(g) = s (1 + g (1 - s)) for s = sigmoid(g), in fp32."""
    g, go = gate.float(), grad.float()
    s = torch.sigmoid(g)
    d_up = go * (g * s).to(gate.dtype).float()
    d_gate = go * up.float() * s * (1.0 + g * (1.0 - s))
    return d_gate.to(gate.dtype), d_up.to(up.dtype)


def _rotary_grad(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, grad: torch.Tensor
                 ) -> tuple[torch.Tensor, None, None]:
    """d/dx of the rotation, which is the rotation back: `rope_table`'s rows repeat one half in the other, so
    the transpose of rotate-half times sin is rotate-half times -sin (the tables are buffers: no gradient)."""
    return invariant.rotary(grad.contiguous(), cos, -sin), None, None  # the kernel reads contiguous heads


class Gradients:
    """The backward formulas of the elementwise invariant ops, run through `torch.compile(backend=...)` (one
    fused kernel each on CUDA) or eagerly (backend None); no log-prob's bits depend on them."""

    def __init__(self, backend: str | None) -> None:
        def build(fn: Callable) -> Callable:
            return fn if backend is None else torch.compile(fn, backend=backend, dynamic=True)

        self.rms_norm, self.silu_mul = build(_rms_norm_grad), build(_silu_mul_grad)


EAGER = Gradients(None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Differentiable `invariant.linear` (operands in one dtype)."""
    return _Linear.apply(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, grads: Gradients = EAGER) -> torch.Tensor:
    """Differentiable `invariant.rms_norm`; the weight rounded to x's dtype first."""
    def reference(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h32 = h.float()
        return w * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)

    return _Recomputed.apply(lambda h, w: invariant.rms_norm(h, w, eps), reference,
                             lambda h, w, g: grads.rms_norm(h, w, g, eps), x, weight.to(x.dtype))


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Differentiable `invariant.rotary` (a new tensor)."""
    return _Recomputed.apply(invariant.rotary, rotary_reference, _rotary_grad, x, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, grads: Gradients = EAGER) -> torch.Tensor:
    """Differentiable `invariant.silu_mul`."""
    return _Recomputed.apply(invariant.silu_mul, lambda g, u: F.silu(g) * u, grads.silu_mul, gate, up)


class _PackedRows:
    """The attention layout of one packed forward (row starts and lengths, the kernel's work table), made by
    its first layer and reused by the others: they all receive the same `cu_seq_lens_q` tensor."""

    def __init__(self) -> None:
        self.cu: torch.Tensor | None = None
        self.layout: tuple = ()

    def of(self, cu: torch.Tensor, queries: int, heads: int, kv_heads: int) -> tuple:
        if cu is not self.cu:
            self.cu = cu
            self.layout = (cu[:-1].long(), cu[1:] - cu[:-1], invariant.attention_table(cu, queries, heads, kv_heads))
        return self.layout


def _weight(module: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A linear layer's weight and bias in `dtype` (a peft LoRA layer's merged weight unless its adapters are
    disabled; its parts are attributes peft sets at run time)."""
    base = getattr(module, "base_layer", module)
    weight, bias = base.weight, base.bias
    if base is not module and not module._disable_adapters:
        weight = merge(weight, module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight, module.scaling[ADAPTER],
                       dtype)
    return weight.to(dtype), None if bias is None else bias.to(dtype)


def _project(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A linear layer on x by `linear` in x's dtype."""
    return linear(x, *_weight(module, x.dtype))


def _project_fused(modules: tuple[torch.nn.Module, ...], x: torch.Tensor) -> list[torch.Tensor]:
    """`_project` of layers that read the same x (q/k/v, gate/up), one output each, as one GEMM over their stacked
    weights, as the rollout engine's fused projections do: an output column's bits do not depend on the others
    (`invariant.linear`), and one launch and one backward pair cost the host less than three. The outputs are
    views of that GEMM's columns (apart where some layers have a bias and others not)."""
    weights = [_weight(m, x.dtype) for m in modules]
    if len({b is None for _, b in weights}) > 1:
        return [linear(x, w, b) for w, b in weights]
    biases = [b for _, b in weights if b is not None]
    out = linear(x, torch.cat([w for w, _ in weights]), torch.cat(biases) if biases else None)
    return list(out.split([w.shape[0] for w, _ in weights], dim=-1))


def _attention_forward(self, hidden_states: torch.Tensor, position_embeddings: tuple | None = None,
                       attention_mask: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or hidden_states.shape[0] != 1:
        raise ValueError("exact mode's attention takes packed rows ([1, T] with cu_seq_lens_q); got "
                         f"{tuple(hidden_states.shape[:-1])} rows without them: keep actor.use_packing=true")
    if position_embeddings is None:
        raise ValueError(f"exact mode's attention rotates q and k by the (cos, sin) its decoder layer passes as "
                         f"position_embeddings; {type(self).__name__} got none")
    x = hidden_states[0]
    tokens, dim = x.shape[0], self.head_dim
    q, k, v = (t.view(tokens, -1, dim) for t in _project_fused((self.q_proj, self.k_proj, self.v_proj), x))
    v = v.contiguous()  # not a view that keeps q and k's columns alive for the backward
    if hasattr(self, "q_norm"):
        q, k = self.q_norm(q), self.k_norm(k)
    cos, sin = (t[0] for t in position_embeddings)
    q, k = rotary(q, cos, sin), rotary(k, cos, sin)
    starts, lengths, table = self.exact_rows.of(cu, tokens, q.shape[1], k.shape[1])
    out = _Recomputed.apply(lambda a, b, c: invariant.attention(a, b, c, cu, starts, lengths, self.scaling, table),
                            lambda a, b, c: packed_attention(a, b, c, cu, kwargs["max_length_q"], self.scaling),
                            None, q, k, v)
    return _project(self.o_proj, out.reshape(tokens, -1)).unsqueeze(0), None


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    gate, up = _project_fused((self.gate_proj, self.up_proj), flat)
    out = _project(self.down_proj, silu_mul(gate, up, self.exact_grads))
    return out.view(*x.shape[:-1], -1)


def _norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, self.weight, self.variance_epsilon, self.exact_grads)


def _rotary_forward(self, x: torch.Tensor, position_ids: torch.Tensor, **kwargs: Any):
    return self.exact_cos[position_ids], self.exact_sin[position_ids]


def _embedding_forward(self, input_ids: torch.Tensor) -> torch.Tensor:
    return F.embedding(input_ids, self.weight, self.padding_idx).to(self.exact_dtype)


def _patch(module: torch.nn.Module, forward: Callable[..., Any], **attributes: Any) -> None:
    """Point `module`'s forward at `forward` (bound to it), after setting the `attributes` that forward reads."""
    for name, value in attributes.items():
        setattr(module, name, value)  # torch's stubs take only tensors and modules as module attributes
    module.forward = types.MethodType(forward, module)


def make_exact(model: PreTrainedModel, dtype: torch.dtype, max_len: int, compile_backend: str | None = None) -> None:
    """Patch a causal LM (with its log-prob head installed) in place as the module docstring says; `dtype` is
    the compute dtype, `max_len` the longest row (prompt + response) its forwards will see. `compile_backend`
    (None: eager) compiles the arithmetic no log-prob's bits depend on: the elementwise ops' backward formulas
    and, with "inductor", the head's entropy and backward. Refuses a model outside `invariant.scope`, naming
    why."""
    problems = invariant.unsupported(model.config)
    if problems:
        raise ValueError(f"exact mode cannot run {type(model).__name__}: {'; '.join(problems)}")
    keep_patched_forwards(model)
    embed = model.get_input_embeddings()
    _patch(embed, _embedding_forward, exact_dtype=dtype)
    rope = model.get_decoder().rotary_emb
    cos, sin = invariant.rope_table(model.config, max_len, cast(torch.Tensor, embed.weight).device)
    rope.register_buffer("exact_cos", cos, persistent=False)
    rope.register_buffer("exact_sin", sin, persistent=False)
    _patch(rope, _rotary_forward)
    grads = EAGER if compile_backend is None else Gradients(compile_backend)
    for module in model.modules():
        if type(module).__name__ in STANDARD_RMS_NORMS and hasattr(module, "variance_epsilon"):
            _patch(module, _norm_forward, exact_grads=grads)
    rows = _PackedRows()
    for layer in decoder_layers(model):
        _patch(layer.get_submodule("self_attn"), _attention_forward, exact_rows=rows)
        _patch(layer.get_submodule("mlp"), _mlp_forward, exact_grads=grads)
    head = model.get_output_embeddings()
    head.exact, head.compiled = True, compile_backend == "inductor"

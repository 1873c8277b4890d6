"""Gated DeltaNet, the linear attention of the hybrid families (Qwen3.5, Qwen3-Next), over packed sequences with
their states.

Both engines run a Gated DeltaNet mixer here: the rollout engine's prefill and decode (each sequence's short-conv
and recurrent states kept per slot) and the training engine's packed rows (each sequence starts from zero states,
so nothing leaks across a row boundary). A mixer is any module with Hugging Face's `Qwen3_5GatedDeltaNet` parameter
names: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, `conv1d`, `A_log`, `dt_bias`, `norm` (the gated
RMSNorm) and `out_proj`, and its head counts (`num_k_heads`, `num_v_heads`, `head_k_dim`, `head_v_dim`); or
`Qwen3NextGatedDeltaNet`'s, whose four input projections are two, `in_proj_qkvz` and `in_proj_ba`, with their
outputs grouped by key head (`ungroup`). The mixers compute the same once their inputs are in Qwen3.5's order.

Kernels: on CUDA with flash-linear-attention installed (the `linear` extra), its chunked gated delta rule and causal
conv1d over `cu_seqlens` (one launch for all sequences) and its fused recurrent step; elsewhere (CPU, or CUDA without
fla) transformers' own torch reference functions of the Qwen3.5 model (`torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule`), one sequence at a time, and the depthwise conv as `F.conv1d` per sequence.

States: conv [N, C, W] holds each sequence's last W inputs of the conv (C = 2 * key dim + value dim, W the kernel
width; fla's layout), recurrent [N, HV, K, V] fp32 (HV value heads of K x V).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F


@functools.cache
def _fla_installed() -> bool:
    try:
        import fla  # noqa: F401
    except ImportError:
        return False
    return True


def uses_fla(x: torch.Tensor) -> bool:
    """Whether fla's Triton kernels run for `x` (on CUDA, fla installed)."""
    return x.is_cuda and _fla_installed()


def _torch_reference():
    """transformers' torch gated delta rule, chunked and recurrent (the functions its Qwen3.5 runs on CPU)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

    return qwen3_5.torch_chunk_gated_delta_rule, qwen3_5.torch_recurrent_gated_delta_rule


def short_conv(x: torch.Tensor, weight: torch.Tensor, cu: torch.Tensor, initial: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(causal depthwise conv) of the sequences packed in x [T, C] by cu ([N + 1] starts), each continuing from
    its conv state `initial` [N, C, W] (None: zeros) -> (y [T, C], final conv states [N, C, W])."""
    width = weight.shape[-1]
    if uses_fla(x):
        from fla.modules.causal_conv1d import causal_conv1d

        y, final = causal_conv1d(x[None], weight, initial_state=initial, output_final_state=True, activation="silu",
                                 cu_seqlens=cu.long())
        return y[0], final
    bounds = cu.tolist()
    outs, finals = [], []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        state = x.new_zeros(x.shape[1], width) if initial is None else initial[i].to(x.dtype)
        window = torch.cat([state, x[start:end].T], dim=1)  # [C, W + L]: the state's inputs, then the sequence's
        y = F.conv1d(window[None].to(weight.dtype), weight[:, None], groups=x.shape[1])[0, :, 1:]
        outs.append(F.silu(y).T.to(x.dtype))
        finals.append(window[:, -width:])
    return torch.cat(outs), torch.stack(finals)


def conv_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One new input per sequence: x [B, C], conv states [B, C, W] -> (silu(conv) [B, C], new states [B, C, W])."""
    window = torch.cat([state[:, :, 1:], x[:, :, None].to(state.dtype)], dim=2)
    y = (window.to(weight.dtype) * weight[None]).sum(-1)
    return F.silu(y).to(x.dtype), window


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               cu: torch.Tensor, initial: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule (q and k L2-normalised, queries scaled by K^-0.5) over packed sequences: q, k [T, H, K],
    v [T, HV, V], g (log decay), beta [T, HV], cu [N + 1], initial [N, HV, K, V] or None ->
    (o [T, HV, V] in v's dtype, final states [N, HV, K, V] fp32)."""
    if uses_fla(q):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        o, final = chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], initial_state=initial,
                                          output_final_state=True, use_qk_l2norm_in_kernel=True,
                                          cu_seqlens=cu.long())
        return o[0], final
    chunked, _ = _torch_reference()
    bounds = cu.tolist()
    outs, finals = [], []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        part = slice(start, end)
        o, final = chunked(q[None, part], k[None, part], v[None, part], g=g[None, part], beta=beta[None, part],
                           initial_state=None if initial is None else initial[i:i + 1], output_final_state=True,
                           use_qk_l2norm_in_kernel=True)
        outs.append(o[0])
        finals.append(final[0])
    return torch.cat(outs), torch.stack(finals)


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: q, k [B, H, K], v [B, HV, V], g, beta [B, HV], states [B, HV, K, V] ->
    (o [B, HV, V], new states [B, HV, K, V] fp32)."""
    if uses_fla(q):
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as recurrent
    else:
        recurrent = _torch_reference()[1]
    o, final = recurrent(q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None], initial_state=state,
                         output_final_state=True, use_qk_l2norm_in_kernel=True)
    return o[:, 0], final


def ungroup(mixer: Any, qkvz: torch.Tensor, ba: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Qwen3-Next's fused projections in Qwen3.5's order. Its `in_proj_qkvz` output [T, 2 * key dim + 2 * value dim]
    holds, per key head, that head's q, its k, then the v and the z of the value heads that share it; `in_proj_ba`
    [T, 2 * HV] holds, per key head, its value heads' b then their a -> (conv input [T, C] as q | k | v over all heads,
    z [T, HV * V], b [T, HV], a [T, HV])."""
    tokens, groups = qkvz.shape[0], mixer.num_k_heads
    shared = mixer.num_v_heads // groups * mixer.head_v_dim  # the v (and z) width of one key head's value heads
    q, k, v, z = qkvz.view(tokens, groups, -1).split([mixer.head_k_dim, mixer.head_k_dim, shared, shared], dim=-1)
    b, a = ba.view(tokens, groups, -1).chunk(2, dim=-1)
    conv_in = torch.cat([part.reshape(tokens, -1) for part in (q, k, v)], dim=-1)
    return conv_in, z.reshape(tokens, -1), b.reshape(tokens, -1), a.reshape(tokens, -1)


def mixer_inputs(mixer: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mixer's projections of x [T, D]: (conv input [T, C], output gate z [T, HV * V], beta [T, HV],
    g [T, HV] the log decay, fp32)."""
    if hasattr(mixer, "in_proj_qkvz"):  # Qwen3-Next's fused projections
        conv_in, z, b, a = ungroup(mixer, mixer.in_proj_qkvz(x), mixer.in_proj_ba(x))
    else:
        conv_in, z, b, a = mixer.in_proj_qkv(x), mixer.in_proj_z(x), mixer.in_proj_b(x), mixer.in_proj_a(x)
    # fp32 before exp: in half precision -exp(A_log) may overflow (transformers does the same)
    g = -mixer.A_log.float().exp() * F.softplus(a.float() + mixer.dt_bias)
    return conv_in, z, b.sigmoid(), g


def split_heads(mixer: Any, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv output [T, C] as q, k [T, H, K] and v [T, HV, V]."""
    key_dim = mixer.num_k_heads * mixer.head_k_dim
    q, k, v = conv_out.split([key_dim, key_dim, mixer.num_v_heads * mixer.head_v_dim], dim=-1)
    tokens = conv_out.shape[0]
    return (q.reshape(tokens, -1, mixer.head_k_dim), k.reshape(tokens, -1, mixer.head_k_dim),
            v.reshape(tokens, -1, mixer.head_v_dim))


def mixer_output(mixer: Any, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The gated RMSNorm of the delta rule's output o [T, HV, V] by z, then `out_proj` -> [T, D]."""
    tokens = o.shape[0]
    normed = mixer.norm(o.reshape(-1, mixer.head_v_dim), z.reshape(-1, mixer.head_v_dim))
    return mixer.out_proj(normed.reshape(tokens, -1))


def packed_mixer(mixer: Any, x: torch.Tensor, cu: torch.Tensor, conv_initial: torch.Tensor | None = None,
                 initial: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Gated DeltaNet mixer over the sequences packed in x [T, D] by cu ([N + 1] starts), each from its conv and
    recurrent states (None: zeros, a sequence's start) -> (out [T, D], final conv states, final recurrent states)."""
    conv_in, z, beta, g = mixer_inputs(mixer, x)
    conv_out, conv_final = short_conv(conv_in, mixer.conv1d.weight[:, 0], cu, conv_initial)
    q, k, v = split_heads(mixer, conv_out)
    o, final = delta_rule(q, k, v, g, beta, cu, initial)
    return mixer_output(mixer, o, z), conv_final, final


def state_shapes(config: Any) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """One sequence's states in one linear layer of a hybrid text config: conv (C, W) and recurrent (HV, K, V)."""
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    channels = 2 * key_dim + config.linear_num_value_heads * config.linear_value_head_dim
    return ((channels, config.linear_conv_kernel_dim),
            (config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim))

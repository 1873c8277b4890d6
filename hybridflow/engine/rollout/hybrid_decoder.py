"""The hybrid decoder layers of Qwen3.5 (`qwen3_5_text`) and Qwen3-Next (`qwen3_next`): Gated DeltaNet linear
attention in most layers, gated full attention in every `full_attention_interval`-th, as HF's `Qwen3_5DecoderLayer`
and `Qwen3NextDecoderLayer` lay them out (`config.layer_types`). The two families differ in two places: Qwen3-Next
fuses the linear layers' four input projections into two whose outputs are grouped by key head (`in_proj_qkvz`,
`in_proj_ba`, loaded as the checkpoint holds them and put in Qwen3.5's order by `linear_attention.ungroup`), and its
MLP is a mixture of experts with a gated shared expert in its sparse layers (`mlp.layer_mlp`: `sparse_moe`, with
routing capture).

- `GatedDeltaNet` (HF's `linear_attn`): the mixer of `engine.linear_attention`, its conv and recurrent states per
  slot in the engine's `StateCache` (`recurrent_state.py`). Prefill runs each packed sequence chunked from its
  starting states (zeros for a new prompt, the slot's for a continuation) and writes the final states to every slot
  its K/V go to (a prompt's n samples); decode runs one recurrent step per row, in place, folding the token in only
  for live rows (`AttnMeta.live`).
- `GatedAttention` (HF's `self_attn`): q_proj gives each head's query and an output gate side by side, q and k are
  RMS-normalised per head, the leading `partial_rotary_factor` of each head is rotated, and the attention output is
  scaled by sigmoid(gate) before `o_proj`. K/V, prefill and decode attention are `attention.py`'s.
- Its RMSNorms scale by (1 + weight) in fp32 and round once, as Gemma 3's (`model.family_norm`: weights stored
  zero-centred).

The full-attention layers index the cache's K/V by their rank among full-attention layers, the linear ones its
states by theirs. The torch path serves everywhere; rotary and gates are not fused (no exact mode, no FP8).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridflow.engine import linear_attention as la
from hybridflow.engine.rollout import delta_step
from hybridflow.engine.rollout.attention import AttnMeta, cache_attention, prefill_attention, write_kv
from hybridflow.engine.rollout.kernels import rotary_
from hybridflow.engine.rollout.kv_cache import KVCache
from hybridflow.engine.rollout.linear import FusedLinear, Linear
from hybridflow.engine.rollout.mlp import layer_mlp
from hybridflow.engine.rollout.model import family_norm
from hybridflow.engine.rollout.recurrent_state import StateCache
from hybridflow.engine.rollout.rope import rotary_dim


class GatedRMSNorm(nn.Module):
    """HF's `Qwen3_5RMSNormGated` (and Qwen3-Next's): weight * (x / rms(x)) rounded to x's dtype, times silu(gate)
    in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * h * torch.nn.functional.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """The linear-attention mixer with HF's parameter names (`engine.linear_attention`), over the cache's states."""

    def __init__(self, config, state_index: int) -> None:
        super().__init__()
        if config.hidden_act != "silu":  # the conv's activation is the config's, and ours is silu's
            raise ValueError(f"hidden_act={config.hidden_act!r}: the fast path's linear-attention conv is silu's")
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        if self.num_v_heads % self.num_k_heads:  # each key head serves a whole group of value heads
            raise ValueError(f"linear_num_value_heads={self.num_v_heads} is not a multiple of "
                             f"linear_num_key_heads={self.num_k_heads}")
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        key_dim, value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        channels, hidden = 2 * key_dim + value_dim, config.hidden_size
        self.state_index = state_index
        if config.model_type == "qwen3_next":  # grouped by key head as the checkpoint holds them (`la.ungroup`)
            self.in_proj_qkvz = Linear(hidden, channels + value_dim, False, False)
            self.in_proj_ba = Linear(hidden, 2 * self.num_v_heads, False, False)
        else:
            self.in_proj_qkv = Linear(hidden, channels, False, False)
            self.in_proj_z = Linear(hidden, value_dim, False, False)
            self.in_proj_b = Linear(hidden, self.num_v_heads, False, False)
            self.in_proj_a = Linear(hidden, self.num_v_heads, False, False)
        self.conv1d = nn.Conv1d(channels, channels, config.linear_conv_kernel_dim, groups=channels, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = Linear(value_dim, hidden, False, False)

    def forward(self, x: torch.Tensor, meta: AttnMeta, cache: StateCache) -> torch.Tensor:
        conv, recurrent, lengths = cache.states(self.state_index)
        if meta.reads_cache and meta.max_seqlen_q == 1 and meta.write_rows is None:
            return self.decode(x, meta, conv, recurrent, lengths)
        return self.prefill(x, meta, conv, recurrent, lengths, cache.max_len)

    def decode(self, x: torch.Tensor, meta: AttnMeta, conv: torch.Tensor, recurrent: torch.Tensor,
               lengths: torch.Tensor) -> torch.Tensor:
        """One token per row, from and into its slot's states; device ops only (captured in the decode graphs)."""
        slots = meta.slots
        assert slots is not None  # a meta over the cache names its rows' slots
        # a first token (a one-token prompt attending over the cache) starts from zero states, not the slot's
        fresh = (meta.context_lens == 1) if meta.context_lens is not None else torch.zeros_like(slots, dtype=torch.bool)
        conv_in, z, beta, g = la.mixer_inputs(self, x)
        conv_before = conv[slots].masked_fill(fresh[:, None, None], 0)
        conv_out, conv_after = la.conv_step(conv_in, self.conv1d.weight[:, 0], conv_before)
        q, k, v = la.split_heads(self, conv_out)
        live = meta.live if meta.live is not None else torch.ones_like(slots, dtype=torch.bool)
        o = delta_step.step_(q, k, v, g, beta, recurrent, slots, fresh, live)
        conv[slots] = torch.where(live[:, None, None], conv_after.to(conv.dtype), conv[slots])
        if self.state_index == 0:  # the slots' lengths are the sequences', one count for all layers
            lengths[slots] = torch.where(live, meta.context_lens.long() if meta.context_lens is not None
                                         else lengths[slots] + 1, lengths[slots])
        return la.mixer_output(self, o, z)

    def prefill(self, x: torch.Tensor, meta: AttnMeta, conv: torch.Tensor, recurrent: torch.Tensor,
                lengths: torch.Tensor, max_len: int) -> torch.Tensor:
        """Packed sequences, each from zero states (a new prompt) or its slot's (a continuation over the cache); the
        final states go to every slot a sequence's last token is written to."""
        conv_initial: torch.Tensor | None = None
        initial: torch.Tensor | None = None
        if meta.reads_cache:
            cu, slots = meta.cu_seqlens_q, meta.slots
            assert cu is not None and slots is not None and meta.context_lens is not None
            starts = meta.context_lens.long() - cu.diff().long()
            if self.state_index == 0:
                behind = (starts > 0) & (lengths[slots] != starts)
                if bool(behind.any()):
                    row = int(behind.nonzero()[0, 0])
                    raise ValueError(f"slot {int(slots[row])}'s linear-attention states hold "
                                     f"{int(lengths[slots[row]])} tokens, but its continuation starts at token "
                                     f"{int(starts[row])}: a recurrent state cannot go back to an earlier token (a "
                                     f"sequence cut short by `shorten`), so it cannot be continued")
            carried = (starts > 0)[:, None, None]
            conv_initial = torch.where(carried, conv[slots], 0)
            initial = torch.where(carried[..., None], recurrent[slots], 0)
        else:
            cu = meta.cu_seqlens
            assert cu is not None
        out, conv_final, final = la.packed_mixer(self, x, cu, conv_initial, initial)
        # each write of a sequence's last token names a slot the sequence's states go to
        write_rows = meta.write_rows if meta.write_rows is not None else torch.arange(len(meta.write_index),
                                                                                       device=x.device)
        last = torch.isin(write_rows, cu[1:].long() - 1)
        sequence = torch.searchsorted(cu[1:].long(), write_rows[last], right=True)
        targets = meta.write_index[last] // max_len
        conv[targets] = conv_final[sequence].to(conv.dtype)
        recurrent[targets] = final[sequence]
        if self.state_index == 0:
            lengths[targets] = meta.write_index[last] % max_len + 1
        return out


class GatedAttention(nn.Module):
    """The hybrid families' full attention: per-head output gates, per-head q/k norms (1 + weight), partial rotary."""

    def __init__(self, config, kv_index: int, backend: str) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, \
            config.head_dim
        self.kv_index, self.backend, self.scale = kv_index, backend, self.head_dim ** -0.5
        bias = bool(getattr(config, "attention_bias", False))
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        # q_proj's rows are per head [query | gate], kept as HF lays them out
        self.qkv_proj = FusedLinear(config.hidden_size, {"q": 2 * q_size, "k": kv_size, "v": kv_size}, bias, False)
        self.o_proj = Linear(q_size, config.hidden_size, bias, False)
        self.q_norm = family_norm(self.head_dim, config, False)
        self.k_norm = family_norm(self.head_dim, config, False)
        self.splits = [2 * q_size, kv_size, kv_size]
        self.rotary_dim = rotary_dim(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttnMeta, kv: KVCache) -> torch.Tensor:
        tokens = x.shape[0]
        q_gate, k, v = self.qkv_proj(x).split(self.splits, dim=-1)
        q, gate = q_gate.view(tokens, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)[0]
        k = self.k_norm(k.view(tokens, self.kv_heads, self.head_dim))[0]
        v = v.reshape(tokens, self.kv_heads, self.head_dim)
        rotary_(q[..., :self.rotary_dim], positions, *rope)
        rotary_(k[..., :self.rotary_dim], positions, *rope)
        k_cache, v_cache = kv.layer(self.kv_index)
        write_kv(k_cache, v_cache, k, v, meta)
        if meta.reads_cache:
            out = cache_attention(q, k_cache, v_cache, meta, self.scale, self.backend)
        else:
            out = prefill_attention(q, k, v, meta, self.scale, self.backend)
        return self.o_proj((out * torch.sigmoid(gate)).reshape(tokens, -1))


class HybridDecoderLayer(nn.Module):
    """A pre-norm hybrid layer: `linear_attn` or `self_attn` by `config.layer_types`, then the MLP (Qwen3-Next's
    sparse layers: a `SparseMoE` block)."""

    def __init__(self, config, layer_index: int, backend: str, moe_kernel: str = "grouped_mm") -> None:
        super().__init__()
        if backend == "exact":
            raise ValueError(f"exact mode has no path for the hybrid linear-attention family ({config.model_type})")
        kinds = config.layer_types
        self.input_layernorm = family_norm(config.hidden_size, config, False)
        self.post_attention_layernorm = family_norm(config.hidden_size, config, False)
        self.mlp = layer_mlp(config, layer_index, False, moe_kernel)
        rank = sum(kind == kinds[layer_index] for kind in kinds[:layer_index])
        self.linear = kinds[layer_index] == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(config, rank)
        elif kinds[layer_index] == "full_attention":
            self.self_attn = GatedAttention(config, rank, backend)
        else:
            raise ValueError(f"layer_types[{layer_index}]={kinds[layer_index]!r} is invalid; valid: "
                             f"'linear_attention', 'full_attention'")

    def forward(self, h: torch.Tensor, delta: torch.Tensor | None, positions: torch.Tensor | None, rope,
                meta: AttnMeta, kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream h and the previous layer's pending output delta -> (h, this layer's output)."""
        x, h = self.input_layernorm(h, delta)
        if self.linear:
            assert isinstance(kv, StateCache)  # a hybrid model's engine makes one (`hybrid_cache`)
            mixed = self.linear_attn(x, meta, kv)
        else:
            mixed = self.self_attn(x, positions, rope, meta, kv)
        x, h = self.post_attention_layernorm(h, mixed)
        return h, self.mlp(x, meta)


def hybrid_cache(config, max_len: int, max_num_seqs: int, budget_bytes: int | None, dtype: torch.dtype,
                 device: torch.device) -> StateCache:
    """The K/V of the config's full-attention layers and the states of its linear ones."""
    kinds = config.layer_types
    return StateCache(kinds.count("full_attention"), kinds.count("linear_attention"), config.num_key_value_heads,
                      config.head_dim, *la.state_shapes(config), max_len, max_num_seqs, budget_bytes, dtype, device)

"""One fast decoder for the Llama, Qwen2, Qwen3, Mistral, OLMo 2, Phi-3, Gemma 3 and hybrid (Qwen3.5, Qwen3-Next)
families and the mixtures of experts (Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE, Qwen3-Next), with HF parameter names.

The differences between the families are config flags: Qwen2 has a q/k/v bias, Qwen3 RMS-normalises q
and k per head, OLMoE and OLMo 2 over the whole q and k projections, OLMo 2 normalises each block's output
instead of its input (`post_norm.PostNormDecoderLayer`), Phi-3 may rotate only part of each head, Gemma 3 mixes
sliding-window and global layers with norms on both sides of each block (`gemma3`), Llama may have
`attention_bias` / `mlp_bias`, Mistral is Llama's shape; a mixture of experts has its family's attention and a
`sparse_moe.SparseMoE` block in place of the MLP of its sparse layers. q/k/v are fused into `qkv_proj` and gate/up
into `gate_up_proj` (`linear`). Checkpoint loading and the trainer -> rollout sync (`load_weights`) share one path
that takes HF names (`...self_attn.q_proj.weight`) and copies in place: a module's `weight_loader(param, tensor,
shard)` serves its parameters (the fused ones place a shard at its offset, or take the whole: Phi-3 stores
`qkv_proj` and `gate_up_proj` fused in our order), others take `default_weight_loader`.

Rotary tables come from `transformers`' own rotary embedding for the config (rope_theta, llama3 and
other rope_scaling types, Phi-3's partial rotation; `rope`), precomputed for all positions. Norms, rotary and
silu-and-mul are the fused kernels of `kernels` on CUDA; the residual add is fused into the following norm. The
forward takes packed tokens: input_ids [T], positions [T] and an `AttnMeta`, and returns logits (model dtype) for
the rows named by `logits_index` (the last token of each prompt in prefill; every row in decode).

With the "exact" backend (`rollout.exact`) every op is the training engine's: the GEMMs, residual adds,
norms, rotary, activation and attention of `hybridflow.engine.invariant`, the rotary table of
`invariant.rope_table`, and every forward (prefill, continuation or decode) writes its K/V to the cache
first and attends over the cache (docs/exact.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from hybridflow.engine import invariant
from hybridflow.engine.rollout.attention import (AttnMeta, cache_attention, decodes_in_triton, exact_attention,
                                                 prefill_attention, rotary_decode_attention, write_kv)
from hybridflow.engine.rollout.decode_attention import rotary_store_, supported
from hybridflow.engine.rollout.kernels import add_rms_norm, head_rms_norm_, rotary_, use_triton
from hybridflow.engine.rollout.kv_cache import KVCache
from hybridflow.engine.rollout.linear import FusedLinear, Linear, Shard, default_weight_loader
from hybridflow.engine.rollout.mlp import layer_mlp
from hybridflow.engine.rollout.rope import rope_columns, rotary_dim, rotary_table
from hybridflow.engine.rollout.scope import layer_window
from hybridflow.engine.rollout.sparse_moe import SparseMoE, expert_target
from hybridflow.utils.moe_spec import MOE_ARCHITECTURES

HYBRID_ARCHITECTURES = ("qwen3_5_text", "qwen3_next")  # linear and full attention layers (`hybrid_decoder`)
FAST_ARCHITECTURES = tuple(dict.fromkeys(("llama", "qwen2", "qwen3", "mistral", "olmo2", "phi3", "gemma3_text",
                                          *MOE_ARCHITECTURES, *HYBRID_ARCHITECTURES)))  # Qwen3-Next: in both

# HF name piece -> (our fused parameter's name piece, shard id)
_FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
          "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}


def weight_target(name: str) -> tuple[str, Shard]:
    """The fast model's (parameter name, shard) for a Hugging Face weight name: `model.` prefixed when missing,
    q/k/v and gate/up into their fused parameters, experts stacked (`sparse_moe.expert_target`)."""
    if not name.startswith(("model.", "lm_head.")):
        name = "model." + name
    expert = expert_target(name)
    if expert is not None:
        return expert
    for piece, (fused, shard_id) in _FUSED.items():
        if f".{piece}." in name:
            return name.replace(f".{piece}.", f".{fused}."), shard_id
    return name, None


class RMSNorm(nn.Module):
    """HF's RMSNorm (normalise in fp32, cast back, then scale), optionally fused with the residual add
    (exact: the invariant add and norm, in one kernel where `build` found its bits the same as apart)."""

    def __init__(self, dim: int, eps: float, exact: bool, round_first: bool = True, plus_one: bool = False) -> None:
        """round_first, plus_one: see `kernels.add_rms_norm` (OLMo 2's, Gemma 3's; families exact mode refuses)."""
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps, self.exact, self.fused_add, self.round_first = eps, exact, False, round_first
        self.plus_one = plus_one

    def forward(self, h: torch.Tensor, delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(h + delta), h + delta); delta None normalises h."""
        if not self.exact:
            return add_rms_norm(h, delta, self.weight, self.eps, self.round_first, self.plus_one)
        if delta is not None and self.fused_add:
            return invariant.add_rms_norm(h, delta, self.weight, self.eps)
        h = h if delta is None else h + delta
        return invariant.rms_norm(h, self.weight, self.eps), h


def family_norm(dim: int, config, exact: bool) -> RMSNorm:
    """The family's RMSNorm of rows of `dim`: OLMo 2's scales before it rounds, Gemma 3's and the hybrid families'
    by 1 + weight, the others' round the normalised row before their scale."""
    kind, plus_one = config.model_type, config.model_type in ("gemma3_text", *HYBRID_ARCHITECTURES)
    return RMSNorm(dim, config.rms_norm_eps, exact, kind != "olmo2" and not plus_one, plus_one)


class Attention(nn.Module):
    def __init__(self, config, layer_index: int, backend: str) -> None:
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.layer_index, self.backend = layer_index, backend  # Gemma 3 scales by its query_pre_attn_scalar
        self.scale = (getattr(config, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        self.window = layer_window(config, layer_index)  # a sliding-window layer's (Gemma 3's local layers)
        self.rope_columns = rope_columns(config, layer_index)  # its rotary table's columns, where there are several
        exact = backend == "exact"
        qkv_bias = (getattr(config, "qkv_bias", True) if config.model_type == "qwen2_moe"
                    else config.model_type == "qwen2")
        bias = qkv_bias or bool(getattr(config, "attention_bias", False))
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv_proj = FusedLinear(config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias, exact)
        o_bias = config.model_type not in ("qwen2", "qwen2_moe") and bool(getattr(config, "attention_bias", False))
        self.o_proj = Linear(q_size, config.hidden_size, o_bias, exact)
        # q/k norms: Qwen3's, Gemma 3's per head, OLMoE's, OLMo 2's over the whole projection; OLMoE clamps after them
        self.clip = getattr(config, "clip_qkv", None) if config.model_type == "olmoe" else None
        self.qk_norm_width = {"qwen3": self.head_dim, "qwen3_moe": self.head_dim, "olmoe": 0,
                              "olmo2": 0, "gemma3_text": self.head_dim}.get(config.model_type)
        if self.qk_norm_width is not None:
            self.q_norm = family_norm(self.qk_norm_width or q_size, config, exact)
            self.k_norm = family_norm(self.qk_norm_width or kv_size, config, exact)
        self.splits = [q_size, kv_size, kv_size]
        self.rotary_dim = rotary_dim(config)  # Phi-3's `partial_rotary_factor` rotates the heads' leading part

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttnMeta, kv: KVCache) -> torch.Tensor:
        tokens, (q_size, kv_size, _) = x.shape[0], self.splits
        qkv = self.qkv_proj(x)
        v = qkv[:, q_size + kv_size:].view(tokens, self.kv_heads, self.head_dim)
        if self.backend == "exact":
            return self.o_proj(self.exact_attention(qkv, v, rope, meta, kv).reshape(tokens, -1))
        fused = self.store_fused(qkv, positions, meta)
        if self.rope_columns is not None:  # this layer's table of several side by side (Gemma 3's local and global)
            rope = (rope[0][..., self.rope_columns], rope[1][..., self.rope_columns])
        # q and k heads are adjacent in qkv: normed (per head, or over the whole q and k) and rotated there, in place
        qk = qkv[:, :q_size + kv_size].view(tokens, self.heads + self.kv_heads, self.head_dim)
        q, k = qk[:, :self.heads], qk[:, self.heads:]
        if self.qk_norm_width is not None:
            for part, norm in ((qkv[:, :q_size], self.q_norm), (qkv[:, q_size:q_size + kv_size], self.k_norm)):
                head_rms_norm_(part.view(tokens, -1, norm.weight.shape[0]), norm.weight, norm.eps, norm.round_first,
                               norm.plus_one)
        if self.clip is not None:  # OLMoE clamps q, k and v after the norms
            qkv.clamp_(-self.clip, self.clip)
        if not fused:
            rotary_(qk[..., :self.rotary_dim], positions, *rope)
        k_cache, v_cache = kv.layer(self.layer_index)
        if fused and decodes_in_triton(meta, self.backend, self.head_dim):
            out = rotary_decode_attention(qkv, rope, k_cache, v_cache, meta, self.heads, self.scale, self.window)
        else:
            if fused:  # rotates q and k in place too
                assert positions is not None  # store_fused holds only with positions
                rotary_store_(qkv, positions, *rope, k_cache, v_cache, meta.write_index, self.heads, self.kv_heads)
            else:
                write_kv(k_cache, v_cache, k, v, meta)
            if meta.reads_cache:
                out = cache_attention(q, k_cache, v_cache, meta, self.scale, self.backend, self.window)
            else:
                out = prefill_attention(q, k, v, meta, self.scale, self.backend, self.window)
        return self.o_proj(out.reshape(tokens, -1))

    def exact_attention(self, qkv: torch.Tensor, v: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                        meta: AttnMeta, kv: KVCache) -> torch.Tensor:
        """The exact backend's attention half (the training engine's arithmetic: `train.exact`): q/k norms,
        rotary by the tokens' fp32 table rows `rope`, the K/V written to the cache, then the invariant
        attention of the queries over their slots. -> [T, H, D]."""
        tokens, (q_size, kv_size, _) = qkv.shape[0], self.splits
        q = qkv[:, :q_size].view(tokens, self.heads, self.head_dim)
        k = qkv[:, q_size:q_size + kv_size].view(tokens, self.kv_heads, self.head_dim)
        k_cache, v_cache = kv.layer(self.layer_index)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q)[0], self.k_norm(k)[0]
        elif meta.write_rows is None:  # q, k and v heads are adjacent in qkv: one launch rotates and stores them
            invariant.rotary_store(qkv.view(tokens, -1, self.head_dim), *rope, k_cache.view(-1, *k_cache.shape[2:]),
                                   v_cache.view(-1, *v_cache.shape[2:]), meta.write_index, self.heads)
            return exact_attention(q, k_cache, v_cache, meta, self.scale)
        invariant.rotary(q, *rope, out=q)
        invariant.rotary(k, *rope, out=k)
        write_kv(k_cache, v_cache, k, v, meta)
        return exact_attention(q, k_cache, v_cache, meta, self.scale)

    def store_fused(self, qkv: torch.Tensor, positions: torch.Tensor | None, meta: AttnMeta) -> bool:
        """Whether one kernel rotates q and k and writes k and v to the cache (CUDA with Triton, each token
        written once, a power-of-two head dimension, rotated whole); else rotary and `write_kv` run apart."""
        return (positions is not None and meta.write_rows is None and use_triton(qkv) and supported(self.head_dim)
                and self.rotary_dim == self.head_dim)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_index: int, backend: str, moe_kernel: str = "grouped_mm") -> None:
        super().__init__()
        exact = backend == "exact"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, exact)
        self.self_attn = Attention(config, layer_index, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, exact)
        self.mlp = layer_mlp(config, layer_index, exact, moe_kernel)

    def forward(self, h: torch.Tensor, delta: torch.Tensor | None, positions: torch.Tensor | None, rope,
                meta: AttnMeta, kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream h and the previous layer's pending output delta -> (h, this layer's output);
        the residual add is fused into the next norm."""
        x, h = self.input_layernorm(h, delta)
        x, h = self.post_attention_layernorm(h, self.self_attn(x, positions, rope, meta, kv))
        return h, self.mlp(x, meta)


class DecoderModel(nn.Module):
    def __init__(self, config, backend: str, moe_kernel: str = "grouped_mm") -> None:
        # these build on this module's pieces
        from hybridflow.engine.rollout.gemma3 import Gemma3DecoderLayer, ScaledEmbedding
        from hybridflow.engine.rollout.hybrid_decoder import HybridDecoderLayer
        from hybridflow.engine.rollout.post_norm import PostNormDecoderLayer

        super().__init__()
        gemma, hybrid = config.model_type == "gemma3_text", config.model_type in HYBRID_ARCHITECTURES
        self.embed_tokens = (ScaledEmbedding if gemma else nn.Embedding)(config.vocab_size, config.hidden_size)
        layer = {"olmo2": PostNormDecoderLayer, "gemma3_text": Gemma3DecoderLayer}.get(
            config.model_type, HybridDecoderLayer if hybrid else DecoderLayer)
        self.layers = nn.ModuleList(layer(config, i, backend, moe_kernel) for i in range(config.num_hidden_layers))
        self.norm = family_norm(config.hidden_size, config, backend == "exact")


class CausalLM(nn.Module):
    """The fast decoder; `CausalLM.build(config, max_len, device, dtype)` makes one with empty weights."""

    cos: torch.Tensor  # the rotary tables, buffers registered by `set_rotary`
    sin: torch.Tensor

    def __init__(self, config, backend: str, moe_kernel: str = "grouped_mm") -> None:
        super().__init__()
        if config.model_type not in FAST_ARCHITECTURES:
            raise ValueError(f"model_type {config.model_type!r} has no fast path; fast: {FAST_ARCHITECTURES}")
        if backend == "exact" and invariant.unsupported(config):
            raise ValueError(f"exact mode cannot run this model: {'; '.join(invariant.unsupported(config))}")
        self.config, self.exact = config, backend == "exact"
        self.shared: set[str] = set()  # parameters that are someone else's tensors (`build`)
        self.model = DecoderModel(config, backend, moe_kernel)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, self.exact)
        self.tie()

    def tie(self) -> None:
        """Share the embedding as the output projection when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def build(cls, config, max_len: int, device: torch.device, dtype: torch.dtype, backend: str,
              moe_kernel: str = "auto", shared: dict[str, torch.Tensor] | None = None,
              fp8: bool = False) -> CausalLM:
        """moe_kernel: the experts' grouped GEMMs (`grouped_gemm.KERNELS`; auto: `resolve_kernel`). shared:
        weights by parameter name held by someone else (a colocated trainer's frozen ones): a parameter of the
        same name, shape, dtype and device becomes that very tensor instead of memory of its own (`shared`).
        fp8: the decoder layers' projections keep FP8 weights (`fp8.quantize_layers`)."""
        from hybridflow.engine.rollout import fp8 as fp8_weights
        from hybridflow.engine.rollout.grouped_gemm import resolve_kernel

        with torch.device("meta"):
            model = cls(config, backend, resolve_kernel(moe_kernel, device, dtype)).to(dtype)
        if fp8:
            fp8_weights.quantize_layers(model)
        for name, param in list(model.named_parameters()):
            owner_name, leaf = name.rsplit(".", 1)
            given = (shared or {}).get(name)
            if given is not None and (given.shape, given.dtype, given.device) == (param.shape, dtype, device):
                data = given.detach()
                model.shared.add(name)
            else:
                data = torch.empty(param.shape, dtype=param.dtype, device=device)  # dtype, or FP8 weights' own
            model.get_submodule(owner_name)._parameters[leaf] = nn.Parameter(data, requires_grad=False)
        model.tie()  # new parameters: the head points at the embedding again
        model.set_rotary(max_len)
        fused_add = model.exact and invariant.add_rms_norm_holds(dtype, config.hidden_size, device)
        for norm in (m for m in model.modules() if isinstance(m, RMSNorm)):
            norm.fused_add = fused_add
        return model

    def kv_cache(self, max_len: int, max_num_seqs: int, budget_bytes: int | None) -> KVCache:
        """The engine's cache for this model, on its device and in its dtype: K/V for every layer, or a hybrid
        model's K/V and recurrent states (`hybrid_decoder.hybrid_cache`)."""
        weight = self.lm_head.weight
        if self.config.model_type in HYBRID_ARCHITECTURES:
            from hybridflow.engine.rollout.hybrid_decoder import hybrid_cache

            return hybrid_cache(self.config, max_len, max_num_seqs, budget_bytes, weight.dtype, weight.device)
        attn = cast(DecoderLayer, self.model.layers[0]).self_attn  # nn.ModuleList's items are typed nn.Module
        return KVCache(self.config.num_hidden_layers, attn.kv_heads, attn.head_dim, max_len, max_num_seqs,
                       budget_bytes, weight.dtype, weight.device)

    def set_rotary(self, max_len: int) -> None:
        """Precompute cos/sin [max_len, rotary dim] (fp32) with HF's rotary embedding for this config
        (`rope.rotary_table`; exact: the table the training engine gathers from too, `invariant.rope_table`)."""
        device = self.lm_head.weight.device
        if self.exact:
            cos, sin = invariant.rope_table(self.config, max_len, device)
        else:
            cos, sin = rotary_table(self.config, max_len, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMeta, kv: KVCache,
                logits_index: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids/positions [T] -> logits [R, V] for rows `logits_index` (all T when None)."""
        h, delta = self.hidden(input_ids, positions, meta, kv)
        if logits_index is not None:
            h, delta = h[logits_index], None if delta is None else delta[logits_index]
        return self.logits(h, delta)

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMeta,
               kv: KVCache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The last layer's output [T, H] and the residual add it leaves to the final norm (None: none)."""
        h, delta = self.model.embed_tokens(input_ids), None
        rope = (self.cos, self.sin)
        layer_positions: torch.Tensor | None = positions  # None: rope is already gathered per token
        if self.exact:  # each token's fp32 rows, as the training engine gathers them
            rope, layer_positions = (self.cos[positions], self.sin[positions]), None
        elif not use_triton(h):  # the torch rotary gathers once per forward, not per layer
            rope, layer_positions = (self.cos[positions].to(h.dtype), self.sin[positions].to(h.dtype)), None
        for layer in self.model.layers:
            h, delta = layer(h, delta, layer_positions, rope, meta, kv)
        return h, delta

    def logits(self, h: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """`hidden`'s rows -> logits [R, V] in the model's dtype."""
        logits = self.lm_head(self.model.norm(h, delta)[0])
        cap = getattr(self.config, "final_logit_softcapping", None)  # Gemma's, in the logits' dtype as transformers
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def moe_blocks(self) -> list[SparseMoE]:
        """The sparse layers' MoE blocks, in layer order (empty for a dense model)."""
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoE)]

    def expected_weights(self) -> set[tuple[str, Shard]]:
        """(parameter, shard) pairs a full checkpoint must provide (a tied lm_head is not needed)."""
        expected: set[tuple[str, Shard]] = set()
        for name, _ in self.named_parameters():
            owner_name, leaf = name.rsplit(".", 1)
            shard_ids = getattr(self.get_submodule(owner_name), "shard_ids", None)
            shards = shard_ids(leaf) if shard_ids is not None else [None]
            expected.update((name, shard) for shard in shards)
        return expected

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, Shard]]:
        """Copy HF-named tensors into the parameters in place; returns the (parameter, shard) per tensor.

        Names may carry HF's `model.` prefix or not (`layers.0...` as in the inner model's state dict);
        `lm_head.weight` is accepted whether or not the embeddings are tied; experts load stacked or one
        tensor per expert (`sparse_moe.expert_target`). Tensors on another device or dtype are converted by
        `copy_`; DTensors are gathered first. An unknown name raises KeyError; a shared weight, ValueError.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded = []
        for name, tensor in named_tensors:
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            target, shard = weight_target(name)
            if target in self.shared:
                raise ValueError(f"cannot load {name!r}: {target} is a colocated trainer's frozen weight, shared with "
                                 f"this engine, not a copy")
            param = params.get(target)
            if param is None:
                import difflib

                close = difflib.get_close_matches(target, params, n=3)
                raise KeyError(f"unknown parameter {name!r} for the fast {self.config.model_type} model; "
                               f"closest: {close}")
            try:
                owner = self.get_submodule(target.rsplit(".", 1)[0])
                getattr(owner, "weight_loader", default_weight_loader)(param, tensor.detach(), shard)
            except ValueError as err:
                raise ValueError(f"cannot load {name!r}: {err}") from None
            loaded.append((target, shard))
        return loaded

    def covered(self, loaded: list[tuple[str, Shard]]) -> set[tuple[str, Shard]]:
        """The `expected_weights` pieces that `load_weights`' (parameter, shard) results filled (a stacked
        experts tensor fills every expert's pieces)."""
        out: set[tuple[str, Shard]] = set()
        for name, shard in loaded:
            owner_name, leaf = name.rsplit(".", 1)
            owner = self.get_submodule(owner_name)
            covers, shard_ids = getattr(owner, "covers", None), getattr(owner, "shard_ids", None)
            if covers is not None:
                pieces = covers(leaf, shard)
            elif shard is None and shard_ids is not None:  # a fused parameter loaded whole (Phi-3's checkpoints)
                pieces = shard_ids(leaf)
            else:
                pieces = [shard]
            out.update((name, s) for s in pieces)
        return out

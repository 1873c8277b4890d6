"""A vision-language model's language model on the fast engine, holding the transformers model's own weights: the
decode half of `VisionRolloutEngine`.

Qwen2.5-VL's language model is Qwen2's decoder (q/k/v biases) and Qwen3-VL's is Qwen3's (per-head q/k norms); what
makes them multimodal is the input (image features in place of the image tokens, Qwen3-VL's DeepStack features added
at those positions) and the rotary positions. `get_rope_index` gives an image's tokens temporal / height / width
positions, and every token after the prompt has all three components at `its index + the prompt's rope delta`. With
the three equal, the mrope sections (Qwen2.5-VL's contiguous, Qwen3-VL's interleaved) all rotate by one position, so
a generated token's rotation is the text family's plain rope at that position: the same `inv_freq` from the same
`rope_theta`. Once the prompt's K/V are in the cache (prefilled by the transformers modules with the 3-D positions),
decoding is the text family's decode with each row's rotary position shifted by its prompt's delta
(`RunningBatch.rope_offsets`), while its cache position stays its index.

Qwen3.5's language model (`qwen3_5`) is its hybrid text model (`hybrid_decoder.py`: Gated DeltaNet layers beside gated
full attention with partial rotary over interleaved mrope sections). Its full-attention layers take K/V as Qwen3-VL's;
its linear layers keep no K/V but a conv window and a recurrent state per sequence, the state after the prompt's last
token, which the hand-off copies into the slots of the prompt's samples beside the K/V (`write_states`). Its rotary
table reads the mrope sections itself (a text token's three components equal), so they stay in its text config.

Gemma 3's language model is Gemma 3's text model (`gemma3.py`: sliding-window and global layers, scaled embedding);
its image tokens take plain 1-D positions, so decoding is the text family's decode with no shift. The image tokens'
bidirectional attention is the prefill's alone (their K/V come computed); decoded tokens attend causally, within
the window on the sliding layers, as transformers' decode does.

SmolVLM's (and Idefics3's) language model is Llama's decoder (SmolLM2's, Llama 3's), kept under `model.text_model.`;
its image tokens take plain 1-D positions too, so decoding is Llama's decode with no shift.

- `text_config`: the VLM's text config as its family's (`qwen2` / `qwen3` / `gemma3_text` / `qwen3_5_text` /
  `llama`), for `CausalLM.build`.
- `SharedWeights`: one copy of the language model's weights. The fast model holds the transformers model's own
  tensors for what it does not fuse (embeddings, norms, o_proj, down_proj, the head); the transformers model's q/k/v
  and gate/up projections become views into the fast model's fused `qkv_proj` / `gate_up_proj`. A weight update
  copied into the transformers model in place is the fast model's too. A move of the weights (sleep with offload,
  wake) gives tensors new storage: `views_into_fast` and `fast_holds_hf` make them one again.
- `write_prompts`: the prompts' K/V from transformers' cache (left-padded rows) into the fast engine's slots, and a
  hybrid model's linear-attention states (`write_states`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridflow.engine.rollout.attention import pick_backend
from hybridflow.engine.rollout.kv_cache import KVCache
from hybridflow.engine.rollout.linear import FusedLinear, Shard
from hybridflow.engine.rollout.model import CausalLM, weight_target
from hybridflow.engine.rollout.recurrent_state import StateCache
from hybridflow.engine.rollout.scope import model_problems
from hybridflow.utils.lm_class import language_model_name

# the vision-language family -> the transformers config class of its language model's text family, and the
# text-config fields that family reads differently or not at all. Qwen's: the mrope sections (decode rotates all
# three components by one position) and Qwen2.5-VL's sliding-window fields (unused by its checkpoints:
# `use_sliding_window` false), left at the text family's defaults. Gemma 3's, Qwen3.5's and SmolVLM's text configs are
# their text families' own: Gemma 3's layer types and sliding window stay, Qwen3.5's layer types (linear and full),
# and SmolVLM's (Idefics3's) Llama.
_COMMON = ("model_type", "architectures", "transformers_version", "_name_or_path", "dtype")
_TEXT_FAMILY = {"qwen2_5_vl": ("Qwen2Config", _COMMON + ("layer_types", "sliding_window", "use_sliding_window",
                                                         "max_window_layers")),
                "qwen3_vl": ("Qwen3Config", _COMMON + ("layer_types", "sliding_window", "use_sliding_window",
                                                       "max_window_layers")),
                "gemma3": ("Gemma3TextConfig", _COMMON), "qwen3_5": ("Qwen3_5TextConfig", _COMMON),
                "smolvlm": ("LlamaConfig", _COMMON), "idefics3": ("LlamaConfig", _COMMON)}
# the families whose text family reads the mrope sections itself (Qwen3.5's rotary table: `rope.rotary_table`)
_KEEPS_MROPE = ("qwen3_5",)


def text_config(config: Any, tied: bool) -> Any:
    """A vision-language config's language model as its text family's config (Qwen2 / Qwen3 / Gemma 3 text / Qwen3.5
    text / Llama: the fast decoder's families); tied: whether the model's head is its embedding (the VLM config or its text config may say
    so)."""
    import transformers

    if config.model_type not in _TEXT_FAMILY:
        raise ValueError(f"model_type {config.model_type!r} has no fast language model; vision families: "
                         f"{sorted(_TEXT_FAMILY)}")
    family, dropped = _TEXT_FAMILY[config.model_type]
    fields = {k: v for k, v in config.get_text_config().to_dict().items() if k not in dropped}
    fields["tie_word_embeddings"] = tied
    rope = dict(fields.get("rope_parameters") or {})
    if config.model_type not in _KEEPS_MROPE:
        for key in ("mrope_section", "mrope_interleaved"):
            rope.pop(key, None)
    fields["rope_parameters"] = rope
    return getattr(transformers, family)(**fields)


class SharedWeights:
    """The language model's parameters of a transformers VLM and of the fast `CausalLM` made from them (`build`),
    one copy between them (see the module docstring)."""

    def __init__(self, hf_model: nn.Module, fast: CausalLM) -> None:
        self.fast = fast
        # (transformers parameter, fast parameter name, shard) for the language model and head, the tower left out
        self.pairs: list[tuple[nn.Parameter, str, Shard]] = []
        for name, param in language_model_parameters(hf_model):
            target, shard = weight_target(name)
            self.pairs.append((param, target, shard))

    @classmethod
    def build(cls, hf_model: nn.Module, max_len: int) -> SharedWeights:
        """A fast model of the VLM's language model holding its weights, rotary tables for `max_len` positions."""
        named = language_model_parameters(hf_model)
        config = text_config(hf_model.config, tied="lm_head.weight" not in dict(named))  # a tied head is listed once
        problems = model_problems(config)
        if getattr(config, "final_logit_softcapping", None):  # the fast model caps where its text config says so
            problems.append(f"final_logit_softcapping={config.final_logit_softcapping} is set in the text config, "
                            f"which {type(hf_model).__name__}'s forward and the trainer's log-prob head do not apply")
        if problems:  # the vision engine has no transformers.generate path to fall back to
            raise ValueError(f"the vision-language model's language model ({config.model_type}) is not served by the "
                             f"fast decode: {'; '.join(problems)}")
        weight = dict(named)["model.embed_tokens.weight"]
        device, dtype = weight.device, weight.dtype
        shared = {weight_target(name)[0]: p.data for name, p in named if weight_target(name)[1] is None}
        fast = CausalLM.build(config, max_len, device, dtype, pick_backend(device, dtype), shared=shared)
        loaded = fast.load_weights((name, p.data) for name, p in named if weight_target(name)[0] not in fast.shared)
        missing = fast.expected_weights() - fast.covered(loaded + [(name, None) for name in fast.shared])
        if missing:
            raise ValueError(f"the vision-language model's language model lacks {len(missing)} tensors the fast "
                             f"model needs, e.g. {sorted(str(m) for m in missing)[:4]}")
        weights = cls(hf_model, fast)
        weights.views_into_fast()
        return weights

    def views_into_fast(self) -> None:
        """The transformers model's q/k/v and gate/up parameters become views of the fast model's fused ones (where
        their values are: loaded there, or moved there by the fast engine)."""
        params = dict(self.fast.named_parameters(remove_duplicate=False))
        for param, target, shard in self.pairs:
            if shard is not None:
                owner = self.fast.get_submodule(target.rsplit(".", 1)[0])
                assert isinstance(owner, FusedLinear) and isinstance(shard, str)
                start, size = owner.offsets[shard]
                param.data = params[target].data[start:start + size]

    def fast_holds_hf(self) -> None:
        """The fast model's unfused parameters become the transformers model's tensors again (after it moved them)."""
        params = dict(self.fast.named_parameters(remove_duplicate=False))
        for param, target, shard in self.pairs:
            if shard is None:
                params[target].data = param.data


def language_model_parameters(hf_model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name as the text model names it, parameter) for a VLM's language model and head (a tied head once, as the
    embeddings)."""
    out = []
    for name, param in hf_model.named_parameters():
        text_name = language_model_name(name)
        if text_name is not None:
            out.append((text_name, param))
    return out


def write_prompts(kv: KVCache, cache: Any, lengths: list[int], slots: list[list[int]]) -> None:
    """Prompt b's K/V, the last `lengths[b]` positions of row b of transformers' left-padded cache (per layer
    [B, kv_heads, width, head_dim], rotated by the prompt's 3-D positions as the model computed them), to positions
    [0, lengths[b]) of each of its `slots[b]`; a hybrid model's linear-attention states too (`write_states`)."""
    # transformers' linear-attention cache layers hold states, not K/V (their own class in each 5.x release)
    linear = [layer for layer in cache.layers if getattr(layer, "recurrent_states", None) is not None]
    layers = [layer for layer in cache.layers if getattr(layer, "recurrent_states", None) is None]
    if linear:
        write_states(kv, linear, lengths, slots)
    width, device = layers[0].keys.shape[2], layers[0].keys.device
    short = [i for i, layer in enumerate(layers) if layer.keys.shape[2] != width]
    if short:  # e.g. a sliding-window layer of a cache built from the config: it keeps only the window
        raise ValueError(f"transformers' cache keeps {layers[short[0]].keys.shape[2]} positions in layer {short[0]} "
                         f"and {width} in layer 0; the prefill must keep every position in every layer")
    rows, columns, index = [], [], []
    for b, (length, mine) in enumerate(zip(lengths, slots)):
        steps = torch.arange(length)
        rows.append(torch.full((len(mine) * length,), b))
        columns.append((width - length + steps).repeat(len(mine)))
        index.append((torch.tensor(mine)[:, None] * kv.max_len + steps[None, :]).reshape(-1))
    row, column, target = (torch.cat(t).to(device) for t in (rows, columns, index))
    for i, layer in enumerate(layers):
        k_cache, v_cache = kv.layer(i)
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, target, layer.keys[row, :, column])
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, target, layer.values[row, :, column])


def write_states(kv: KVCache, layers: list[Any], lengths: list[int], slots: list[list[int]]) -> None:
    """Each Gated DeltaNet layer's conv and recurrent states after prompt b's last token (row b of transformers'
    linear-attention cache `layers`, in order) to each of its `slots[b]`, which then count `lengths[b]` tokens.

    The rows were left-padded: transformers zeroes a padding position's input to its linear layers
    (`apply_mask_to_padding_states`), and from zero states a zero input leaves the conv window and the recurrent
    state zero (its key and value are zero), so a row's states are its prompt's alone."""
    if not isinstance(kv, StateCache):
        raise ValueError(f"transformers' cache holds {len(layers)} linear-attention layers, but the fast engine's "
                         f"cache ({type(kv).__name__}) holds no states: its text config is not a hybrid one")
    if len(layers) != kv.linear_layers:
        raise ValueError(f"transformers' cache holds {len(layers)} linear-attention layers, the fast engine's "
                         f"{kv.linear_layers}")
    counts = kv.states(0)[2]  # tokens each slot's states have taken in, one count for all layers
    device = counts.device
    row = torch.tensor([b for b, mine in enumerate(slots) for _ in mine], device=device)
    target = torch.tensor([slot for mine in slots for slot in mine], device=device)
    for i, layer in enumerate(layers):
        conv, recurrent, _ = kv.states(i)
        conv[target] = layer.conv_states[0][row].to(conv.dtype)
        recurrent[target] = layer.recurrent_states[0][row].float()
    counts[target] = torch.tensor(lengths, device=device)[row]

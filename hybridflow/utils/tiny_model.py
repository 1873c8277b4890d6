"""Tiny, offline Hugging Face models and tokenizers of real architectures.

Tests, the demo and CPU benchmarks need a model directory that `AutoModelForCausalLM.from_pretrained`
and `AutoTokenizer.from_pretrained` load with no network. This module builds one: a byte-level BPE
tokenizer made with the `tokenizers` library (optionally with merges learnt from task text, plus chat
special tokens and a ChatML-style chat template), and a randomly initialised Qwen2 / Llama / Qwen3 /
Mistral / OLMo 2 / Phi-3 / Gemma 3 (text) / Qwen3.5 (`qwen3_5_text`: hybrid linear attention; `qwen3_5`: the same
language model in the published checkpoints' layout, a vision tower beside it) model, a mixture of
experts (Qwen3-MoE, Mixtral, Qwen2-MoE with its shared expert, OLMoE; Qwen3-Next: hybrid linear attention too), or a
GPT-2 (a family with no fast rollout path), of a chosen size, saved as a normal Hugging Face directory (experts saved
one tensor per expert, as on the hub).

    python -m hybridflow.utils.tiny_model /tmp/tiny --arch qwen2 --hidden 64 --layers 2
    python -m hybridflow.utils.tiny_model /tmp/tiny_moe --arch qwen3_moe --experts 8 --experts-per-token 2
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

PAD, BOS, EOS = "<|pad|>", "<|im_start|>", "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
SPECIAL_TOKENS = [PAD, ENDOFTEXT, BOS, EOS]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

ARCHITECTURES = ("qwen2", "llama", "qwen3", "mistral", "qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "olmo2", "phi3",
                 "gemma3_text", "qwen3_5_text", "qwen3_5", "qwen3_next", "gpt2")


def moe_kwargs(arch: str, experts: int, experts_per_token: int, expert_intermediate: int) -> dict:
    """The config keywords of a mixture of experts of `arch` (empty for a dense one), with the routing of
    the real models: Qwen3-30B-A3B renormalises its top-k weights, Qwen1.5-MoE (Qwen2-MoE) does not and
    has a shared expert 4x an expert's width, Qwen3-Next-80B-A3B renormalises and has a shared expert of an expert's
    width (its first layer dense here, `mlp_only_layers`, so that both kinds of MLP run), Mixtral always renormalises,
    OLMoE-1B-7B does not."""
    if arch == "olmoe":
        return dict(num_experts=experts, num_experts_per_tok=experts_per_token,
                    intermediate_size=expert_intermediate, norm_topk_prob=False)
    if arch == "mixtral":
        return dict(num_local_experts=experts, num_experts_per_tok=experts_per_token,
                    intermediate_size=expert_intermediate)
    if arch in ("qwen3_moe", "qwen2_moe", "qwen3_next"):
        out: dict[str, Any] = dict(num_experts=experts, num_experts_per_tok=experts_per_token,
                                   moe_intermediate_size=expert_intermediate, norm_topk_prob=arch != "qwen2_moe")
        if arch == "qwen2_moe":
            out["shared_expert_intermediate_size"] = 4 * expert_intermediate
        if arch == "qwen3_next":
            out.update(shared_expert_intermediate_size=expert_intermediate, mlp_only_layers=[0])
        return out
    return {}


def gemma3_kwargs(layers: int, head_dim: int) -> dict:
    """Gemma 3's attention at a debug size: sliding-window and global layers alternating (the real models have five
    sliding layers to one global), an 8-token window so short generations outgrow it, the real models' rotary bases
    (the global one with Gemma 3 4B's linear scaling) and their query_pre_attn_scalar of one head's width."""
    return dict(sliding_window=8, query_pre_attn_scalar=head_dim,
                layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                 "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}})


def build_tokenizer(train_texts: list[str] | None = None, vocab_size: int = 300):
    """A byte-level BPE `PreTrainedTokenizerFast`, the same kind as Qwen2's and Llama 3's.

    Ids 0-3 are the special tokens (`<|pad|>`, `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`), then the
    256 byte symbols, so any text encodes. With `train_texts`, BPE merges are learnt from them up to
    `vocab_size` tokens; without, there are no merges (one token per byte). `<|im_end|>` is the
    end-of-sequence token (as in Qwen chat models) and `<|pad|>` the padding token.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    byte_symbols = pre_tokenizers.ByteLevel.alphabet()
    core = Tokenizer(models.BPE(unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=max(vocab_size, len(byte_symbols) + len(SPECIAL_TOKENS)),
                                  special_tokens=SPECIAL_TOKENS, initial_alphabet=byte_symbols,
                                  show_progress=False)
    core.train_from_iterator(train_texts or [], trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=ENDOFTEXT,
        additional_special_tokens=[BOS, ENDOFTEXT],
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.padding_side = "left"
    return tok


def tiny_config(arch: str, vocab_size: int, hidden: int = 64, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, intermediate: int | None = None, max_positions: int = 512,
                pad_token_id: int = 0, eos_token_id: int = 3, tie_word_embeddings: bool = True,
                experts: int = 4, experts_per_token: int = 2, expert_intermediate: int | None = None,
                head_dim: int | None = None):
    """A `transformers` config of the named architecture at a debug size; the MoE architectures get
    `experts` experts of width `expert_intermediate` (default hidden / 2), `experts_per_token` per token.
    head_dim: Qwen3's per-head width (default hidden / heads)."""
    from transformers import AutoConfig

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; valid: {', '.join(ARCHITECTURES)}")
    if arch == "qwen3_5":  # as published: the text model's config nested, a (tiny) vision tower beside it
        text = tiny_config("qwen3_5_text", vocab_size, hidden, layers, heads, kv_heads, intermediate, max_positions,
                           pad_token_id, eos_token_id, tie_word_embeddings, head_dim=head_dim)
        return AutoConfig.for_model("qwen3_5", text_config=text.to_dict(), tie_word_embeddings=tie_word_embeddings,
                                    vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                       out_hidden_size=hidden, num_position_embeddings=64))
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate or hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=1e-6,
    )
    if arch in ("qwen3", "qwen3_moe", "gemma3_text", "qwen3_5_text", "qwen3_next"):
        kwargs["head_dim"] = head_dim or hidden // heads
    if arch == "gemma3_text":
        kwargs.update(gemma3_kwargs(layers, head_dim or hidden // heads))
    if arch in ("qwen3_5_text", "qwen3_next"):  # linear attention with twice the value heads as key heads (which
        # Qwen3-Next's projections group by key head), every 4th layer full (the last one, with fewer than 4 layers)
        every = min(4, layers)
        kwargs.update(linear_num_key_heads=kv_heads, linear_num_value_heads=2 * kv_heads,
                      linear_key_head_dim=hidden // heads, linear_value_head_dim=hidden // heads,
                      layer_types=["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                   for i in range(layers)])
    kwargs.update(moe_kwargs(arch, experts, experts_per_token, expert_intermediate or hidden // 2))
    return AutoConfig.for_model(arch, **kwargs)


def build_tiny_model(path: str | Path, arch: str = "qwen2", hidden: int = 64, layers: int = 2,
                     heads: int = 4, kv_heads: int = 2, intermediate: int | None = None,
                     max_positions: int = 512, seed: int = 0, train_texts: list[str] | None = None,
                     vocab_size: int = 300, tie_word_embeddings: bool = True, model_vocab_size: int | None = None,
                     dtype: torch.dtype = torch.float32, device: str = "cpu", experts: int = 4,
                     experts_per_token: int = 2, expert_intermediate: int | None = None,
                     head_dim: int | None = None) -> Path:
    """Save a random model + tokenizer + generation config under `path` and return it (`experts`,
    `experts_per_token`, `expert_intermediate`: the MoE architectures' routing, and `head_dim`: see `tiny_config`).

    `model_vocab_size`: the model's vocabulary when it should be larger than the tokenizer's (Qwen2.5 has
    151,936 rows for 151,665 tokens; benchmarks use it to get a real vocabulary's head on a small
    tokenizer). `dtype` / `device`: where the weights are initialised (a GPU builds billion-parameter
    shapes in seconds)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, GenerationConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(train_texts, vocab_size)
    pad_id, eos_id = tok.convert_tokens_to_ids(PAD), tok.convert_tokens_to_ids(EOS)
    if model_vocab_size is not None and model_vocab_size < len(tok):
        raise ValueError(f"model_vocab_size={model_vocab_size} is below the tokenizer's {len(tok)} tokens")
    config = tiny_config(arch, model_vocab_size or len(tok), hidden, layers, heads, kv_heads, intermediate,
                         max_positions, pad_id, eos_id, tie_word_embeddings, experts, experts_per_token,
                         expert_intermediate, head_dim)
    devices = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        auto = AutoModelForImageTextToText if arch == "qwen3_5" else AutoModelForCausalLM
        model = auto.from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig(eos_token_id=[eos_id], pad_token_id=pad_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--arch", default="qwen2", choices=ARCHITECTURES)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--experts-per-token", type=int, default=2)
    args = parser.parse_args()
    print(build_tiny_model(args.path, args.arch, args.hidden, args.layers, args.heads, args.kv_heads,
                           seed=args.seed, experts=args.experts, experts_per_token=args.experts_per_token))


if __name__ == "__main__":
    main()

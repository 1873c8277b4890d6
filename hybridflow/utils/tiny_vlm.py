"""A tiny, offline vision-language model directory of a real architecture at a debug size, with random weights:
Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`: window-attention vision tower, patch merger, multimodal rotary
positions), Qwen3-VL (`Qwen3VLForConditionalGeneration`: 16-pixel patches, learned position embeddings in the
tower, DeepStack features added to the first language layers, interleaved multimodal rotary sections, q/k norms) or
Gemma 3 (`Gemma3ForConditionalGeneration`: a SigLIP tower over 32 x 32 images of 8-pixel patches, pooled to 4
soft tokens an image by the multimodal projector; Gemma 3's text model with a sliding layer of an 8-token window and
a global one, `tiny_model.gemma3_kwargs`) or Qwen3.5 as published (`Qwen3_5ForConditionalGeneration`: Qwen3-VL's
tower without DeepStack beside the hybrid Gated DeltaNet text model of `tiny_model`, three linear layers and a full
one, interleaved multimodal rotary sections over half of each head) or SmolVLM (`SmolVLMForConditionalGeneration`, or
its parent Idefics3's: a SigLIP tower over 32 x 32 tiles of 8-pixel patches, pixel-shuffled into 4 tokens a tile by
the connector, beside Llama's language model).

Tests need a vision-language model that loads with no network. The directory holds the model, a byte-level
tokenizer (`tiny_model.build_tokenizer`) with Qwen's vision tokens added (`<|vision_start|>`, `<|image_pad|>`,
`<|vision_end|>`; `hybridflow.data.image_prompts` puts them where a prompt says `<image>`), and Qwen2-VL's image
processor (both families use it; Qwen3-VL's with 16-pixel patches) with a small pixel range (so a test image is a
few dozen patches). Gemma 3's directory has its image tokens instead (`<start_of_image>`, `<image_soft_token>`,
`<end_of_image>`) and Gemma 3's image processor at the tower's 32 x 32. transformers initialises Gemma 3's projector
to zeros and its (1 + weight) norms to ones; they are drawn at random here so images and norms change the outputs.
SmolVLM's has its image tokens (`<fake_token_around_image>`, `<image>`, `<global-img>`, `<row_r_col_c>`) and its image
processor cutting an image into up to 3 x 3 tiles of the tower's 32 x 32 (it resizes the longest side to 96) beside
the whole image.

    python -m hybridflow.utils.tiny_vlm /tmp/tiny_vl [--family qwen3_vl]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hybridflow.utils.lm_class import VISION_FAMILIES
from hybridflow.utils.tiny_model import BOS, EOS, PAD, build_tokenizer, gemma3_kwargs, tiny_config

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
GEMMA3_TOKENS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")
GEMMA3_SIDE, GEMMA3_PATCH, GEMMA3_IMAGE_TOKENS = 32, 8, 4  # 4 x 4 patches pooled 2 x 2 into 4 soft tokens
# SmolVLM's: the processor's names for them, and a row / column mark per tile of up to 6 x 6 (the released vocabulary)
SMOLVLM_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>",
                  *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)))
SMOLVLM_SIDE, SMOLVLM_PATCH, SMOLVLM_LONGEST = 32, 8, 96  # 4 x 4 patches shuffled 2 x 2 into 4 tokens a tile
SMOLVLM_FAMILIES = ("smolvlm", "idefics3")
# each family's patch side in pixels; a merged token covers 2 x 2 patches
PATCH = {"qwen2_5_vl": 14, "qwen3_vl": 16, "qwen3_5": 16}
# the smallest / largest image after the processor's resize, in merged tokens: 4 to 64
MIN_TOKENS, MAX_TOKENS = 4, 64


def max_pixels(family: str = "qwen2_5_vl") -> int:
    """The tiny image processor's pixel limit for `family` (64 merged tokens of 2 x 2 patches)."""
    return (2 * PATCH[family]) ** 2 * MAX_TOKENS


def _config(family: str, text: dict, vision_hidden: int, vision_depth: int, hidden: int, tokens: dict):
    """The family's config: `text` the language model's sizes, `tokens` the vision token ids."""
    from transformers import Qwen2_5_VLConfig, Qwen3_5Config, Qwen3VLConfig

    vision = dict(depth=vision_depth, hidden_size=vision_hidden, intermediate_size=vision_hidden * 2, num_heads=2,
                  out_hidden_size=hidden)
    head_dim = hidden // text["num_attention_heads"]
    if family == "qwen2_5_vl":  # t/h/w rotary split 16/24/24 of 128, as released; the last tower block attends fully
        section = [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
        return Qwen2_5_VLConfig(text_config={**text, "rope_parameters": rope},
                                vision_config={**vision, "fullatt_block_indexes": [vision_depth - 1], "window_size": 56},
                                tie_word_embeddings=True, **tokens)
    if family == "qwen3_5":
        # the hybrid text model of `tiny_model`, at least 4 layers so that three linear ones precede a full one (the
        # released pattern); half of each head rotated (the released quarter of 16 would leave the height and width
        # sections empty), interleaved sections 2/1/1 of its 4 frequencies (the released 11/11/10 of 32)
        fields = tiny_config("qwen3_5_text", text["vocab_size"], hidden, max(4, text["num_hidden_layers"]),
                             text["num_attention_heads"], text["num_key_value_heads"],
                             pad_token_id=text["pad_token_id"], eos_token_id=text["eos_token_id"]).to_dict()
        fields["rope_parameters"] = {**fields["rope_parameters"], "partial_rotary_factor": 0.5,
                                     "mrope_section": [head_dim // 8, head_dim // 16, head_dim // 16],
                                     "mrope_interleaved": True}
        fields["initializer_range"] = text["initializer_range"]
        return Qwen3_5Config(text_config=fields, vision_config={**vision, "patch_size": PATCH[family],
                                                                "num_position_embeddings": 64},
                             tie_word_embeddings=True, **tokens)
    # Qwen3-VL: 24/20/20 of 128 interleaved, DeepStack features from the first tower block, 8 x 8 learned positions
    side = 5 * head_dim // 32
    section = [head_dim // 2 - 2 * side, side, side]
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section, "mrope_interleaved": True}
    return Qwen3VLConfig(text_config={**text, "head_dim": head_dim, "rope_parameters": rope},
                         vision_config={**vision, "patch_size": PATCH[family], "deepstack_visual_indexes": [0],
                                        "num_position_embeddings": 64},
                         tie_word_embeddings=True, **tokens)


def _gemma3_config(text: dict, vision_hidden: int, vision_depth: int, heads: int, tokens: dict):
    """Gemma 3's config: `text` the language model's sizes, `tokens` the image token ids."""
    from transformers import Gemma3Config

    head_dim = text["hidden_size"] // heads
    # Qwen's 0.2 initialisation, times the embedding's sqrt(hidden) scale, fixes a random Gemma 3 on one token
    text = {**text, "head_dim": head_dim, "hidden_activation": "gelu_pytorch_tanh", "initializer_range": 0.02,
            **gemma3_kwargs(text["num_hidden_layers"], head_dim)}
    vision = dict(hidden_size=vision_hidden, intermediate_size=vision_hidden * 2, num_hidden_layers=vision_depth,
                  num_attention_heads=2, image_size=GEMMA3_SIDE, patch_size=GEMMA3_PATCH)
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=GEMMA3_IMAGE_TOKENS,
                        tie_word_embeddings=True, initializer_range=0.02, **tokens)


def _smolvlm_config(family: str, text: dict, vision_hidden: int, vision_depth: int, image_token: int):
    """SmolVLM's or Idefics3's config: `text` the Llama language model's sizes."""
    from transformers import Idefics3Config, SmolVLMConfig

    vision = dict(hidden_size=vision_hidden, intermediate_size=vision_hidden * 2, num_hidden_layers=vision_depth,
                  num_attention_heads=2, image_size=SMOLVLM_SIDE, patch_size=SMOLVLM_PATCH)
    config = SmolVLMConfig if family == "smolvlm" else Idefics3Config
    return config(text_config={**text, "model_type": "llama"}, vision_config=vision, scale_factor=2,
                  image_token_id=image_token, tie_word_embeddings=True)


def build_tiny_vlm(path: str | Path, family: str = "qwen2_5_vl", hidden: int = 64, layers: int = 2, heads: int = 4,
                   kv_heads: int = 2, vision_hidden: int = 32, vision_depth: int = 2, seed: int = 0) -> Path:
    """Save a random tiny VLM of `family` (`VISION_FAMILIES`), its tokenizer, image processor and generation config
    under `path`."""
    from transformers import AutoModelForImageTextToText, GenerationConfig

    if family not in VISION_FAMILIES:
        raise ValueError(f"family {family!r}: expected one of {', '.join(VISION_FAMILIES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    gemma, smol = family == "gemma3", family in SMOLVLM_FAMILIES
    marks = GEMMA3_TOKENS if gemma else SMOLVLM_TOKENS if smol else VISION_TOKENS
    tok.add_special_tokens({"additional_special_tokens": [BOS, *marks]})
    pad_id, eos_id = tok.convert_tokens_to_ids(PAD), tok.convert_tokens_to_ids(EOS)
    text = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
                rms_norm_eps=1e-6, pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=None, initializer_range=0.2)
    if gemma:
        start, image, end = tok.convert_tokens_to_ids(list(GEMMA3_TOKENS))
        config = _gemma3_config(text, vision_hidden, vision_depth, heads,
                                dict(boi_token_index=start, image_token_index=image, eoi_token_index=end))
    elif smol:
        config = _smolvlm_config(family, text, vision_hidden, vision_depth, tok.convert_tokens_to_ids("<image>"))
    else:
        start, image, end, video = tok.convert_tokens_to_ids(list(VISION_TOKENS))
        config = _config(family, text, vision_hidden, vision_depth, hidden,
                         dict(image_token_id=image, video_token_id=video, vision_start_token_id=start,
                              vision_end_token_id=end))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config)
        if gemma:  # zeros and ones as transformers initialises them would hide the images and the norms
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if "norm" in name or "mm_input_projection" in name:
                        param.normal_(0.0, 0.2)
    model.generation_config = GenerationConfig(eos_token_id=[eos_id], pad_token_id=pad_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    _image_processor(family).save_pretrained(path)
    return path


def _image_processor(family: str):
    """The family's image processor at the tiny sizes."""
    if family == "gemma3":
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        return Gemma3ImageProcessorPil(size={"height": GEMMA3_SIDE, "width": GEMMA3_SIDE})
    if family in SMOLVLM_FAMILIES:
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

        processor = SmolVLMImageProcessorPil if family == "smolvlm" else Idefics3ImageProcessorPil
        return processor(size={"longest_edge": SMOLVLM_LONGEST}, max_image_size={"longest_edge": SMOLVLM_SIDE})
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    side = 2 * PATCH[family]
    return Qwen2VLImageProcessorPil(min_pixels=side * side * MIN_TOKENS, max_pixels=max_pixels(family),
                                    patch_size=PATCH[family])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--family", default="qwen2_5_vl", choices=VISION_FAMILIES)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    print(build_tiny_vlm(args.path, family=args.family, hidden=args.hidden, layers=args.layers))


if __name__ == "__main__":
    main()

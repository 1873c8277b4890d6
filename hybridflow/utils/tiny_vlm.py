"""A tiny, offline Qwen2.5-VL model directory: the real architecture (`Qwen2_5_VLForConditionalGeneration`: window
attention vision tower, patch merger, multimodal rotary positions) at a debug size, with random weights.

Tests need a vision-language model that loads with no network. The directory holds the model, a byte-level
tokenizer (`tiny_model.build_tokenizer`) with Qwen's vision tokens added (`<|vision_start|>`, `<|image_pad|>`,
`<|vision_end|>`; `hybridflow.data.image_prompts` puts them where a prompt says `<image>`), and Qwen2-VL's image
processor with a small pixel range (so a test image is a few dozen patches).

    python -m hybridflow.utils.tiny_vlm /tmp/tiny_vl
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hybridflow.utils.tiny_model import BOS, EOS, PAD, build_tokenizer

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
# pixels of the smallest / largest image after the processor's resize: 4 to 64 patches of 28 x 28
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 64


def build_tiny_vlm(path: str | Path, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                   vision_hidden: int = 32, vision_depth: int = 2, seed: int = 0,
                   max_pixels: int = MAX_PIXELS) -> Path:
    """Save a random tiny Qwen2.5-VL, its tokenizer, image processor and generation config under `path`."""
    from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [BOS, *VISION_TOKENS]})
    start, image, end, video = tok.convert_tokens_to_ids(list(VISION_TOKENS))
    pad_id, eos_id = tok.convert_tokens_to_ids(PAD), tok.convert_tokens_to_ids(EOS)
    head_dim = hidden // heads
    section = [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]  # Qwen2.5-VL's t/h/w split (16/24/24 of 128)
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=1024, rms_norm_eps=1e-6, pad_token_id=pad_id, eos_token_id=eos_id,
                         bos_token_id=None, initializer_range=0.2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                             "mrope_section": section}),
        vision_config=dict(depth=vision_depth, hidden_size=vision_hidden, intermediate_size=vision_hidden * 2,
                           num_heads=2, out_hidden_size=hidden, fullatt_block_indexes=[vision_depth - 1],
                           window_size=56),
        image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
        tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(eos_token_id=[eos_id], pad_token_id=pad_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=max_pixels).save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    print(build_tiny_vlm(args.path, hidden=args.hidden, layers=args.layers))


if __name__ == "__main__":
    main()

"""Model shapes and timing helpers shared by bench/rollout.py and its long-response regime
(bench/rollout_long.py): random-weight HF models (Qwen2, or the family a shape names), our engine over their
parameters, and timed runs of ours and of `transformers.generate`."""

from __future__ import annotations

import time

import torch

from hybridflow.engine.rollout import RolloutEngine, SamplingParams
from hybridflow.utils.model_shapes import QWEN_SHAPES, SMOLLM2_135M

SHAPES = {
    "cpu-10m": dict(hidden_size=256, num_hidden_layers=10, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=1024, vocab_size=512),
    "qwen2-0.5b": QWEN_SHAPES["0.5b"],
    "qwen2-1.5b": QWEN_SHAPES["1.5b"],
    "smollm2-135m": SMOLLM2_135M,  # the learning race's dimensions, built as a Qwen2 (random weights)
    # the config.json shapes of OLMo-2-0425-1B, Phi-3-mini-4k-instruct and Phi-4-mini-instruct (its partial rotary;
    # the bench's 384 positions stay within longrope's short factors, so plain rope stands in for them)
    "olmo2-1b": dict(model_type="olmo2", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=16, num_key_value_heads=16, vocab_size=100352, tie_word_embeddings=False,
                     rope_theta=500000.0, rms_norm_eps=1e-6),
    "phi3-mini": dict(model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, vocab_size=32064, tie_word_embeddings=False,
                      sliding_window=2047, rms_norm_eps=1e-5),
    "phi4-mini": dict(model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                      num_attention_heads=24, num_key_value_heads=8, vocab_size=200064, tie_word_embeddings=True,
                      partial_rotary_factor=0.75, rms_norm_eps=1e-5),
    # gemma-3-4b-it's text model: five sliding-window layers (1,024 tokens) to one global, 8 heads of 256 over 4 KV
    # heads, the local base and the global one with linear scaling; the bench's 384 positions stay within the window
    "gemma3-4b": dict(model_type="gemma3_text", hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                      vocab_size=262208, tie_word_embeddings=True, sliding_window=1024, rms_norm_eps=1e-6,
                      rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                       "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                          "rope_theta": 1_000_000.0}}),
    # Qwen3.5-0.8B's text model (its config.json's text_config; the checkpoint is a `qwen3_5` with a vision tower):
    # 18 Gated DeltaNet layers and 6 gated full-attention ones (every 4th), a quarter of each head rotated
    "qwen3.5-0.8b": dict(model_type="qwen3_5_text", hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=256, vocab_size=248320,
                         tie_word_embeddings=True, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                         linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=16,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                          "partial_rotary_factor": 0.25}, rms_norm_eps=1e-6),
    # Qwen3-Next-80B-A3B cut to its first 4 layers (3 Gated DeltaNet, 1 gated full attention), each with its 512
    # experts (10 a token) and shared expert: the whole 48 layers (80B) do not fit one GPU beside generate's copy
    "qwen3-next-80b-a3b-4l": dict(model_type="qwen3_next", hidden_size=2048, intermediate_size=5120,
                                  num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                                  vocab_size=151936, tie_word_embeddings=False, linear_conv_kernel_dim=4,
                                  linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                                  linear_num_value_heads=32, num_experts=512, num_experts_per_tok=10,
                                  moe_intermediate_size=512, shared_expert_intermediate_size=512,
                                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                                   "partial_rotary_factor": 0.25}, rms_norm_eps=1e-6),
}


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_model(shape: str, dtype: torch.dtype, device: torch.device, spread: float | None = None, **extra):
    """A random-init HF model of the named shape (a Qwen2 unless it names a `model_type`; tied embeddings unless
    it says otherwise; no download); `spread` re-draws the weights from N(0, spread) (norms ~1) so greedy
    continuations are not degenerate."""
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = {"max_position_embeddings": 4096, "tie_word_embeddings": True, **SHAPES[shape], **extra}
    config = AutoConfig.for_model(sizes.pop("model_type", "qwen2"), eos_token_id=None, bos_token_id=None,
                                  pad_token_id=0, **sizes)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    if spread is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else spread * torch.randn_like(p))
    return model


def hf_generate(model, prompts: torch.Tensor, new_tokens: int, greedy: bool = False,
                stop_ids: list[int] | None = None) -> tuple[torch.Tensor, float]:
    """`model.generate` on left-unpadded prompts [B, P]; returns (new tokens [B, <=new], seconds)."""
    sample = {} if greedy else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    sync(prompts.device)
    start = time.perf_counter()
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                         min_new_tokens=None if stop_ids else new_tokens, eos_token_id=stop_ids or None,
                         pad_token_id=0, **({"do_sample": False} if greedy else sample))
    sync(prompts.device)
    return out[:, prompts.shape[1]:], time.perf_counter() - start


def ours_generate(engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list, float]:
    sync(engine.device)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    sync(engine.device)
    return outs, time.perf_counter() - start


def engine_from(model, device, dtype, **kwargs) -> RolloutEngine:
    return RolloutEngine.from_config(model.config, model.named_parameters(), device, dtype,
                                     stop_token_ids=[], **kwargs)

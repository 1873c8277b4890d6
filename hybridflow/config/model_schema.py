"""The model sections every training program shares: which Hugging Face model to load (`ModelConfig`, and
`FrozenModelConfig` for one never trained), its low-rank adapters (`LoraConfig`) and how it is optimised
(`EngineOptimConfig`, and `OptimConfig` for a per-token loss). `hybridflow.config.schema` (RL),
`sft_schema` and `preference_schema` build their roots from these; fields are declared as there, with
`opt(default, help, choices=...)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, cast

from hybridflow.config.options import opt, registered

LR_SCHEDULES = ("constant", "cosine")
DTYPES = ("auto", "bf16", "fp32")
MASTER_DTYPES = ("fp32", "bf16")
OPTIMIZERS = ("auto", "adamw", "adamw_8bit", "adamw_cpu_offload")
QUANTIZATIONS = ("none", "nf4")
LORA_INITS = ("default", "gaussian")


@dataclass
class FrozenModelConfig:
    """A Hugging Face model to load, never trained (a distillation teacher)."""

    path: Optional[str] = opt(None, "Hugging Face model directory (or hub id)")
    tokenizer_path: Optional[str] = opt(None, "tokenizer directory; null = the model's `path`")
    dtype: str = opt("auto", "parameter dtype; auto = bf16 on cuda, fp32 on cpu", DTYPES)
    compile: Optional[bool] = opt(None, "torch.compile each decoder layer and the log-prob head; null = on for "
                                        "CUDA, off on a CPU (docs/training_engine.md)")
    attn_implementation: str = opt("sdpa", "transformers attention implementation (sdpa, eager, ...)")
    trust_remote_code: bool = opt(False, "allow model code shipped inside the model directory")


@dataclass
class ModelConfig(FrozenModelConfig):
    """A Hugging Face model to load."""

    master_dtype: str = opt("fp32", "dtype of the trained weights, gradients and updates: fp32 (mixed precision) "
                                    "or bf16 (half the memory; needs optimizer=adamw_8bit, whose stochastic "
                                    "rounding keeps small updates)", MASTER_DTYPES)
    gradient_checkpointing: Optional[bool] = opt(None, "recompute activations in backward to save memory; null = "
                                                       "the device plan decides: on (GPU) for models under 1B "
                                                       "parameters, with longer micro-batches "
                                                       "(ModelShape.host_bound_tokens), and where the memory needs "
                                                       "it; off on a CPU (why: docs/benchmarks.md#measurements-"
                                                       "behind-choices-in-the-code)")
    freeze_vision: bool = opt(True, "a vision-language model's vision tower stays as loaded: the language model "
                                    "trains alone (LoRA: adapters on its layers only); false trains the tower too "
                                    "(LoRA: adapters on its linear layers as well)")
    quantization: str = opt("none", "storage of the frozen base weights of a LoRA role: none (the compute dtype) "
                                    "or nf4 (4-bit NormalFloat, torchao; QLoRA: the adapted linear layers' weights "
                                    "in 4 bits, dequantized for each forward; needs lora.rank > 0; the rollout "
                                    "engine keeps a bf16 copy, or FP8 weights with rollout.quantization=fp8, which "
                                    "follows under trainer.device_memory_gib where it can run: docs/small_gpus.md)",
                            QUANTIZATIONS)


@dataclass
class LoraConfig:
    """Low-rank adapters (LoRA, Hugging Face peft): the model's weights stay frozen, rank-r matrices beside
    them train (docs/lora.md)."""

    rank: int = opt(0, "adapter rank r; 0 = no LoRA (every weight trains)")
    alpha: float = opt(32.0, "the adapters' update B·A is scaled by alpha / rank")
    dropout: float = opt(0.0, "dropout on the adapters' input during updates (off in log-prob passes)")
    target_modules: list[str] = opt([], "linear layers of the decoder layers given adapters: a module whose name "
                                        "is, or ends with, one of these (q_proj, mlp.down_proj, ...); [] = all of "
                                        "them (Llama, Qwen, Mistral: q/k/v/o_proj, gate/up/down_proj)")
    target_parameters: list[str] = opt([], "mixture of experts: 3-D stacked expert weights given adapters (one per "
                                           "expert, peft's target_parameters), by name: a parameter whose name is, or "
                                           "ends with, one of these (experts.gate_up_proj, experts.down_proj); [] = "
                                           "none (docs/moe.md)")
    init: str = opt("default", "initial A (B starts at 0, so the initial policy is the base model): default = "
                               "nn.Linear's Kaiming uniform, gaussian = normal with std 1/rank", LORA_INITS)


@dataclass
class EngineOptimConfig:
    """Optimisation of a trained model: AdamW, lr schedule, clipping, mini-/micro-batching, packing, offload."""

    lr: float = opt(1e-6, "peak learning rate")
    lr_schedule: str = opt("constant", "learning-rate schedule after warm-up", LR_SCHEDULES)
    lr_warmup_steps: int = opt(0, "optimizer steps of linear learning-rate warm-up")
    min_lr_ratio: float = opt(0.0, "cosine schedule floor, as a fraction of lr")
    optimizer: str = opt("auto", "adamw; adamw_8bit (torchao, 8-bit moments: a quarter of the state memory); "
                                  "adamw_cpu_offload (state and update on the CPU: none on the GPU); auto = adamw "
                                  "(adamw_8bit with master_dtype=bf16), or where the device plan needs it to fit adamw_8bit, "
                                  "then with fp32 master weights adamw_cpu_offload (docs/small_gpus.md)", OPTIMIZERS)
    weight_decay: float = opt(0.01, "AdamW weight decay")
    betas: tuple[float, float] = opt((0.9, 0.999), "AdamW betas")
    grad_clip: float = opt(1.0, "gradient-norm clipping threshold")
    mini_batch_size: Optional[int] = opt(None, "prompts per optimizer step (rows = this x rollout.n); "
                                               "null = the whole batch")
    micro_batch_size: Optional[int] = opt(None, "rows per forward per rank; null = the rank's whole mini-batch")
    max_tokens_per_micro_batch: Optional[int] = opt(None, "token budget per micro-batch (dynamic batch sizing; "
                                                          "overrides micro_batch_size); null with micro_batch_size "
                                                          "null = sized from the device budget on a GPU, the whole "
                                                          "mini-batch on a CPU")
    use_packing: bool = opt(True, "remove padding: pack sequences into one row (on CUDA; CPU forwards stay "
                                  "padded: docs/benchmarks.md#measurements-behind-choices-in-the-code)")
    shuffle: bool = opt(True, "shuffle rows between mini-batches")
    param_offload: bool = opt(False, "keep parameters on the CPU between uses")
    optimizer_offload: Optional[bool] = opt(None, "keep optimizer state on the CPU between uses; null = the device "
                                                  "plan decides: on only where the run would not fit without it "
                                                  "(off on a CPU)")
    lora: LoraConfig = opt(LoraConfig, "train low-rank adapters instead of every weight")

    def __post_init__(self) -> None:
        self.betas = cast(tuple[float, float], tuple(self.betas))  # OmegaConf < 2.4 hands tuples over as lists


@dataclass
class OptimConfig(EngineOptimConfig):
    """Optimisation of a model trained on a per-token loss (the RL roles, SFT)."""

    loss_agg: str = opt("token-mean", "how per-token losses are aggregated", registered("AGG_MODES"))

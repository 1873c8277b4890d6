"""Loading the Hugging Face model a training engine wraps: a causal LM, a critic or a reward model (backbone +
scalar head).

`load_model(path, head)` works for any `AutoModelForCausalLM` architecture. The critic (`head="value"`) is
`AutoModelForTokenClassification` with one label: the backbone's weights come from `path` (a causal-LM
checkpoint loads into it; only the head starts fresh), so a critic may start from any model directory. A
reward model in training (`head="score"`) is the same without the head's bias, so its weights are exactly
those of `AutoModelForSequenceClassification` (which reads the score at the last token), the model an RL run
scores with.
Weights are loaded in the master dtype (fp32 by default); low-precision compute is FSDP's mixed-precision
policy. RMSNorms run the fused kernel (`kernels.fuse_rms_norms`), packed rows restart a hybrid model's
linear-attention states at each sequence (`packed_deltanet`), and a causal LM's `lm_head` becomes the
log-prob head (`head.install_log_prob_head`), so no forward materialises full-vocabulary logits. This is
the one place a model is built; parallelism and compilation are applied to its result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:  # transformers is imported where a model is built, not with this module
    from transformers import PreTrainedModel

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}
HEADS = ("lm", "value", "score")
MASTER_DTYPES = ("fp32", "bf16")
# config attributes of architectures that transform the logits after `lm_head` (soft-capping, scaling),
# which the log-prob head does not reproduce
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


@dataclass
class Precision:
    """`param`: dtype of parameters in forward/backward; `master`: dtype of stored weights and optimizer
    state; `reduce`: dtype of gradient reduction."""

    param: torch.dtype
    master: torch.dtype = torch.float32
    reduce: torch.dtype = torch.float32

    @property
    def mixed(self) -> bool:
        return self.param != self.master


def resolve_precision(dtype: str, device: torch.device, trainable: bool = True,
                      master_dtype: str = "fp32") -> Precision:
    """``"auto"`` = bf16 compute on CUDA, fp32 on CPU. Trained weights are stored in `master_dtype`
    (``"fp32"``: mixed precision; ``"bf16"``: pure bf16, which needs a bf16 compute dtype); frozen models
    (`trainable=False`) store theirs in the compute dtype (no master copy is needed)."""
    if dtype == "auto":
        param = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif dtype in DTYPES:
        param = DTYPES[dtype]
    else:
        raise ValueError(f"model dtype {dtype!r} is not valid; valid: auto, {', '.join(DTYPES)}")
    if master_dtype not in MASTER_DTYPES:
        raise ValueError(f"model master_dtype {master_dtype!r} is not valid; valid: {', '.join(MASTER_DTYPES)}")
    master = DTYPES[master_dtype]
    if trainable and master.itemsize < param.itemsize:
        raise ValueError(f"model.master_dtype={master_dtype} is below the compute dtype {param} (model.dtype="
                         f"{dtype} on {device.type}); use model.master_dtype=fp32 or model.dtype=bf16")
    return Precision(param=param, master=master if trainable else param)


def load_model(path: str, head: str = "lm", dtype: torch.dtype = torch.float32,
               attn_implementation: str = "sdpa", trust_remote_code: bool = False,
               gradient_checkpointing: bool = False,
               recompute_contexts: Callable[[], tuple[Any, Any]] | None = None,
               images: bool = False) -> PreTrainedModel:
    """The model at `path` on CPU in `dtype`: a causal LM (`head="lm"`), a critic (`head="value"`, outputs
    `[*, 1]` logits per position) or a reward model (`head="score"`: the critic's outputs, no bias).
    With `gradient_checkpointing` each decoder layer recomputes its activations in the backward (non-reentrant
    `torch.utils.checkpoint`), under `recompute_contexts` (its `context_fn`) where given. `images`: the rows carry
    images, so a `lm_class.TEXT_FIRST_FAMILIES` checkpoint (Qwen3.5) loads as the vision-language model it is."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    from hybridflow.engine.train import attention
    from hybridflow.engine.train.head import install_log_prob_head
    from hybridflow.engine.train.kernels import fuse_rms_norms
    from hybridflow.engine.train.packed_deltanet import install_packed_deltanet
    from hybridflow.utils.lm_class import lm_auto_class

    if head not in HEADS:
        raise ValueError(f"model head {head!r} is not valid; valid: {', '.join(HEADS)}")
    attention.register()
    if attn_implementation == "sdpa":  # SDPA for padded rows, varlen flash attention for packed ones
        attn_implementation = attention.VARLEN_ATTENTION
    kwargs: dict[str, Any] = dict(dtype=dtype, attn_implementation=attn_implementation,
                                  trust_remote_code=trust_remote_code)
    if head == "lm":
        # a vision-language model's vision tower comes with it (its inputs: `vision_forward`)
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = lm_auto_class(config, images).from_pretrained(path, **kwargs)
    else:
        config = AutoConfig.from_pretrained(path, num_labels=1, trust_remote_code=trust_remote_code)
        config.token_classification_bias = head == "value"
        model = AutoModelForTokenClassification.from_pretrained(path, config=config, **kwargs)
        model.config.classifier_dropout = 0.0
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    model.config.use_cache = False
    # a vision-language model's language model reads its own config's: left on, each forward built a KV cache whose
    # guards recompiled the compiled layers (tests/engine/vision/test_vision_forward.py)
    model.config.get_text_config().use_cache = False
    fuse_rms_norms(model)
    install_packed_deltanet(model)
    if head == "lm":
        transforms = {k: getattr(model.config, k) for k in LOGIT_TRANSFORMS
                      if getattr(model.config, k, None) not in (None, 1, 1.0)}
        if transforms:
            raise ValueError(f"{type(model).__name__} transforms its logits after lm_head ({transforms}), which "
                             f"the training engine's log-prob head does not reproduce; this architecture "
                             f"is not supported for training")
        install_log_prob_head(model)
    if gradient_checkpointing:
        options: dict[str, Any] = {"use_reentrant": False}
        if recompute_contexts is not None:
            options["context_fn"] = recompute_contexts
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
    return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: modules whose class is in HF's `_no_split_modules` (also once FSDP2 has
    sharded them: `fully_shard` swaps a module's class for an `FSDP<name>` subclass of it)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder-layer class in _no_split_modules "
                         f"({sorted(names)}); cannot shard it per layer")
    return layers


def mark_inputs_require_grad(model: torch.nn.Module) -> None:
    """The input embeddings' output marked as needing a gradient in a pass that records one. The frozen embeddings
    of a LoRA model leave the first decoder layer's input without `requires_grad` while every later layer's has it,
    and compiled layers guard on it: a second graph (forward and backward) for the first layer alone. transformers'
    `enable_input_require_grads` marks it in no-grad passes too, where no other layer's input has it, so the
    log-prob pass compiled a graph of its own for the first layer; marking only where grad mode is on gives each
    pass one graph for all its layers (`tests/engine/train/test_lora.py`)."""

    def mark(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
        if torch.is_grad_enabled():
            output.requires_grad_(True)

    embeddings: torch.nn.Module = cast(Any, model).get_input_embeddings()
    embeddings.register_forward_hook(mark)

"""LoRA in the training engine: low-rank adapters (Hugging Face `peft`) injected into a loaded model.

`apply_lora(model, cfg, head, master_dtype)` gives the linear layers `cfg.target_modules` names (default:
every linear layer inside the decoder layers; for Llama, Qwen and Mistral q/k/v/o and gate/up/down
projections; for a mixture of experts its attention and shared-expert projections) and the 3-D expert weights
`cfg.target_parameters` names (a mixture of experts' stacked `experts.gate_up_proj` / `experts.down_proj`,
through peft's `target_parameters`: a `ParamWrapper` per weight, a rank-r adapter per expert, added to the
weight as W + scale · B·A for each forward) a rank-`cfg.rank` adapter through `peft.inject_adapter_in_model`,
freezes every other weight and
stores the adapters (and a value model's score head, which starts untrained) in the master dtype; the
frozen weights stay in the dtype the model was loaded in (the compute dtype: no master copy, no gradient,
no optimizer state). The model keeps its class and Hugging Face names: an adapted `...q_proj` holds
`base_layer.weight` and `lora_A.default.weight` / `lora_B.default.weight`, so FSDP2, compilation and
checkpoints apply unchanged. Both `init` choices start with B = 0: the initial policy is the base model.

The returned `Adapters` gives what the rest of a run needs from them:
- `disabled()`: a context in which the model computes with its base weights alone — the reference policy
  of a KL term, with no second copy of the model;
- `merged_weights(dtype, adapter_dtype)`: (HF name of the base weight, W + scale · B·A) per adapted module or
  expert weight (stacked, `...mlp.experts.gate_up_proj`), gathered one at a time, from A and B as the forward
  sees them (`adapter_dtype`: FSDP2's mixed precision rounds them): the only weights of the trained policy that
  differ from the model directory's, what a rollout engine built from that directory is sent (`merge`, which
  exact mode's forward also uses);
- `peft_config`: the `peft.LoraConfig`, which checkpoints keep so `hybridflow export` can write an adapter
  directory or a merged model.
`frozen_weights(model)` names the frozen weights a colocated rollout engine may hold as they are (those outside
the decoder layers' linear layers with no adapter: embeddings, head, norms, routers, unadapted stacked experts;
the engine fuses or merges the rest). `trainable_params` counts, on the meta device, the parameters a LoRA run
trains (for device budgeting and the checkpoint-size check), `shareable_params` those frozen weights.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from hybridflow.config.model_schema import LoraConfig
from hybridflow.engine.train.model import decoder_layers
from hybridflow.engine.train.parallel import full_tensor
from hybridflow.engine.train.quantized_base import dense

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ADAPTER = "default"  # peft's adapter name; a run trains one adapter
INITS = {"default": True, "gaussian": "gaussian"}  # our `init` choice -> peft's `init_lora_weights`
ALL_LINEAR = "all-linear"  # peft's name for every linear layer (but the output head)


def _peft():
    try:
        import peft
    except ImportError as e:
        raise ImportError("LoRA (actor.lora.rank > 0) needs peft: pip install 'hybridflow[lora]'") from e
    return peft


def target_names(names: list[str] | tuple[str, ...]) -> list[str]:
    """The module names of `lora.target_modules`: peft's ``all-linear`` (alone) means every linear layer, as
    `[]` does. Refuses what peft also accepts but we do not: ``all-linear`` among other names, and a regular
    expression (we match names, as peft does for a list)."""
    names = list(names)
    if names == [ALL_LINEAR]:
        return []
    problems = [n for n in names if n == ALL_LINEAR or not all(part.isidentifier() for part in n.split("."))]
    if problems:
        raise ValueError(f"lora.target_modules: {problems[0]!r} is not a module name; give module names (q_proj, "
                         f"mlp.down_proj, ...), or {ALL_LINEAR} / [] alone for every linear layer (peft's regular "
                         f"expressions are not supported)")
    return names


def resolve_targets(model: torch.nn.Module, names: list[str] | tuple[str, ...],
                    skip: str | None = None) -> dict[str, torch.nn.Linear]:
    """{qualified name: module} of the linear layers inside the decoder layers that `names` select (peft's
    rule: a module whose qualified name is one of them, or ends with a dot and one of them); `names` empty or
    ``all-linear`` = every linear layer there. Refuses a name that selects nothing, or something that is not a
    linear layer of a decoder layer (embeddings and heads are not adapted), naming the layers that could be.
    `skip`: a module (a frozen vision tower) whose layers are never selected."""
    names = target_names(names)
    inside = {id(m) for layer in decoder_layers(model) for m in layer.modules()}
    linear = {n: m for n, m in model.named_modules() if id(m) in inside and isinstance(m, torch.nn.Linear)
              and not (skip is not None and n.startswith(skip + "."))}
    if not names:
        if not linear:
            raise ValueError(f"{type(model).__name__} has no torch.nn.Linear layer inside its decoder layers to "
                             f"give adapters to")
        return linear
    available = sorted({n.rsplit(".", 1)[-1] for n in linear})
    out: dict[str, torch.nn.Linear] = {}
    for key in names:
        chosen = {n: m for n, m in model.named_modules() if (n == key or n.endswith("." + key))
                  and not (skip is not None and n.startswith(skip + "."))}
        wrong = sorted({f"{n} ({type(m).__name__})" for n, m in chosen.items() if n not in linear})
        if not chosen or wrong:
            found = f"it selects {', '.join(wrong[:3])}, not a linear layer of a decoder layer" if wrong else \
                "no module has that name"
            raise ValueError(f"lora.target_modules: {key!r}: {found}; valid: {', '.join(available)} (or [] for "
                             f"all of them)")
        out.update(chosen)
    return out


def resolve_parameters(model: torch.nn.Module, names: list[str] | tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    """{qualified name: shape} of the 3-D weights (a mixture of experts' stacked experts) inside the decoder
    layers that `names` select (a parameter whose qualified name is one of them or ends with a dot and one of
    them). Refuses a name that selects nothing, or a weight that is not 3-D, naming those that could be."""
    inside = {id(p) for layer in decoder_layers(model) for p in layer.parameters()}
    stacked = {n: tuple(p.shape) for n, p in model.named_parameters() if id(p) in inside and p.dim() == 3}
    available = sorted({".".join(n.rsplit(".", 2)[-2:]) for n in stacked})
    out: dict[str, tuple[int, ...]] = {}
    for key in names:
        chosen = {n for n, _ in model.named_parameters() if n == key or n.endswith("." + key)}
        wrong = sorted(chosen - set(stacked))
        if not chosen or wrong:
            found = f"it selects {', '.join(wrong[:3])}, not a 3-D expert weight" if wrong else \
                "no parameter has that name"
            valid = ", ".join(available) or "none (the model has no stacked expert weights)"
            raise ValueError(f"lora.target_parameters: {key!r}: {found}; valid: {valid}")
        out.update({n: stacked[n] for n in chosen})
    return out


def _param_name(module_name: str, parameter: str) -> str:
    """The Hugging Face name of the weight a (possibly nested) peft `ParamWrapper` adapts."""
    return ".".join(p for p in module_name.split(".") if p != "base_layer") + "." + parameter


def _factors(layer: Any, adapter_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's (A, B), gathered in full and, with `adapter_dtype`, rounded to it (as FSDP2's mixed precision
    rounds them for the forward: elementwise, so before or after the gather alike)."""
    a = full_tensor(layer.lora_A[ADAPTER].weight.detach())
    b = full_tensor(layer.lora_B[ADAPTER].weight.detach())
    return (a, b) if adapter_dtype is None else (a.to(adapter_dtype), b.to(adapter_dtype))


def _expert_delta(layer: Any, adapter_dtype: torch.dtype | None) -> torch.Tensor:
    """scale · B·A per expert, [E, out, in] in fp32, of a `ParamWrapper` (peft's `get_delta_weight` layout:
    lora_A [r·E, in] read as [E, r, in], lora_B [out, r·E] read as [out, r, E]), from gathered factors."""
    a, b = (t.float() for t in _factors(layer, adapter_dtype))
    a = a.reshape(layer.num_experts, -1, a.shape[-1])
    b = b.reshape(b.shape[0], -1, layer.num_experts)
    pattern = "o r e, e r i -> e o i" if layer._did_swap_in_out_features else "o r e, e r i -> e i o"
    return torch.einsum(pattern, b, a) * layer.scaling[ADAPTER]


def _head_params(model: PreTrainedModel) -> list[torch.nn.Parameter]:
    """A value model's score head: the parameters outside its backbone (`base_model_prefix`)."""
    prefix = model.base_model_prefix + "."
    return [p for n, p in model.named_parameters() if not n.startswith(prefix)]


class Adapters:
    """The adapted modules of a model (`apply_lora`'s result); see the module docstring."""

    def __init__(self, model: torch.nn.Module, peft_config: Any) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        self.peft_config = peft_config
        # peft's LoRA layers: what this engine reads of them (scaling, lora_A, ...) peft sets at run time
        self.layers: dict[str, Any] = {n: m for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)}
        for name, layer in self.layers.items():
            if not hasattr(layer, "_disable_adapters") or not hasattr(layer, "base_layer"):
                raise RuntimeError(f"peft's LoRA layer {name} ({type(layer).__name__}) lacks the `_disable_adapters` "
                                   f"flag or `base_layer` this engine uses; install a peft version from "
                                   f"hybridflow's `lora` extra")
            # peft would cast each adapter's input to the fp32 master weights' dtype: under autocast (one rank)
            # every adapted module would then keep its own copy of its input for the backward instead of
            # sharing the compute-dtype one; autocast and FSDP2 already give the matmuls one dtype
            layer.cast_input_dtype_enabled = False

    @property
    def rank(self) -> int:
        return self.peft_config.r

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Within the block the model computes with its base weights alone. Sets the flag peft's
        `enable_adapters(False)` sets, without its side effect of turning off the adapters' `requires_grad`:
        FSDP2 reads which parameters train when it first runs, which may be inside this block."""
        for layer in self.layers.values():
            layer._disable_adapters = True
        try:
            yield
        finally:
            for layer in self.layers.values():
                layer._disable_adapters = False

    def _base(self, name: str, layer: Any) -> tuple[str, torch.Tensor]:
        """(HF name, the frozen weight) an adapted module or expert weight adds its update to."""
        if hasattr(layer, "parameter_name"):
            return _param_name(name, layer.parameter_name), layer.get_param()
        return f"{name}.weight", layer.base_layer.weight

    def merged_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(HF name, shape) of each tensor `merged_weights` yields, in its order."""
        return [(hf, tuple(weight.shape)) for hf, weight in (self._base(n, layer) for n, layer in self.layers.items())]

    @torch.no_grad()
    def merged_weights(self, dtype: torch.dtype | None = None,
                       adapter_dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, W + scale · B·A) per adapted module or expert weight, each gathered in full (a collective
        under FSDP2: every rank iterates), summed in fp32 and rounded once to `dtype` (None: the base weight's).
        `adapter_dtype`: the dtype the trainer's forward sees the adapters in (FSDP2's mixed-precision parameter
        dtype; None where they stay in their own): A and B are rounded to it first, so the weight sent is the
        one the forward computes with (bit for bit in exact mode, which merges them the same way)."""
        for name, layer in self.layers.items():
            hf_name, weight = self._base(name, layer)
            base = dense(full_tensor(weight.detach()))  # a 4-bit base (quantized_base.py) dequantized
            if hasattr(layer, "parameter_name"):
                yield hf_name, (base.float() + _expert_delta(layer, adapter_dtype)).to(dtype or base.dtype)
                continue
            a, b = _factors(layer, adapter_dtype)
            yield hf_name, merge(base, a, b, layer.scaling[ADAPTER], dtype or base.dtype)


def merge(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """W + scale · B·A, summed in fp32 (autocast off) and rounded once to `dtype`: what a weight sync sends
    the rollout engine, and (exact mode, `train.exact`) the weight the adapted layer's forward multiplies by,
    so both have the same bits. Differentiable in a and b."""
    with torch.autocast(base.device.type, enabled=False):
        return torch.addmm(base.float(), b.float(), a.float(), alpha=scale).to(dtype)


def default_names(model: torch.nn.Module, targets: dict[str, torch.nn.Linear]) -> list[str]:
    """peft's `target_modules` for every linear layer of the decoder layers: their last name pieces (q_proj, ...),
    or, where a piece also names a module outside them (a vision tower's `patch_embed.proj` beside its blocks'
    `attn.proj`), their qualified names."""
    short = list(dict.fromkeys(n.rsplit(".", 1)[-1] for n in targets))
    if any(n not in targets and n.rsplit(".", 1)[-1] in short for n, _ in model.named_modules()):
        return list(targets)
    return short


def apply_lora(model: PreTrainedModel, cfg: LoraConfig, head: str, master_dtype: torch.dtype,
               skip: str | None = None) -> Adapters:
    """Injects adapters into `model` in place (see the module docstring); returns its `Adapters`. `skip`: a module
    left without adapters, frozen (a vision-language model's tower with `model.freeze_vision`)."""
    if cfg.init not in INITS:
        raise ValueError(f"lora.init={cfg.init!r} is not valid; valid: {', '.join(INITS)}")
    targets = resolve_targets(model, list(cfg.target_modules), skip)
    names = target_names(cfg.target_modules) or default_names(model, targets)
    parameters = list(cfg.target_parameters)
    resolve_parameters(model, parameters)  # refuses a name that selects no expert weight, naming those that could
    if parameters and cfg.dropout:
        raise ValueError(f"lora.dropout={cfg.dropout} cannot apply to expert weights (lora.target_parameters="
                         f"{parameters}): peft adds their update to the weight, not to each input; use lora.dropout=0")
    # peft matches `exclude_modules` as a regular expression over qualified names: everything under `skip`
    exclude = re.escape(skip) + r"\..*" if skip is not None else None
    config = _peft().LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=names,
                                target_parameters=parameters or None, init_lora_weights=INITS[cfg.init], bias="none",
                                exclude_modules=exclude)
    model.requires_grad_(False)
    _peft().inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    trained = [p for p in model.parameters() if p.requires_grad]
    if head == "value":
        trained += _head_params(model)
    for p in trained:
        p.requires_grad_(True)
        p.data = p.data.to(master_dtype)
    adapters = Adapters(model, config)
    adapted = {n for n, layer in adapters.layers.items() if not hasattr(layer, "parameter_name")}
    extra = sorted(adapted - set(targets))
    if extra:
        raise ValueError(f"lora.target_modules={names} also selects {', '.join(extra[:3])} outside the decoder "
                         f"layers; name the modules more fully (e.g. self_attn.q_proj)")
    return adapters


def _outside_linear_layers(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """{HF name: parameter} of the weights outside the decoder layers' linear layers, without adapters: peft's
    adapters and the expert weights its `ParamWrapper`s adapt are left out, the other weights under a wrapper
    keep their Hugging Face names."""
    inside = {id(p) for layer in decoder_layers(model) for m in layer.modules() if isinstance(m, torch.nn.Linear)
              for p in m.parameters()}
    adapted = {_param_name(n, m.parameter_name) for n, m in model.named_modules() if hasattr(m, "parameter_name")}
    out = {}
    for name, p in model.named_parameters():
        hf = ".".join(part for part in name.split(".") if part != "base_layer")
        if id(p) not in inside and ".lora_" not in name and hf not in adapted:
            out[hf] = p
    return out


def frozen_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{HF name: tensor} of a LoRA model's frozen weights a rollout engine can hold as they are (see the module
    docstring): they never change, so the engine needs no copy of them."""
    return {n: p.detach() for n, p in _outside_linear_layers(model).items() if not p.requires_grad}


def trainable_params(config: Any, cfg: LoraConfig, head: str = "lm", trust_remote_code: bool = False,
                     images: bool = False) -> int:
    """Parameters a LoRA run of `cfg` trains on the model of Hugging Face `config` (in a run with or without
    `images`: `meta_model`): rank x (in + out) per adapted linear layer, rank x experts x (in + out) per adapted
    expert weight, plus a value model's score head; counted on the meta device."""
    model = meta_model(config, head, trust_remote_code, images)
    targets = resolve_targets(model, list(cfg.target_modules)).values()
    adapters = sum(cfg.rank * (m.in_features + m.out_features) for m in targets)
    stacked = resolve_parameters(model, list(cfg.target_parameters)).values()
    adapters += sum(cfg.rank * experts * (rows + cols) for experts, rows, cols in stacked)
    return adapters + (sum(p.numel() for p in _head_params(model)) if head == "value" else 0)


def meta_model(config: Any, head: str = "lm", trust_remote_code: bool = False,
               images: bool = False) -> PreTrainedModel:
    """The model of Hugging Face `config` on the meta device (no memory): a causal LM (a vision-language model's,
    `lm_class.lm_auto_class`, in a run with or without `images`), or a value model."""
    import copy

    from transformers import AutoModelForTokenClassification

    from hybridflow.utils.lm_class import lm_auto_class

    if head == "value":
        config = copy.copy(config)
        config.num_labels = 1
    with torch.device("meta"):
        auto = lm_auto_class(config, images) if head == "lm" else AutoModelForTokenClassification
        return auto.from_config(config, trust_remote_code=trust_remote_code)


def adapted_expert_params(config: Any, cfg: LoraConfig, trust_remote_code: bool = False) -> int:
    """Weights of the stacked expert parameters `cfg.target_parameters` gives adapters (0 for none): what each
    forward merges with its adapters (the device budget counts it)."""
    names = list(cfg.target_parameters)
    if not names:
        return 0
    shapes = resolve_parameters(meta_model(config, "lm", trust_remote_code), names).values()
    return sum(experts * rows * cols for experts, rows, cols in shapes)


def shareable_params(config: Any, cfg: LoraConfig, trust_remote_code: bool = False) -> int:
    """How many of a LoRA causal LM's weights `frozen_weights` gives a rollout engine (the device budget counts
    the engine's copy without them)."""
    model = meta_model(config, "lm", trust_remote_code)
    outside = sum(p.numel() for p in _outside_linear_layers(model).values())
    return outside - adapted_expert_params(config, cfg, trust_remote_code)

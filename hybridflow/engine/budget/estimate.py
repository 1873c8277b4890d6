"""The memory estimate of device budgeting: model sizes, what each role of a run holds on a device
(`TrainedRole`, `FrozenRole`, `RolloutRole`, together a `DeviceDemand`), and the bytes each part takes.

Per device (P parameters, W data-parallel ranks, c compute-dtype bytes):
- a trained role while it updates: weights and gradients `P x master / W`, optimizer state (`STATE_BYTES`),
  the gathered compute-dtype weights (`P x c` on one rank, which keeps every layer gathered from forward
  to backward; two layers on several), and per micro-batch token the activations kept for the backward
  (with LoRA only the T adapter parameters train: weights `(P - T) x c + T x master`, gradients and state of
  T alone, nothing gathered on one rank, where the model is not sharded; a 4-bit base (`model.quantization=
  nf4`) stores the Q weights of its adapted linear layers in `NF4_BYTES` each instead of c, and each forward
  dequantizes one of them at a time):
  `layers x c x (7h + 2kv + 4i)` (the inputs of the norms, projections, attention and SwiGLU), or with
  checkpointing `layers x c x h` plus one layer's worth; the log-prob head adds one chunk;
- a mixture of experts: P counts every expert (weights, gradients, state, the rollout's copy), while a token's
  activations and FLOPs count the k experts it is routed to (`i` = k x expert width + a shared expert), plus
  per sparse layer its k gathered input and output rows (`2 k h`) and the router's fp32 probabilities; LoRA on
  the stacked experts (`lora.target_parameters`) materialises W + B·A of each adapted weight in the compute
  dtype for each forward, kept for the backward: every layer's, or with checkpointing one layer's, twice;
- between its uses (generation): its weights unless `param_offload`, its state unless `optimizer_offload`;
- a frozen model: its compute-dtype weights unless offloaded (a LoRA actor's reference is its own base
  weights: nothing);
- the rollout engine: `P x c` weights (unless offloaded while training; beside a LoRA trainer on one device,
  less the frozen weights it holds as they are: embeddings, head, norms, routers, unadapted experts; with
  `rollout.quantization=fp8` the decoder layers' projections in a byte each and an fp32 scale per row), the KV
  cache while generating.
`bench/train.py` and `bench/scale.py` record this estimate beside the measured device peak of each run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.engine.linear_attention import state_shapes
from hybridflow.utils.model_shapes import QWEN_SHAPES
from hybridflow.utils.moe_spec import moe_spec

GIB = 2**30
TARGET_TOKENS = 16384  # default micro-batch: bounded memory at no speed cost (bench/train.py)
# a host-bound model's checkpointed micro-batch: with recomputation a token's activations are one layer's
# hidden state, so it can be twice as long for a fraction of the memory, and half as many cost half the host time
CHECKPOINTED_TARGET_TOKENS = 32768
MAX_CHECKPOINTED_TOKENS = 262144
# below this many parameters a micro-batch's GPU work is no more than its host work (per-layer launches),
# so recomputing a forward costs less than the extra micro-batches that memory without it would need, and
# checkpointing is on by default; above it the update is GPU-bound and recomputation would cost a quarter
# of it (docs/benchmarks.md, "Measurements behind choices in the code")
HOST_BOUND_PARAMS = 1_000_000_000
MIN_TOKENS_WITHOUT_CHECKPOINTING = 4096  # below this, recomputation is cheaper than tiny micro-batches
HEAD_CHUNK_BYTES = 3 * 4 * 2**27  # fp32 temporaries of one log-prob head chunk (logprobs.CHUNK_ELEMENTS)
SLACK_BYTES = 2 * GIB  # cuBLAS workspaces, allocator fragmentation, CUDA graphs
# device bytes of optimizer state per parameter, given the master dtype's bytes (engine/train/optim.py)
# device bytes per parameter of a 4-bit NormalFloat weight (torchao's NF4Tensor, QLoRA's layout): 4 bits, an int8
# scale per 64-value block and an fp32 factor per 256 scales (double quantization)
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
STATE_BYTES: dict[str, Callable[[int], float]] = {
    "adamw": lambda master: 2 * master, "adamw_8bit": lambda master: 2.05, "adamw_cpu_offload": lambda master: 0}


def layer_params(hidden: int, kv_dim: int, intermediate: int) -> int:
    """Weights of a decoder layer's q/k/v/o and gate/up/down projections."""
    return hidden * (2 * hidden + 2 * kv_dim) + 3 * hidden * intermediate


_REFERENCE = QWEN_SHAPES["0.5b"]
# `CHECKPOINTED_TARGET_TOKENS` was measured at the 0.5B shape, whose decoder layer has this many parameters; a
# smaller layer does less GPU work per token for the same host work per micro-batch, so its micro-batches grow
# in proportion (`ModelShape.host_bound_tokens`)
REFERENCE_LAYER_PARAMS = layer_params(
    _REFERENCE["hidden_size"],
    _REFERENCE["num_key_value_heads"] * _REFERENCE["hidden_size"] // _REFERENCE["num_attention_heads"],
    _REFERENCE["intermediate_size"])


def count(n: int) -> str:
    """7615616512 -> "7.62B", 52416 -> "52.4K"."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}B" if unit == "B" else f"{n / scale:.1f}{unit}"
    return str(n)


def _linear_attention(config: Any) -> dict[str, int]:
    """`ModelShape`'s hybrid fields of a text config with Gated DeltaNet layers (`layer_types`); {} otherwise."""
    kinds = list(getattr(config, "layer_types", None) or [])
    linear = kinds.count("linear_attention")
    if not linear:
        return {}
    conv, recurrent = state_shapes(config)
    return dict(attention_layers=kinds.count("full_attention"), conv_state=linear * math.prod(conv),
                recurrent_state=linear * math.prod(recurrent))


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a transformer that the estimate needs."""

    params: int
    layers: int
    hidden: int
    intermediate: int
    kv_dim: int
    vocab: int
    largest_param: int
    active_params: int | None = None  # a mixture of experts' parameters one token uses (None: all of them)
    top_k: int = 0  # experts per token (0: dense)
    experts: int = 0
    # a hybrid linear-attention model (Qwen3.5: `layer_types`): the layers that keep K/V (None: all of them), and
    # per sequence its linear layers' conv states (elements, in the compute dtype) and recurrent states (fp32
    # elements), which the rollout engine keeps per slot beside the K/V (`recurrent_state.StateCache`)
    attention_layers: int | None = None
    conv_state: int = 0
    recurrent_state: int = 0

    @classmethod
    def from_config(cls, config: Any, head: str = "lm", trust_remote_code: bool = False,
                    images: bool = False) -> ModelShape:
        """From a Hugging Face config; parameters counted on the meta device (no memory, exact). `head`:
        ``"lm"`` (a causal LM) or ``"value"`` (the backbone and a one-output score head, as the critic and
        reward models are, whatever classification class an architecture has); `images`: the run's prompts carry
        images (a Qwen3.5 checkpoint then counts its tower: `lm_class.TEXT_FIRST_FAMILIES`)."""
        from transformers import AutoModel

        from hybridflow.utils.lm_class import lm_auto_class

        with torch.device("meta"):
            auto = lm_auto_class(config, images) if head == "lm" else AutoModel
            model = auto.from_config(config, trust_remote_code=trust_remote_code)
        numels = [p.numel() for p in model.parameters()]  # a vision-language model's vision tower included
        config = config.get_text_config()  # the language model's shape (a text model's config is its own)
        if head != "lm":
            numels.append(config.hidden_size + 1)  # the score head (weight and bias)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        spec, params = moe_spec(config), sum(numels)
        moe = {}
        if spec is not None:
            idle = len(spec.sparse_layers) * (spec.num_experts - spec.top_k) * 3 * config.hidden_size \
                * spec.expert_intermediate
            dense = spec.dense_intermediate if len(spec.sparse_layers) < config.num_hidden_layers else 0
            moe = dict(intermediate=max(spec.active_mlp_width(), dense), active_params=params - idle,
                       top_k=spec.top_k, experts=spec.num_experts)
        return cls(**{**dict(params=params, layers=config.num_hidden_layers, hidden=config.hidden_size,
                             intermediate=config.intermediate_size, kv_dim=kv * head_dim, vocab=config.vocab_size,
                             largest_param=max(numels)), **moe, **_linear_attention(config)})

    @property
    def compute_params(self) -> int:
        """The parameters a token runs through: all of them, or a mixture of experts' active ones."""
        return self.params if self.active_params is None else self.active_params

    def describe(self) -> str:
        active = "" if self.active_params is None else \
            f", {count(self.active_params)} active: {self.top_k} of {self.experts} experts"
        return (f"{count(self.params)} parameters ({self.layers} layers, hidden {self.hidden}, "
                f"vocabulary {self.vocab:,}{active})")

    def layer_params(self) -> int:
        """Weights of one decoder layer's projections (attention and MLP)."""
        return layer_params(self.hidden, self.kv_dim, self.intermediate)

    def host_bound_tokens(self) -> int:
        """The checkpointed micro-batch of a host-bound model: `CHECKPOINTED_TARGET_TOKENS` scaled up by how
        much smaller its layers are than the 0.5B shape's, where that was measured best (the numbers:
        docs/benchmarks.md, "Measurements behind choices in the code")."""
        scaled = CHECKPOINTED_TARGET_TOKENS * REFERENCE_LAYER_PARAMS // max(self.layer_params(), 1)
        return min(MAX_CHECKPOINTED_TOKENS, max(CHECKPOINTED_TARGET_TOKENS, scaled))

    def layer_activation_bytes(self, c: int) -> int:
        """Bytes per token one layer keeps for its backward (a sparse layer: also its gathered expert rows and
        the router's fp32 probabilities)."""
        routed = c * 2 * self.top_k * self.hidden + 8 * self.experts
        return c * (7 * self.hidden + 2 * self.kv_dim + 4 * self.intermediate) + routed

    def activation_bytes(self, c: int, checkpointing: bool) -> int:
        """Bytes per micro-batch token of a training forward kept until its backward."""
        stream = 2 * c * self.hidden  # final norm's input and output for the head
        if checkpointing:
            return self.layers * c * self.hidden + self.layer_activation_bytes(c) + stream
        return self.layers * self.layer_activation_bytes(c) + stream


@dataclass(frozen=True)
class TrainedRole:
    """A role this device trains. `keys`: its config section (``actor``); `model_keys`: its model's
    (``model`` or ``critic.model``). None for `gradient_checkpointing` / `max_tokens` / `optimizer_offload`, and
    ``auto`` for `optimizer`, = decide here;
    `lora_params`: the parameters a LoRA role trains (None: every parameter)."""

    keys: str
    model_keys: str
    shape: ModelShape
    compute_bytes: int
    master_bytes: int
    optimizer: str = "adamw"
    param_offload: bool = False
    optimizer_offload: bool | None = False  # None: decide here
    gradient_checkpointing: bool | None = None
    max_tokens: int | None = None
    micro_batch_rows: int | None = None
    lora_params: int | None = None
    expert_lora_params: int = 0  # the stacked expert weights LoRA adapts (`lora.target_parameters`), all layers
    quantized_params: int = 0  # frozen weights stored in 4 bits (`model.quantization=nf4`: the adapted linear layers')
    largest_quantized: int = 0  # the largest of them, which a forward dequantizes at a time

    @property
    def trained_params(self) -> int:
        return self.shape.params if self.lora_params is None else self.lora_params

    def weight_bytes(self, world: int) -> float:
        """Stored weights: trained ones in the master dtype, a LoRA role's frozen ones in the compute dtype (or, the
        quantized ones, `NF4_BYTES`)."""
        t, q = self.trained_params, self.quantized_params
        frozen = (self.shape.params - t - q) * self.compute_bytes + q * NF4_BYTES
        return (t * self.master_bytes + frozen) / world

    def update_bytes(self, world: int) -> dict[str, float]:
        p, t, m = self.shape.params, self.trained_params, self.master_bytes
        out = {"weights": self.weight_bytes(world), "gradients": t * m / world,
               "optimizer state": t * STATE_BYTES[self.optimizer](m) / world}
        if self.compute_bytes != m and (self.lora_params is None or world > 1):
            gathered = p if world == 1 else 2 * p / self.shape.layers
            out["gathered compute-dtype weights"] = gathered * self.compute_bytes
        if self.quantized_params:  # a 4-bit weight dequantized for its forward, and again for its backward
            out["dequantized weight"] = 2 * self.largest_quantized * self.compute_bytes
        if self.optimizer == "adamw_8bit":  # one parameter's dequantised moments during its update
            largest = self.shape.largest_param if self.lora_params is None else t / self.shape.layers
            out["optimizer workspace"] = 2 * 4 * largest / world
        return out

    def forward_fixed_bytes(self, checkpointing: bool) -> float:
        """What a forward keeps whatever its tokens: the merged W + B·A of the adapted expert weights, every
        layer's (kept for the backward), or with checkpointing one layer's, recomputed with its gradient."""
        per_layer = self.expert_lora_params * self.compute_bytes / self.shape.layers
        return 2 * per_layer if checkpointing else self.expert_lora_params * self.compute_bytes + per_layer

    def activation_peak(self, tokens: int, checkpointing: bool) -> float:
        """Activations of a `tokens`-token micro-batch, and one chunk of the log-prob head."""
        return (tokens * self.shape.activation_bytes(self.compute_bytes, checkpointing) + HEAD_CHUNK_BYTES
                + self.forward_fixed_bytes(checkpointing))

    def idle_bytes(self, world: int) -> float:
        weights = 0 if self.param_offload else self.weight_bytes(world)
        state_bytes = STATE_BYTES[self.optimizer](self.master_bytes)
        state = 0 if self.optimizer_offload else self.trained_params * state_bytes / world
        return weights + state


@dataclass(frozen=True)
class FrozenRole:
    """A frozen model (reference, reward model): weights in the compute dtype, on the device unless
    offloaded; `offload_key` is the config key that offloads it (None if none does)."""

    offload_key: str | None
    shape: ModelShape
    compute_bytes: int
    offload: bool = False

    def idle_bytes(self, world: int) -> float:
        return 0 if self.offload else self.shape.params * self.compute_bytes / world


@dataclass(frozen=True)
class RolloutRole:
    """The rollout engine on this device. `kv_cache_fraction`: the user's fixed share of free memory
    (None = what the plan leaves)."""

    shape: ModelShape
    compute_bytes: int
    max_num_seqs: int
    max_model_len: int
    max_prefill_tokens: int = 16384  # the engine's MAX_PREFILL_TOKENS; the plan may choose fewer (`PREFILL_CHOICES`)
    offload_weights: bool | None = False  # None: decide here
    cache_stays: bool = False
    kv_cache_fraction: float | None = None
    shared_params: int = 0  # a colocated LoRA trainer's frozen weights the engine holds instead of copies
    fp8: bool = False  # the decoder layers' projections in FP8 (`rollout.quantization=fp8`, engine/rollout/fp8.py)
    min_seqs: int = 1  # sequences that must run at once: a prompt's n samples are admitted together (`rollout.n`)
    # the vision engine's prefill (`vision_engine`): a transformers forward that keeps its own K/V of the padded
    # prompts until they are copied into the slots, beside the activations
    prefill_keeps_cache: bool = False

    @property
    def weight_bytes(self) -> int:
        """Its own weights: the model less the shared ones in the compute dtype, or with FP8 the projections (never
        shared: they are the engine's FP8 copies) in a byte each and an fp32 scale per output row."""
        if not self.fp8:
            return (self.shape.params - self.shared_params) * self.compute_bytes
        s = self.shape
        projections = s.layers * s.layer_params()
        rows = s.layers * (3 * s.hidden + 2 * s.kv_dim + 2 * s.intermediate)  # q, k, v, o, gate, up, down
        rest = s.params - self.shared_params - projections
        return rest * self.compute_bytes + projections + 4 * rows

    def kv_bytes_per_token(self) -> int:
        s = self.shape
        return 2 * (s.layers if s.attention_layers is None else s.attention_layers) * s.kv_dim * self.compute_bytes

    def kv_bytes_per_seq(self) -> int:
        """One slot: `max_model_len` tokens of K/V, and a hybrid model's linear layers' states."""
        s = self.shape
        return self.max_model_len * self.kv_bytes_per_token() + s.conv_state * self.compute_bytes \
            + 4 * s.recurrent_state

    def workspace_bytes(self, seqs: int | None = None) -> int:
        """Prefill activations of one packed forward, and fp32 logits + sampling temporaries of a decode step over
        `seqs` running sequences (None: `max_num_seqs`). A forward packs `max_prefill_tokens`, or holds one longer
        sequence alone: a sample prefilled again with its tokens so far (partial rollouts) may be `max_model_len`
        long. The vision engine's prefill holds its forward's own K/V of those tokens too."""
        s = self.shape
        per_token = 4 * s.hidden + 3 * s.intermediate + 2 * s.top_k * s.hidden
        per_token += self.kv_bytes_per_token() // self.compute_bytes if self.prefill_keeps_cache else 0
        tokens = max(self.max_prefill_tokens, self.max_model_len)
        running = self.max_num_seqs if seqs is None else seqs
        return tokens * self.compute_bytes * per_token + running * self.logits_bytes_per_seq()

    def logits_bytes_per_seq(self) -> int:
        """A running sequence's share of a decode step's fp32 logits and sampling temporaries."""
        return 4 * 4 * self.shape.vocab


@dataclass(frozen=True)
class DeviceDemand:
    """Everything one device of a worker group holds (the same on each of its `world_size` devices)."""

    trained: tuple[TrainedRole, ...] = ()
    frozen: tuple[FrozenRole, ...] = ()
    rollout: RolloutRole | None = None
    world_size: int = 1
    longest_sequence: int = 1
    utilization: float = 0.9
    memory_cap: int | None = None  # bytes the run may use per device (`trainer.device_memory_gib`); None: the card

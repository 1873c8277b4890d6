"""`torch.compile` of a training model, one decoder layer at a time (torchtitan's per-block compile).

A micro-batched update runs the same layers many times on smaller inputs; run eagerly, each layer is
dozens of kernel launches and Python calls, and at 16k tokens per micro-batch the host, not the GPU,
sets the pace. Compiling each decoder layer's `forward` fuses its elementwise work (rotary, SwiGLU,
residual adds, casts) into a few kernels behind one call. Only `forward` is compiled: module hooks
(FSDP2's unshard / reshard / reduce-scatter) stay eager around it, parameter names do not change, and
every layer shares one compiled graph (they run the same code). Shapes are dynamic, so the token
count of a packed micro-batch does not trigger a recompile. The log-prob head's per-chunk arithmetic is
compiled too (`LogProbHead.compiled`).

A vision-language model's vision blocks stay eager: they share the decoder layers' code object (transformers'
`forward_with_checkpointing`) with other argument ranks and None-ness, so each kind added cache entries to the
other's, and Qwen's vision attention splits by per-image lengths read from the data (a graph break dynamo cannot
resume from); the tower runs once per image a pass, where the language model runs per token.

`resolve_compile(setting, device)`: the config's `model.compile` (None = on for CUDA, off elsewhere: on
a CPU, compiling costs more than it saves for the small models run there).
"""

from __future__ import annotations

import torch
import torch.fx.experimental._config

from hybridflow.engine.train.head import LogProbHead
from hybridflow.engine.train.model import decoder_layers
from hybridflow.engine.train.vision_forward import vision_tower

# every layer shares the code object of its class's forward; guards that differ between them (or
# between train / eval / no-grad calls) add cache entries, and the default limit of 8 would send the
# rest back to eager silently
RECOMPILE_LIMIT = 64


def resolve_compile(setting: bool | None, device: torch.device) -> bool:
    """`model.compile`: None -> on for a CUDA device."""
    return device.type == "cuda" if setting is None else bool(setting)


def compile_model(model: torch.nn.Module, backend: str = "inductor") -> int:
    """Compile each decoder layer's forward (after sharding; not a vision tower's blocks) and the log-prob head's chunk
    arithmetic; returns how many layers were compiled."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, RECOMPILE_LIMIT)
    # input sizes that happen to be equal in the first call (a micro-batch of 64 tokens and a head_dim of 64)
    # would otherwise share one symbol: a graph specialised on a coincidence, recompiled when it ends
    torch.fx.experimental._config.use_duck_shape = False
    tower = vision_tower(model)
    inside = {id(m) for m in model.get_submodule(tower).modules()} if tower is not None else set()
    layers = [layer for layer in decoder_layers(model) if id(layer) not in inside]
    for layer in layers:
        layer.forward = torch.compile(layer.forward, backend=backend, dynamic=True)
    for module in model.modules():
        if isinstance(module, LogProbHead):
            module.compiled = backend == "inductor"
    return len(layers)

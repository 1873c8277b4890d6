"""The rollout (generation) engine: `RolloutEngine`, `SamplingParams`, `Completion`.

Modules: `types` (request/response types), `sequence` (running-row state), `scheduler` (continuous
batching), `kv_cache` (slot-layout cache), `model` (fast Llama/Qwen2/Qwen3/Mistral decoder),
`attention` (kernels), `sampler` (token + log-prob), `cuda_graphs` (decode capture), `engine` (the
loop, weight sync, sleep/wake), `hf_fallback` (`transformers.generate` for other architectures).
"""

from hybridflow.engine.rollout.engine import RolloutEngine
from hybridflow.engine.rollout.hf_fallback import HFRolloutEngine
from hybridflow.engine.rollout.types import Completion, SamplingParams

__all__ = ["Completion", "HFRolloutEngine", "RolloutEngine", "SamplingParams"]

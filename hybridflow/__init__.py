"""hybridflow: reinforcement-learning post-training of language models.

One controller process writes the RL dataflow as plain Python; each model role (actor, rollout,
reference, critic, reward model) runs as an SPMD worker group. See docs/ for the architecture.

Importing the package makes PyTorch's CUDA allocator grow its segments in place
(`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`) unless the variable is already set: the update's
micro-batches, the rollout's KV cache and the phases in between allocate blocks of changing sizes, and
with fixed segments the cached but unusable remainder cost 11 GiB of device memory in a 0.5B GRPO step
(docs/training_engine.md, "Memory options"). It must be set before CUDA starts, which importing
hybridflow precedes in every entry point and worker process.

It also drops two library log lines no user can act on: torchao's failures to load its CUDA kernels on a
machine without CUDA, and PyTorch's deprecation notice about how torchao registers its enums
(`hybridflow.utils.library_noise`).
"""

import os

from hybridflow.utils import library_noise

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
library_noise.install()

__version__ = "0.1.0"

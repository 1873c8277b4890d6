"""The fork server tests start their own ranks from (`train_helpers.run_ranks`, the FSDP2 ranks of
`test_checkpoint_reshard.py`): a clean process (exec'd, not forked from the test's) that has imported what every
rank imports once (`PRELOAD`: ~1.5 s of transformers and hybridflow a rank would import after its fork), so a rank
starts in a fraction of a second and inherits no state of the test's process (a default process group, a CUDA
context). One per test process (multiprocessing keeps it), started by the first test that asks.
"""

from __future__ import annotations

import torch.multiprocessing as mp

PRELOAD = ["torch", "hybridflow.engine.train", "transformers.modeling_utils", "transformers.models.qwen2.modeling_qwen2",
           "hybridflow.workers"]


def forkserver_context():
    """multiprocessing's forkserver context, its server preloading `PRELOAD` (when this call is before its start)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx

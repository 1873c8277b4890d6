"""Batch-invariant kernels: the arithmetic both engines run in exact mode (`rollout.exact`).

Every op computes an output row from its own inputs alone, in one fixed order, whatever the batch size:
GEMMs with no split-K and tilings measured not to change a bit (`tiles`), RMSNorm and log-softmax with
a fixed reduction order, attention that sums each query's keys from position 0 in fixed blocks whether it
runs as a prefill, a cached decode step or the trainer's packed forward, and one rotary table. The rollout
engine (`hybridflow.engine.rollout.model`) and the training engine (`hybridflow.engine.train.exact`) both
call these, so a sampled token's log-prob equals, bit for bit, the trainer's for the same sequence
(docs/exact.md). Triton kernels on CUDA (`triton_gemm`, `triton_rows`, `triton_attention`); their PyTorch
twins elsewhere (`torch_ops`). `scope` says which models they cover.
"""

from hybridflow.engine.invariant.ops import (add_rms_norm, add_rms_norm_holds, attention, attention_table,
                                             inverse_temperature, linear, rms_norm, rope_table, rotary, rotary_store,
                                             silu_mul, token_log_probs)
from hybridflow.engine.invariant.scope import ARCHITECTURES, unsupported

__all__ = ["ARCHITECTURES", "add_rms_norm", "add_rms_norm_holds", "attention", "attention_table", "inverse_temperature",
           "linear", "rms_norm", "rope_table", "rotary", "rotary_store", "silu_mul", "token_log_probs", "unsupported"]

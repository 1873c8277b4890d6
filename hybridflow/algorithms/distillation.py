"""On-policy distillation's dense advantage: the per-token reverse KL to a teacher, on the student's own samples.

The student samples a response; the teacher scores each sampled token. With s_t = log π_student(y_t | y_<t) and
τ_t = log π_teacher(y_t | y_<t), s_t − τ_t is a one-sample estimate of the per-token reverse KL
KL(π_student ‖ π_teacher) (the k1 estimator of `kl`). Its negation, times `coef`, is each token's advantage:
a token the teacher finds likelier than the student does is reinforced, one it finds unlikelier is pushed
down, and the policy-gradient loss on these advantages lowers the reverse KL (Gu et al. 2023, MiniLLM,
arXiv:2306.08543; Agarwal et al. 2024, GKD, arXiv:2306.13649). No discounting: each token is credited with its
own term, as in Thinking Machines' on-policy distillation (2025).
"""

from __future__ import annotations

import torch

from hybridflow.algorithms.utils import check_shapes


def distillation_advantages(logp: torch.Tensor, teacher_logp: torch.Tensor, response_mask: torch.Tensor,
                            coef: float = 1.0) -> torch.Tensor:
    """`[batch, R]`: −coef · (logp − teacher_logp) on real response tokens, 0 after the response ends.
    `logp`: the student's log-probs of its sampled tokens (the rollout's, or the actor's before the update)."""
    check_shapes("logp", logp=logp, teacher_logp=teacher_logp, response_mask=response_mask)
    return -coef * (logp - teacher_logp) * response_mask

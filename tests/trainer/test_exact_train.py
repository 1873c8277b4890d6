"""`hybridflow train rollout.exact=true` on the tiny model: every step the rollout's log-probs equal the
update's first forward bit for bit (max |Δ log-prob| and k3 exactly 0), the old-log-prob pass is skipped
even with two optimizer steps per batch, and weight syncs (full and LoRA's merged weights, two FSDP2 ranks in fp32 and
in bf16, a separate rollout group) keep it exact."""

from __future__ import annotations

import pytest

from rl_helpers import reward_file, run


TWO_RANKS = ("trainer.n_workers=2", "actor.mini_batch_size=2")


@pytest.mark.parametrize("extra", [
    (), ("actor.lora.rank=4", "actor.lr=1e-2"), TWO_RANKS, ("rollout.placement=separate",),
    (*TWO_RANKS, "actor.lora.rank=4", "actor.lr=1e-2", "model.dtype=bf16"),
], ids=["full", "lora", "two_ranks", "separate", "lora_two_ranks_bf16"])
def test_exact_run_has_zero_mismatch_and_no_old_log_prob_pass(tiny_qwen2, data_dir, tmp_path, extra):
    # two_ranks: FSDP2 shards the trainer (a mini-batch per rank) and each rank's colocated engine gets the
    # gathered weights; separate: the rollout runs in its own process group, fed by the weight sync;
    # lora_two_ranks_bf16: FSDP2's mixed precision rounds the adapters to bf16 for the forward's merge, and the
    # sync's merge rounds them alike
    rows = run(tiny_qwen2, data_dir, tmp_path / "out", "rollout.exact=true", "trainer.total_steps=3",
               "actor.mini_batch_size=1", "trainer.val_before_train=false", "trainer.val_every=0",
               f"reward.function={reward_file(tmp_path)}", *extra)
    assert len(rows) == 3
    for row in rows:
        assert row["rollout_corr/max_abs_logp_diff"] == 0.0 and row["rollout_corr/k3_kl"] == 0.0
        assert row["training/rollout_probs_diff_max"] == 0.0
        assert "timing_s/old_log_prob" not in row
        assert row["actor/grad_norm"] > 0  # the weights move, so later steps check the synced weights


def test_exact_run_fails_loudly_when_the_engines_differ(tiny_qwen2, data_dir, tmp_path, monkeypatch):
    """The check compares for real: a rollout engine built without the invariant kernels (the trainer keeps
    them) ends the run at the first update."""
    from hybridflow.engine.rollout import RolloutEngine

    default = RolloutEngine.from_pretrained.__func__
    monkeypatch.setattr(RolloutEngine, "from_pretrained",
                        classmethod(lambda cls, *args, **kw: default(cls, *args, **{**kw, "exact": False})))
    with pytest.raises(RuntimeError, match="differ from the trainer's first forward of the update"):
        run(tiny_qwen2, data_dir, tmp_path / "out", "rollout.exact=true", "trainer.total_steps=1",
            "trainer.val_before_train=false", "trainer.val_every=0")

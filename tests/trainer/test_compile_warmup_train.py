"""`model.compile_warmup=true` end to end: a GRPO run on the tiny model with compiled layers trains while the
warm-up subprocess compiles, reports `perf/compiled/actor` every step, and leaves no warm-up (the actor's, the reference's) behind."""

from __future__ import annotations

import gc
import math

from hybridflow.engine.train import warmup
from rl_helpers import run


def test_a_run_with_the_compile_warm_up_trains_and_ends_it(tiny_qwen2, data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    started = []  # (process, folder) of each warm-up: holding the warm-ups themselves would keep them alive
    start = warmup.CompileWarmup.start

    def record(spec):
        w = start(spec)
        started.append((w.proc, w.folder))
        return w

    monkeypatch.setattr(warmup.CompileWarmup, "start", staticmethod(record))
    rows = run(tiny_qwen2, data_dir, tmp_path / "run", "model.compile=true", "model.compile_warmup=true",
               "trainer.val_every=0", "trainer.val_before_train=false")
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["actor/pg_loss"]) and r["perf/compiled/actor"] in (0.0, 1.0) for r in steps)
    assert len(started) == 2  # the actor's and the reference model's
    gc.collect()  # the run's engines are gone: their warm-ups ended with them
    assert all(proc.poll() is not None and not folder.exists() for proc, folder in started)

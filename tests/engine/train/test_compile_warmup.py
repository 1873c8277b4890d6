"""The background compile warm-up (`warmup.py`) on a CPU with inductor: updates start eager, switch to compiled
layers once the warm-up subprocess has ended and their compilation then hits the on-disk cache it filled,
with the log-probs and the update of eager layers; a warm-up that fails is reported and the engine compiles
in-process; the config's checks and the stand-in model directory."""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache
from train_helpers import model_cfg, optim_cfg, rl_batch

from hybridflow.engine.train import TrainEngine
from hybridflow.engine.train import warmup as warmup_lib
from hybridflow.engine.train.warmup import resolve_warmup, stand_in

CPU = torch.device("cpu")


def loss_fn(out, mb, ctx):
    """log-probs and an entropy bonus (the update's two backward graphs of the head), token-mean."""
    mask = mb["response_mask"]
    return ((out["log_probs"] - 0.01 * out["entropy"]) * mask).sum() / ctx.global_tokens, {}


def _wait(engine: TrainEngine, timeout: float = 300.0) -> None:
    """Block until the engine's warm-up subprocess has ended (a test's shortcut: the engine never waits)."""
    deadline = time.monotonic() + timeout
    while engine.warmup.proc.poll() is None:
        assert time.monotonic() < deadline, "the warm-up did not end in time"
        time.sleep(0.2)


@pytest.fixture
def fresh_compile():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def test_updates_start_eager_then_switch_to_compiled_layers_that_hit_the_warm_cache(tiny_qwen2, tmp_path,
                                                                                  fresh_compile):
    batch = rl_batch(rows=4, prompt_width=7, response_width=9, seed=1)
    with fresh_cache(dir=str(tmp_path)):
        engine = TrainEngine(model_cfg(tiny_qwen2, compile=True, compile_warmup=True), optim_cfg(), device=CPU)
        assert not engine.compiled and engine.warmup is not None
        eager = engine.infer(batch, temperature=0.9, with_entropy=True)  # runs while the warm-up compiles
        assert engine.compile_metrics() == {"compiled": 0.0}
        _wait(engine)
        counters.clear()
        compiled = engine.infer(batch, temperature=0.9, with_entropy=True)  # the switch
        step = engine.train_step(batch, loss_fn, temperature=0.9, with_entropy=True)
        hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
    assert engine.compiled and engine.warmup is None
    metrics = engine.compile_metrics()
    assert metrics["compiled"] == 1.0 and metrics["compile_warmup_s"] > 0
    # every graph the switch compiled (layer and head, no-grad and forward + backward) came from the cache
    assert hits >= 4 and misses == 0, dict(counters["inductor"])
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(compiled[key], eager[key], rtol=1e-4, atol=1e-5)

    reference = TrainEngine(model_cfg(tiny_qwen2, compile=False), optim_cfg(), device=CPU)
    expected = reference.train_step(batch, loss_fn, temperature=0.9, with_entropy=True)
    assert step["loss"] == pytest.approx(expected["loss"], rel=1e-4)
    assert step["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-3)


def test_a_failed_warm_up_is_reported_and_the_engine_compiles_in_process(tiny_qwen2, tmp_path, monkeypatch,
                                                                         fresh_compile):
    batch = rl_batch(rows=3, prompt_width=5, response_width=6, seed=2)
    # the subprocess looks for its spec under the real name and fails on start
    monkeypatch.setattr(warmup_lib, "SPEC", "elsewhere.pkl")
    with fresh_cache(dir=str(tmp_path)):
        engine = TrainEngine(model_cfg(tiny_qwen2, compile=True, compile_warmup=True), optim_cfg(), device=CPU)
        _wait(engine, timeout=60)
        with pytest.warns(RuntimeWarning, match=r"(?s)warm-up failed \(exit status 1.*FileNotFoundError"):
            step = engine.train_step(batch, loss_fn, with_entropy=True)
    assert engine.compiled and engine.compile_metrics()["compiled"] == 1.0
    assert torch.isfinite(torch.tensor(step["loss"])) and step["stepped"] == 1.0


def test_close_ends_a_running_warm_up(tiny_qwen2):
    engine = TrainEngine(model_cfg(tiny_qwen2, compile=True, compile_warmup=True), optim_cfg(), device=CPU)
    proc, folder = engine.warmup.proc, engine.warmup.folder
    engine.close()
    assert proc.poll() is not None and not folder.exists() and engine.warmup is None


def test_the_refusals():
    assert not resolve_warmup(False, True, 1) and resolve_warmup(True, True, 1)
    with pytest.raises(ValueError, match="model.compile_warmup=true needs compiled layers"):
        resolve_warmup(True, False, 1)
    with pytest.raises(ValueError, match="needs a single-rank engine \\(this one has 2 ranks"):
        resolve_warmup(True, True, 2)


def test_the_stand_in_is_the_model_with_fewer_layers(tiny_model_factory, tmp_path):
    from transformers import AutoConfig

    path = tiny_model_factory("qwen2", layers=3)
    out = stand_in(str(path), 1, tmp_path)
    config, original = AutoConfig.from_pretrained(out), AutoConfig.from_pretrained(path)
    assert config.num_hidden_layers == 1 and config.hidden_size == original.hidden_size
    assert len(getattr(config, "layer_types", None) or [None]) == 1
    assert (out / "model.safetensors").resolve() == (path / "model.safetensors").resolve()
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 3

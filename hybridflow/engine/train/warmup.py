"""Compiling in the background: a subprocess fills torch.compile's on-disk caches while the engine trains eagerly.

Compiling the decoder layers and the log-prob head (`compile.py`) at their first use stalls the first
update for as long as inductor generates and builds code (33 s of a 35 s first GRPO step with SmolLM2-135M on
an H200), and until then the weights are the initial ones. Most of that is code generation, which inductor
caches on disk (its FX graph cache and AOTAutograd's cache, under `TORCHINDUCTOR_CACHE_DIR`): a second
process compiling the same graphs finds them there and compiles in a fraction of the time.

`CompileWarmup.start(spec)` launches a Python subprocess running `main` — a `TrainEngine` with
compilation on, built like the caller's (same model config, dtype and master dtype, autocast or FSDP2 on one
rank, LoRA, gradient checkpointing, head, packing) but on a stand-in of the model with 1 decoder layer (2
with LoRA, whose first layer has an input without gradient), which runs the passes an RL step runs on a
small random batch: no-grad log-probs with and without entropy (with LoRA also with the adapters off),
forward + backward with and without an entropy term (a critic: values). Every layer runs the same code, so
these are the graphs the caller's layers compile; their compilation, once the warm-up has ended, hits the
caches. The caller polls (`poll()`, never blocking) at step boundaries; a warm-up that fails is reported
once, and the caller compiles in-process as it would have without it. The subprocess shares the caller's
inductor cache directory, runs in its own session (a Ctrl-C of the run does not reach it) and ends with
the caller: `close()`, the caller's exit or garbage collection kill it, and it exits by itself when its
parent is gone.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

SPEC = "spec.pkl"
LOG = "warmup.log"
# rows, prompt and response width of the warm-up batch: sizes > 1 (0/1 are specialised) that differ from
# each other (equal sizes would share one symbol), rows of varying length (padded rows get a mask)
ROWS, PROMPT, RESPONSE = 3, 11, 13
TEMPERATURE = 0.7  # a float argument stays symbolic: any sampling temperature reuses the graphs


def resolve_warmup(setting: bool, compiled: bool, world_size: int) -> bool:
    """`model.compile_warmup` (off by default: docs/training_engine.md has the H200 measurements). Refuses it
    where it cannot run (compilation off, several ranks)."""
    if setting and not compiled:
        raise ValueError("model.compile_warmup=true needs compiled layers: set model.compile=true (or null on "
                         "CUDA), or model.compile_warmup=false")
    if setting and world_size > 1:
        raise ValueError(f"model.compile_warmup=true needs a single-rank engine (this one has {world_size} ranks, "
                         f"whose FSDP2 graphs the warm-up does not reproduce); use model.compile_warmup=false")
    return bool(setting)


@dataclass
class WarmupSpec:
    """What the subprocess needs to build the caller's engine again: its constructor's arguments, the
    stand-in's layer count, the backend of the caller's one-rank process group (None: no group) and its
    intra-op threads (a CPU kernel is generated for a thread count)."""

    model_cfg: Any
    optim_cfg: Any | None
    head: str
    device: str
    pack_on_cpu: bool
    layers: int
    backend: str | None
    threads: int


class CompileWarmup:
    """The running warm-up subprocess of one engine."""

    def __init__(self, proc: subprocess.Popen, folder: Path) -> None:
        self.proc, self.folder = proc, folder
        self.started = time.perf_counter()
        self.seconds: float | None = None  # how long it ran, once it has ended
        self._finalizer = weakref.finalize(self, _end, proc, str(folder))

    @classmethod
    def start(cls, spec: WarmupSpec) -> CompileWarmup:
        """Write `spec` to a fresh folder and launch the subprocess on it, sharing this process's inductor cache."""
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        folder = Path(tempfile.mkdtemp(prefix="hybridflow-warmup-"))
        with open(folder / SPEC, "wb") as f:
            pickle.dump(spec, f)
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir(), HYBRIDFLOW_WARMUP_PARENT=str(os.getpid()))
        with open(folder / LOG, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-c", f"import sys; from {__name__} import main; "
                                     f"main(sys.argv[1])", str(folder)], stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        return cls(proc, folder)

    def poll(self) -> bool | None:
        """None while it runs; True once it has succeeded; False once it has failed (its log's tail is in
        `failure`)."""
        code = self.proc.poll()
        if code is None:
            return None
        if self.seconds is None:
            self.seconds = time.perf_counter() - self.started
            self.failure = None if code == 0 else _tail(self.folder / LOG, code)
            self.close()
        return self.failure is None

    def close(self) -> None:
        """Kill the subprocess if it still runs and remove its folder."""
        self._finalizer()


def _end(proc: subprocess.Popen, folder: str) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    shutil.rmtree(folder, ignore_errors=True)


def _tail(log: Path, code: int, lines: int = 15) -> str:
    text = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
    return f"exit status {code}; its last output:\n" + "\n".join(text[-lines:])


# ---------------------------------------------------------------------------------------------- subprocess
def stand_in(path: str, layers: int, folder: Path) -> Path:
    """A directory holding `path`'s model with its first `layers` decoder layers: its config.json with that
    layer count, links to every other file (the checkpoint's other layers' weights are not loaded)."""
    source = Path(path) if os.path.isdir(path) else Path(_snapshot(path))
    out = folder / "model"
    out.mkdir()
    for item in source.iterdir():
        if item.name != "config.json":
            (out / item.name).symlink_to(item.resolve())
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:layers]
    (out / "config.json").write_text(json.dumps(config))
    return out


def _snapshot(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id)


def random_batch(vocab: int, rows: int = ROWS, prompt: int = PROMPT, response: int = RESPONSE
                 ) -> dict[str, torch.Tensor]:
    """`rows` random rows of left-padded prompts and right-padded responses, row i `i` tokens shorter in the
    prompt and `2 i` in the response (each row needs one of each)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, prompt + response), generator=g)
    mask = torch.zeros(rows, prompt + response, dtype=torch.long)
    for i in range(rows):
        mask[i, min(i, prompt - 1):prompt + max(response - 2 * i, 1)] = 1
    return {"input_ids": ids, "attention_mask": mask, "responses": ids[:, prompt:],
            "response_mask": mask[:, prompt:].float(), "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}


def warm(engine: Any) -> None:
    """Run `engine` through every pass an RL step makes of it, so each of their graphs compiles."""
    batch = random_batch(engine.config.vocab_size)
    mask = batch["response_mask"].to(engine.device)
    variants = (False, True) if engine.head == "lm" else (False,)
    for with_entropy in variants:
        engine.infer(batch, temperature=TEMPERATURE, with_entropy=with_entropy)
    if engine.adapters is not None:
        with engine.adapters.disabled():
            engine.infer(batch, temperature=TEMPERATURE)
    if not engine.trainable:
        return
    for with_entropy in variants:
        out, _ = engine.forward(batch, TEMPERATURE, with_entropy)
        loss = sum((v * mask).sum() for v in out.values())  # with entropy: its backward too
        loss.backward()
        engine.optimizer.zero_grad(set_to_none=True)


def _watch_parent(folder: str) -> None:
    """Exit, removing the warm-up's folder, as soon as the process that started this one is gone."""
    parent = int(os.environ.get("HYBRIDFLOW_WARMUP_PARENT", os.getppid()))
    while os.getppid() == parent:
        time.sleep(0.5)
    shutil.rmtree(folder, ignore_errors=True)
    os._exit(1)


def main(folder: str) -> None:
    import torch.distributed as dist

    from hybridflow.engine.train.engine import TrainEngine

    threading.Thread(target=_watch_parent, args=(folder,), daemon=True).start()
    with open(Path(folder) / SPEC, "rb") as f:
        spec: WarmupSpec = pickle.load(f)
    torch.set_num_threads(spec.threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if spec.backend is not None:  # the caller's one-rank group: FSDP2 where it shards, as the caller does
        dist.init_process_group(spec.backend, store=dist.HashStore(), rank=0, world_size=1)
    path = str(stand_in(spec.model_cfg.path, spec.layers, Path(folder)))
    model_cfg = _with(spec.model_cfg, path=path, compile=True, compile_warmup=False)
    start = time.perf_counter()
    engine = TrainEngine(model_cfg, spec.optim_cfg, head=spec.head, device=device, pack_on_cpu=spec.pack_on_cpu)
    warm(engine)
    print(f"warm-up compiled in {time.perf_counter() - start:.1f} s", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def _with(cfg: Any, **changes: Any) -> Any:
    """`cfg` (a dataclass or a namespace) with `changes`."""
    if isinstance(cfg, SimpleNamespace):
        return SimpleNamespace(**{**vars(cfg), **changes})
    return replace(cfg, **changes)

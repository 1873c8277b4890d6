"""Test helpers: RL-shaped batches (left-padded prompts, right-padded responses) and gloo ranks."""

from __future__ import annotations

import io
import queue as queue_lib
import time
import traceback

import torch
import torch.distributed as dist

from hybridflow.config.model_schema import ModelConfig, OptimConfig
from hybridflow.controller.backends.process_start import fork_server_context


def rl_batch(rows: int, prompt_width: int, response_width: int, vocab: int = 200, seed: int = 0
             ) -> dict[str, torch.Tensor]:
    """Random token rows with varying prompt and response lengths, in the layout of docs/architecture.md."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.zeros(rows, prompt_width, dtype=torch.long)
    responses = torch.zeros(rows, response_width, dtype=torch.long)
    pmask = torch.zeros(rows, prompt_width, dtype=torch.long)
    rmask = torch.zeros(rows, response_width, dtype=torch.long)
    for i in range(rows):
        p = int(torch.randint(1, prompt_width + 1, (1,), generator=g))
        r = int(torch.randint(1, response_width + 1, (1,), generator=g))
        prompts[i, prompt_width - p:] = torch.randint(4, vocab, (p,), generator=g)
        pmask[i, prompt_width - p:] = 1
        responses[i, :r] = torch.randint(4, vocab, (r,), generator=g)
        rmask[i, :r] = 1
    attention_mask = torch.cat([pmask, rmask], 1)
    return {
        "prompts": prompts, "responses": responses,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "response_mask": rmask.float(),
    }


def model_cfg(path, **kw) -> ModelConfig:
    return ModelConfig(**{"path": str(path), "dtype": "fp32", "gradient_checkpointing": False, **kw})


def optim_cfg(**kw) -> OptimConfig:
    return OptimConfig(**{"lr": 1e-3, "weight_decay": 0.0, **kw})


def _entry(rank: int, world: int, port: int, fn, args, queue) -> None:
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        buf = io.BytesIO()
        torch.save(fn(rank, *args), buf)  # plain bytes: tensors must outlive this process
        queue.put((rank, buf.getvalue(), None))
    except Exception:  # the parent re-raises it with the traceback
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn, *args, timeout: float = 300.0) -> list:
    """`fn(rank, *args)` on `world` processes in one gloo group; their results by rank.

    Children come from the local backend's fork server (a clean process that has imported torch, transformers and
    hybridflow's engine and workers once: `process_start`), so each start costs a fraction of a second, and no state of this process — such as the default process group an
    inline worker group made — leaks into them (a plain fork inherits it and cannot join a new group).
    A child that dies without reporting (a crash, a signal) fails the call with its exit code at once.
    """
    ctx = fork_server_context()
    queue = ctx.Queue()
    # The parent holds the store on a port it bound itself, as the local backend does: a port probed free and
    # released could be taken by another xdist worker before rank 0 listened on it (CI met EADDRINUSE so).
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    port = store.port
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            try:
                rank, value, error = queue.get(timeout=1.0)
            except queue_lib.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"ranks died without a result (rank, exit code): {dead}" if dead
                                       else f"no result from every rank within {timeout:.0f} s") from None
                continue
            if error:
                raise RuntimeError(f"rank {rank} failed:\n{error}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            if p.is_alive() and len(results) < world:
                p.kill()
            p.join()
    return [results[r] for r in range(world)]

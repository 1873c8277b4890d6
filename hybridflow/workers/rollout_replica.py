"""A rank's rollout engine and the `generate` call around it, shared by the actor (engine colocated with
the trainer) and `RolloutWorker` (engine on its own device): building the engine from its typed config
(`RolloutReplica.Config`, made on the controller), its sleep/wake policy, a call's sampling seed,
multi-turn episodes through `hybridflow.agents` when the config carries an `agent` section, and turning the
completions or trajectories into the RL batch layout of docs/architecture.md."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from hybridflow.agents.episodes import build_episodes
from hybridflow.agents.trajectory import STAT_FIELDS
from hybridflow.batch import Batch
from hybridflow.config.schema import AgentConfig, RolloutConfig
from hybridflow.data.loader import PROMPT_FIELDS
from hybridflow.engine.contracts import RolloutEngineContract
from hybridflow.engine.rollout import RolloutEngine, SamplingParams

# the KV cache's share of free GPU memory when neither `rollout.kv_cache_fraction` nor a device plan sizes it
UNPLANNED_KV_FRACTION = 0.4


def build_rollout(path: str, rollout_cfg: RolloutConfig, device: torch.device, dtype: torch.dtype,
                  max_model_len: int, kv_cache_bytes: int | None = None, step_rows: int | None = None,
                  shared_weights: dict[str, torch.Tensor] | None = None) -> RolloutEngineContract:
    """The rollout engine of `rollout_cfg.engine` (auto | fast | hf) over the model at `path` (with the invariant
    kernels when `rollout_cfg.exact`), holding `shared_weights` (a colocated LoRA trainer's frozen ones) instead
    of copies (the fast engine). The KV cache
    on a GPU: `rollout.kv_cache_fraction` of the free memory if set, else `kv_cache_bytes` (the device
    plan's), else `UNPLANNED_KV_FRACTION`. On a CPU, where nothing plans the memory and the cache is
    zero-filled RAM, it holds at most `step_rows` sequences (the rows of one training step; more queue)."""
    kv: float | int | None = None
    max_num_seqs = cpu_max_num_seqs(rollout_cfg.max_num_seqs, step_rows) if device.type == "cpu" \
        else rollout_cfg.max_num_seqs
    if device.type == "cuda":
        kv = rollout_cfg.kv_cache_fraction
        if kv is None:
            kv = kv_cache_bytes if kv_cache_bytes is not None else UNPLANNED_KV_FRACTION
    return RolloutEngine.from_pretrained(
        path, device=device, dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        kv_cache_memory=kv, cuda_graphs=rollout_cfg.cuda_graphs, engine=rollout_cfg.engine, exact=rollout_cfg.exact,
        record_routes=rollout_cfg.record_routes, shared_weights=shared_weights)


def cpu_max_num_seqs(max_num_seqs: int, step_rows: int | None) -> int:
    """`rollout.max_num_seqs` on a CPU: at most a step's rows (`step_rows`; None = no bound)."""
    return max(1, min(max_num_seqs, step_rows)) if step_rows else max_num_seqs


def pad_token_id(config: Any) -> int:
    """The model config's pad id (0 when it has none): the fill of the responses' padding."""
    pad = getattr(config, "pad_token_id", None)
    return int(pad) if pad is not None else 0


class RolloutReplica:
    """This rank's rollout engine: on an accelerator, awake only while it generates when
    `rollout.free_cache_after_generate` (the KV cache is freed after each call, so training has its
    memory; with `rollout.offload_weights` the weights go to the CPU too), else allocated for the whole
    run; weights updated in place by `load_weights`. `kv_cache_bytes`: the device plan's KV cache (see
    `build_rollout`). With `config.agent` set, `generate` runs multi-turn episodes (`build_episodes`), which
    need the tokenizer. `shared_weights`: a colocated LoRA trainer's frozen weights, held instead of copies."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """What a rollout replica is built from, resolved on the controller.

        model_path / tokenizer_path: the model directory and its tokenizer's (None = the model's).
        rollout: the `rollout` section (engine, exact mode, KV cache, CUDA graphs, sleep and offload policy,
            recorded routes).
        max_prompt_length / max_response_length: the `data` lengths (their sum is the engine's context).
        step_rows: rows of one training step (bounds a CPU engine's slots); None = no bound.
        agent: the `agent` section when multi-turn episodes are on, else None.
        """

        model_path: str
        tokenizer_path: str | None = None
        rollout: RolloutConfig
        max_prompt_length: int
        max_response_length: int
        step_rows: int | None = None
        agent: AgentConfig | None = None

    def __init__(self, config: RolloutReplica.Config, device: torch.device, dtype: torch.dtype, pad_id: int,
                 kv_cache_bytes: int | None = None, shared_weights: dict[str, torch.Tensor] | None = None) -> None:
        self.config, self.cfg, self.pad_id = config, config.rollout, pad_id
        self.max_prompt_length, self.max_response_length = config.max_prompt_length, config.max_response_length
        self.max_num_seqs = cpu_max_num_seqs(self.cfg.max_num_seqs, config.step_rows) if device.type == "cpu" \
            else self.cfg.max_num_seqs
        self.engine = build_rollout(config.model_path, config.rollout, device, dtype,
                                    config.max_prompt_length + config.max_response_length, kv_cache_bytes,
                                    step_rows=config.step_rows, shared_weights=shared_weights)
        self.agent = None
        if config.agent is not None:
            if self.cfg.record_routes:
                raise ValueError("rollout.record_routes records single-turn generations; agent.environment / "
                                 "agent.tools episodes are not supported with it")
            if self.engine.kind != "fast":
                raise ValueError(f"agent.environment / agent.tools need the fast rollout engine, which continues "
                                 f"live sequences; {config.model_path} runs on the {self.engine.kind!r} engine (its "
                                 f"architecture has no fast path, or rollout.engine=hf)")
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path or config.model_path)
            self.agent = build_episodes(config.agent, tokenizer, config.max_prompt_length, config.max_response_length)
        self.awake = True
        if self.cfg.free_cache_after_generate:
            self.sleep()

    def effective_values(self) -> dict[str, Any]:
        """The rollout keys this replica runs with where they differ from the config's: the engine that
        serves (`rollout.engine`) and, on a CPU, the slots (`rollout.max_num_seqs`)."""
        return {"rollout.engine": self.engine.kind, "rollout.max_num_seqs": self.max_num_seqs}

    def sleep(self) -> None:
        """Hands the KV cache's memory back until the next `generate`. Only an accelerator's: a CPU cache
        stays, since host memory is not what colocation has to share and re-making and zero-filling the
        cache each step costs time (docs/benchmarks.md)."""
        if self.awake and self.engine.device.type != "cpu":
            self.engine.sleep(offload_weights=self.cfg.offload_weights)
            self.awake = False

    def wake(self) -> None:
        if not self.awake:
            self.engine.wake()
            self.awake = True

    def generate(self, batch: Batch, params: SamplingParams, step: int, rank: int) -> Batch:
        """Prompts (`prompts` left-padded + their `attention_mask`) -> rows of the RL batch, `params.n` samples
        per prompt interleaved. A seed in `params` is mixed with `step` and `rank` (`sampling_seed`)."""
        if params.seed is not None:
            params = replace(params, seed=sampling_seed(params.seed, step, rank))
        prompts = prompt_token_lists(batch["prompts"], batch["attention_mask"])
        self.wake()
        outs: list[list[Any]]  # per prompt, its samples: Completions, or multi-turn Trajectories
        if self.agent is None:
            outs = self.engine.generate(prompts, params)
        else:
            outs = self.agent.run(self.engine, prompts, prompt_rows(batch), params)
        if self.cfg.free_cache_after_generate:
            self.sleep()
        out = completions_to_batch(batch, outs, params.n, self.max_response_length, self.pad_id,
                                   self.max_prompt_length)
        if self.agent is not None:
            add_trajectory_fields(out, [t for row in outs for t in row])
        return out

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """(HF name, tensor) pairs copied into the engine in place, consumed one at a time; returns the count."""
        return self.engine.load_weights(named_tensors)


def sampling_seed(seed: int, step: int, rank: int) -> int:
    """The engine seed of one `generate` call on one rank: the given seed mixed with `step` (the number of
    the prompt batch in the run) and the rank, so each step draws new samples and data-parallel replicas
    draw different ones (distinct for every (step, rank) of a run shorter than 100,003 steps)."""
    return seed * 100_003 + step + 1_000_003 * rank


def prompt_token_lists(prompts: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """Left-padded prompts `[B, P]` -> the real token ids of each row."""
    if prompts.shape != attention_mask.shape:
        raise ValueError(f"generate needs `attention_mask` of the prompt, shape {tuple(prompts.shape)}; "
                         f"got {tuple(attention_mask.shape)}")
    return [row[mask.bool()].tolist() for row, mask in zip(prompts, attention_mask)]


def prompt_rows(batch: Batch) -> list[dict[str, Any]]:
    """Each prompt row's dataset fields (those of `PROMPT_FIELDS` and `uid` the batch has), as dicts."""
    keys = [k for k in ("uid", *PROMPT_FIELDS) if k in batch]
    return [{k: batch[k][i] for k in keys} for i in range(len(batch))]


def completions_to_batch(batch: Batch, outs: list, n: int, response_width: int, pad_id: int,
                         prompt_width: int = 0) -> Batch:
    """The input rows repeated `n` times (interleaved) plus the sampled responses, right-padded to
    `response_width`: responses, input_ids, attention_mask, position_ids, response_mask, rollout_log_probs,
    and, when the engine recorded routes, rollout_routes (`routes_to_batch`).

    outs[i][j] has token_ids, logprobs and finish_reason: a `Completion`, or a multi-turn `Trajectory`,
    whose `response_mask` (1 on model tokens, 0 on environment tokens) becomes the row's response_mask
    while attention_mask covers all its tokens; a trajectory with its own `prompt_ids` (the endpoint's)
    replaces its row's prompt, the prompts then left-padded to at least `prompt_width` (the same on every
    rank, so the ranks' rows concatenate)."""
    rows = len(outs) * n
    responses = torch.full((rows, response_width), pad_id, dtype=torch.long)
    logprobs = torch.zeros(rows, response_width, dtype=torch.float32)
    response_mask = torch.zeros(rows, response_width, dtype=torch.float32)
    real = torch.zeros(rows, response_width, dtype=torch.long)
    finished = []
    for i, samples in enumerate(outs):
        for j, c in enumerate(samples):
            r, k = i * n + j, min(len(c.token_ids), response_width)
            responses[r, :k] = torch.tensor(c.token_ids[:k], dtype=torch.long)
            logprobs[r, :k] = torch.tensor(c.logprobs[:k], dtype=torch.float32)
            real[r, :k] = 1
            mask = getattr(c, "response_mask", None)
            response_mask[r, :k] = 1.0 if mask is None else torch.tensor(mask[:k], dtype=torch.float32)
            finished.append(c.finish_reason)
    out = batch.repeat_interleave(n)
    own = [getattr(c, "prompt_ids", None) for samples in outs for c in samples]
    if any(p is not None for p in own):
        set_prompts(out, own, pad_id, prompt_width)
    attention_mask = torch.cat([out["attention_mask"].long(), real], dim=1)
    out["responses"] = responses
    out["input_ids"] = torch.cat([out["prompts"], responses], dim=1)
    out["attention_mask"] = attention_mask
    out["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out["response_mask"] = response_mask
    out["rollout_log_probs"] = logprobs
    out["finish_reason"] = finished
    completions = [c for samples in outs for c in samples]
    if completions and getattr(completions[0], "routes", None) is not None:
        out["rollout_routes"] = routes_to_batch(completions, out["prompts"].shape[1], response_width,
                                                attention_mask[:, :out["prompts"].shape[1]].sum(-1).tolist())
    return out


def routes_to_batch(completions: list, prompt_width: int, response_width: int, prompt_lens: list[int]) -> torch.Tensor:
    """int16 [rows, P+R, sparse layers, k] aligned with `input_ids`: each row's recorded experts (`Completion.routes`)
    at its prompt's columns (left-padded) and its response tokens' (right-padded), -1 where none was recorded
    (padding, the last response token, which the engine never fed back)."""
    first = completions[0].routes
    out = torch.full((len(completions), prompt_width + response_width, *first.shape[1:]), -1, dtype=torch.int16)
    for r, (c, length) in enumerate(zip(completions, prompt_lens)):
        fed = c.routes[:length + response_width]
        out[r, prompt_width - length:prompt_width - length + fed.shape[0]] = fed
    return out


def set_prompts(out: Batch, prompts: list[list[int] | None], pad_id: int, width: int = 0) -> None:
    """Rows whose trajectory brought its own prompt (the endpoint's: the runner's first request) get it as
    their `prompts` (left-padded to at least `width`, grown to the longest); the others keep theirs."""
    old, mask = out["prompts"], out["attention_mask"].long()
    width = max([width, old.shape[1]] + [len(p) for p in prompts if p is not None])
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    real = torch.zeros(len(prompts), width, dtype=torch.long)
    for r, prompt in enumerate(prompts):
        row = old[r][mask[r].bool()].tolist() if prompt is None else prompt
        ids[r, width - len(row):] = torch.tensor(row, dtype=torch.long)
        real[r, width - len(row):] = 1
    out["prompts"], out["attention_mask"] = ids, real


def add_trajectory_fields(out: Batch, trajectories: list) -> None:
    """Per-row `agent/<stat>` fields of multi-turn rows (the trainer's `agent/...` metrics), `agent/env_error`
    (the environment's first failure, or None), `agent/dropped` (why the trajectory must not be trained on,
    or None), `agent/metric/<name>` (what runners returned beside the reward; None where one did not), and
    each row's own `extra_info` with the trajectory's messages, turns and environment reward (for reward
    functions)."""
    fields = [t.row_fields() for t in trajectories]
    for name in STAT_FIELDS:
        out[f"agent/{name}"] = [f[f"agent/{name}"] for f in fields]
    out["agent/env_error"] = [t.env_error for t in trajectories]
    out["agent/dropped"] = [t.dropped for t in trajectories]
    for name in sorted({k for t in trajectories for k in t.metrics}):
        out[f"agent/metric/{name}"] = [t.metrics.get(name) for t in trajectories]
    infos = out["extra_info"] if "extra_info" in out else [None] * len(trajectories)
    out["extra_info"] = [{**(info or {}), **t.reward_info()} for info, t in zip(infos, trajectories)]

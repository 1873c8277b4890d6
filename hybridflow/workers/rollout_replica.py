"""A rank's rollout engine and the `generate` call around it, shared by the actor (engine colocated with
the trainer) and `RolloutWorker` (engine on its own device): building the engine from its typed config
(`RolloutReplica.Config`, made on the controller), its sleep/wake policy, a call's sampling seed,
multi-turn episodes through `hybridflow.agents` when the config carries an `agent` section, partial rollouts
through its in-flight buffer (`hybridflow.workers.partial_rollout`) when `rollout.partial` is on, and turning
the completions or trajectories into the RL batch layout of docs/architecture.md (`rollout_layout`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from hybridflow.agents.episodes import build_episodes
from hybridflow.batch import Batch
from hybridflow.config.schema import AgentConfig, RolloutConfig
from hybridflow.engine.contracts import RolloutEngineContract
from hybridflow.config.input_checks import vision_rollout_problems
from hybridflow.data.image_prompts import VisionPrompts
from hybridflow.engine.rollout import RolloutEngine, SamplingParams
from hybridflow.engine.rollout.engine import MAX_PREFILL_TOKENS
from hybridflow.engine.rollout.vision_engine import VisionRolloutEngine
from hybridflow.utils.lm_class import vision_model_type
from hybridflow.workers.partial_rollout import PartialRollouts, groups_to_prompts
from hybridflow.workers.rollout_layout import (add_trajectory_fields, batch_vision, completions_to_batch, prompt_rows,
                                               prompt_token_lists)

# what a generation reports besides its wall time (`gen_s`): GPU busy seconds (CUDA), running rows and the positions
# they attended over summed over decode steps, decode steps, KV slots and the bytes of one cached position;
# `hybridflow.trainer.rollout_stream.generation_metrics` reads them
GENERATION_STATS = ("busy_s", "row_steps", "context_steps", "decode_steps", "num_slots", "kv_token_bytes",
                    "generated_tokens")
# the KV cache's share of free GPU memory when neither `rollout.kv_cache_fraction` nor a device plan sizes it
UNPLANNED_KV_FRACTION = 0.4


def build_rollout(path: str, rollout_cfg: RolloutConfig, device: torch.device, dtype: torch.dtype,
                  max_model_len: int, kv_cache_bytes: int | None = None, rows_in_flight: int | None = None,
                  shared_weights: dict[str, torch.Tensor] | None = None,
                  max_prefill_tokens: int | None = None, images: bool = False) -> RolloutEngineContract:
    """The rollout engine of `rollout_cfg.engine` (auto | fast | hf) over the model at `path` (with the invariant
    kernels when `rollout_cfg.exact`, FP8 weights with `rollout_cfg.quantization`), holding `shared_weights` (a
    colocated LoRA trainer's frozen ones) instead of copies (the fast engine). The KV cache, the text engine's and
    the vision engine's alike: `rollout.kv_cache_fraction` of the free GPU memory if set, else `kv_cache_bytes` (the
    device plan's, so a capped run stays under `trainer.device_memory_gib`), else on a GPU `UNPLANNED_KV_FRACTION`.
    On a CPU, where nothing plans the memory and the cache is zero-filled RAM, it holds at most `rows_in_flight`
    sequences (the rows generated at once; more queue). `images`: the prompts carry images (a Qwen3.5 checkpoint then
    takes the vision engine too: `lm_class.TEXT_FIRST_FAMILIES`)."""
    max_num_seqs = cpu_max_num_seqs(rollout_cfg.max_num_seqs, rows_in_flight) if device.type == "cpu" \
        else rollout_cfg.max_num_seqs
    kv = kv_budget(rollout_cfg, device, kv_cache_bytes)
    prefill = max_prefill_tokens or MAX_PREFILL_TOKENS
    if vision_model_type(path, images) is not None:  # images in the prompts: the vision engine (`vision_engine`)
        return vision_rollout(path, rollout_cfg, device, dtype, max_num_seqs, max_model_len, kv, prefill)
    return RolloutEngine.from_pretrained(
        path, device=device, dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        kv_cache_memory=kv, cuda_graphs=rollout_cfg.cuda_graphs, engine=rollout_cfg.engine, exact=rollout_cfg.exact,
        record_routes=rollout_cfg.record_routes, shared_weights=shared_weights, quantization=rollout_cfg.quantization,
        max_prefill_tokens=prefill)


def kv_budget(rollout_cfg: RolloutConfig, device: torch.device, kv_cache_bytes: int | None) -> float | int | None:
    """The engine's `kv_cache_memory` (see `build_rollout`); None: the slots alone decide (a CPU's)."""
    if device.type == "cuda" and rollout_cfg.kv_cache_fraction is not None:
        return rollout_cfg.kv_cache_fraction
    if kv_cache_bytes is not None:  # a plan exists only on an accelerator (`budget.plan_for_device`)
        return kv_cache_bytes
    return UNPLANNED_KV_FRACTION if device.type == "cuda" else None


def vision_rollout(path: str, rollout_cfg: RolloutConfig, device: torch.device, dtype: torch.dtype, max_num_seqs: int,
                   max_model_len: int, kv_cache_memory: float | int | None,
                   max_prefill_tokens: int) -> VisionRolloutEngine:
    """The vision-language model's engine, its KV cache and prefill forwards as `build_rollout` sized them; the fast
    engine's options it has no path for are refused by name."""
    problems = vision_rollout_problems(rollout_cfg)
    if problems:
        raise ValueError(f"{path}: {'; '.join(problems)}")
    from transformers import AutoConfig

    from hybridflow.engine.rollout.checkpoint_files import model_stop_ids

    return VisionRolloutEngine(path, device, dtype, model_stop_ids(path, AutoConfig.from_pretrained(path)),
                               max_num_seqs, max_model_len, kv_cache_memory, cuda_graphs=rollout_cfg.cuda_graphs,
                               max_prefill_tokens=max_prefill_tokens)


def cpu_max_num_seqs(max_num_seqs: int, rows_in_flight: int | None) -> int:
    """`rollout.max_num_seqs` on a CPU: at most the rows generated at once (`rows_in_flight`; None = no bound)."""
    return max(1, min(max_num_seqs, rows_in_flight)) if rows_in_flight else max_num_seqs


def pad_token_id(config: Any) -> int:
    """The model config's pad id (0 when it has none): the fill of the responses' padding. A vision-language model's is
    its language model's: SmolVLM's (Idefics3's) top-level one is a deprecated placeholder, 128002 whatever the
    vocabulary, which the trainer's forward would look up in the embeddings."""
    pad = getattr(config.get_text_config(), "pad_token_id", None)
    return int(pad) if pad is not None else 0


class RolloutReplica:
    """This rank's rollout engine: on an accelerator, awake only while it generates when
    `rollout.free_cache_after_generate` (the KV cache is freed after each call, so training has its
    memory; with `rollout.offload_weights` the weights go to the CPU too), else allocated for the whole
    run; weights updated in place by `load_weights`. `kv_cache_bytes`: the device plan's KV cache (see
    `build_rollout`), `max_prefill_tokens` its prefill forward where it shrank it (None: the engine's default).
    With `config.agent` set, `generate` runs multi-turn episodes (`build_episodes`), which need the tokenizer.
    `shared_weights`: a colocated LoRA trainer's frozen weights, held instead of copies.
    `hold_allocator`: told the bytes the KV cache holds outside PyTorch's allocator whenever that changes (a capped
    device plan holds the allocator to the cap less them: `budget.hold_beside`)."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """What a rollout replica is built from, resolved on the controller.

        model_path / tokenizer_path: the model directory and its tokenizer's (None = the model's).
        rollout: the `rollout` section (engine, exact mode, KV cache, CUDA graphs, sleep and offload policy,
            recorded routes, partial rollouts: `partial`, `partial_unfinished`).
        max_prompt_length / max_response_length: the `data` lengths (their sum is the engine's context).
        rows_in_flight: rows generated at once (a step's, with partial rollouts its extra prompt batches'
            too; `RunFacts.rows_in_flight`): bounds a CPU engine's slots; None = no bound.
        agent: the `agent` section when multi-turn episodes are on, else None.
        images: the prompts carry images (`RunFacts.vision`).
        """

        model_path: str
        tokenizer_path: str | None = None
        rollout: RolloutConfig
        max_prompt_length: int
        max_response_length: int
        rows_in_flight: int | None = None
        agent: AgentConfig | None = None
        images: bool = False

    def __init__(self, config: RolloutReplica.Config, device: torch.device, dtype: torch.dtype, pad_id: int,
                 kv_cache_bytes: int | None = None, shared_weights: dict[str, torch.Tensor] | None = None,
                 hold_allocator: Callable[[int], None] | None = None, max_prefill_tokens: int | None = None) -> None:
        self.config, self.cfg, self.pad_id = config, config.rollout, pad_id
        self.max_prompt_length, self.max_response_length = config.max_prompt_length, config.max_response_length
        self.max_num_seqs = cpu_max_num_seqs(self.cfg.max_num_seqs, config.rows_in_flight) if device.type == "cpu" \
            else self.cfg.max_num_seqs
        self.engine = build_rollout(config.model_path, config.rollout, device, dtype,
                                    config.max_prompt_length + config.max_response_length, kv_cache_bytes,
                                    rows_in_flight=config.rows_in_flight, shared_weights=shared_weights,
                                    max_prefill_tokens=max_prefill_tokens, images=config.images)
        self.partial: PartialRollouts | None = None
        if self.cfg.partial:
            if not isinstance(self.engine, RolloutEngine):
                raise ValueError(f"rollout.partial=true carries unfinished samples in engine sessions, which the "
                                 f"{self.engine.kind!r} engine does not have; use rollout.engine=auto or fast with "
                                 f"a Llama / Qwen2 / Qwen3 / Mistral model")
            self.partial = PartialRollouts(self.engine, self.cfg.partial_unfinished)
        self.last_stats: dict[str, float] = {}
        self.agent = None
        if config.agent is not None:
            if self.cfg.record_routes:
                raise ValueError("rollout.record_routes records single-turn generations; agent.environment / "
                                 "agent.tools episodes are not supported with it")
            vision = isinstance(self.engine, VisionRolloutEngine)  # served through the endpoint only
            if self.engine.kind != "fast" and not vision:
                raise ValueError(f"agent.environment / agent.tools need the fast rollout engine, which continues "
                                 f"live sequences; {config.model_path} runs on the {self.engine.kind!r} engine (its "
                                 f"architecture has no fast path, or rollout.engine=hf)")
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path or config.model_path)
            images = VisionPrompts.from_pretrained(config.model_path, tokenizer) if vision else None
            self.agent = build_episodes(config.agent, tokenizer, config.max_prompt_length, config.max_response_length,
                                        images)
        self.awake = True
        self.hold_allocator = hold_allocator
        if self.cfg.free_cache_after_generate:
            self.sleep()
        else:
            self._hold()

    def effective_values(self) -> dict[str, Any]:
        """The rollout keys this replica runs with where they differ from the config's: the engine that
        serves (`rollout.engine`), on a CPU the slots (`rollout.max_num_seqs`), and the device plan's
        `rollout.offload_weights`."""
        return {"rollout.engine": self.engine.kind, "rollout.max_num_seqs": self.max_num_seqs,
                "rollout.offload_weights": self.cfg.offload_weights}

    def sleep(self) -> None:
        """Hands the KV cache's memory back until the next `generate`. Only an accelerator's: a CPU cache
        stays, since host memory is not what colocation has to share and re-making and zero-filling the
        cache each step costs time (docs/benchmarks.md)."""
        if self.awake and self.engine.device.type != "cpu":
            self.engine.sleep(offload_weights=bool(self.cfg.offload_weights))  # the plan's where left to it
            self.awake = False
            self._hold()

    def wake(self) -> None:
        if not self.awake:
            self._hold(waking=True)
            self.engine.wake()
            self.awake = True

    def _hold(self, waking: bool = False) -> None:
        """Tells `hold_allocator` (the device plan's cap, `budget.hold_beside`) what the KV cache holds outside
        PyTorch's allocator: its bytes while it is mapped in CUDA virtual memory (awake, or `waking`), else 0."""
        if self.hold_allocator is None:
            return
        kv = getattr(self.engine, "kv", None)  # the fast engine's cache (the transformers fallback keeps none)
        self.hold_allocator(kv.mapped_bytes if kv is not None and (self.awake or waking) else 0)

    def generate(self, batch: Batch, params: SamplingParams, step: int, rank: int,
                 version: int | None = None) -> Batch:
        """Prompts (`prompts` left-padded + their `attention_mask`) -> rows of the RL batch, `params.n` samples
        per prompt interleaved. A seed in `params` is mixed with `step` and `rank` (`sampling_seed`). With
        `version` (the policy version of the engine's weights) the rows get `rollout_versions`. Partial
        rollouts in flight are suspended first (this call's session takes the engine's slots)."""
        params = seeded(params, step, rank)
        prompts = prompt_token_lists(batch["prompts"], batch["attention_mask"])
        if self.partial is not None:
            self.partial.suspend()
        if version is not None:
            self.engine.weight_version = version
        self.wake()
        outs: list[list[Any]]  # per prompt, its samples: Completions, or multi-turn Trajectories
        if self.agent is None and isinstance(self.engine, VisionRolloutEngine):
            outs = self.engine.generate(prompts, params, vision=batch_vision(batch))
            self.last_stats = {}
        elif self.agent is None:
            outs = self.engine.generate(prompts, params)
            stats = self.engine.stats  # the fast engine's session stats (the transformers fallback has none)
            self.last_stats = {"gen_s": stats["generate_s"], **{k: stats[k] for k in GENERATION_STATS}} \
                if "row_steps" in stats else {}
        else:
            outs = self.agent.run(self.engine, prompts, prompt_rows(batch), params)
            self.last_stats = {}
        if self.cfg.free_cache_after_generate:
            self.sleep()
        out = completions_to_batch(batch, outs, params.n, self.max_response_length, self.pad_id,
                                   self.max_prompt_length, version=version)
        if self.agent is not None:
            add_trajectory_fields(out, [t for row in outs for t in row])
        return out

    # ------------------------------------------------------------------ partial rollouts
    def generate_groups(self, prompts: Batch, params: SamplingParams, step: int, rank: int, version: int,
                        count: int, finish_before: int | None = None) -> tuple[Batch, dict[str, float]]:
        """Partial rollouts: `prompts` join the in-flight buffer as groups of `params.n` samples, then the engine
        (its weights at policy `version`) generates until `count` groups are complete; returns their rows (as
        `generate` lays them out, with `rollout_versions`) and the step's generation stats
        (`PartialRollouts.take`, which also finishes the groups older than `finish_before`). The session is
        reseeded from the seed in `params` mixed with `step` and `rank` (`sampling_seed`)."""
        params = seeded(params, step, rank)
        partial = self._partial()
        partial.add(prompt_token_lists(prompts["prompts"], prompts["attention_mask"]), prompt_rows(prompts), params.n)
        self.wake()
        groups, self.last_stats = partial.take(count, version, params, finish_before)
        if self.cfg.free_cache_after_generate:
            self.sleep()
        rows, outs = groups_to_prompts(groups, self.pad_id)
        out = completions_to_batch(rows, outs, params.n, self.max_response_length, self.pad_id, version=version)
        return out, dict(self.last_stats)

    def generation_stats(self) -> dict[str, float]:
        """The last generation's `gen_s` and `GENERATION_STATS` (empty before any, or after a multi-turn one)."""
        return dict(self.last_stats)

    def in_flight(self, oldest_version: int) -> dict[str, int]:
        """Drops the groups in flight whose oldest token predates `oldest_version`; {"groups", "dropped"}."""
        return self._partial().in_flight(oldest_version)

    def partial_state(self) -> dict[str, Any]:
        """The in-flight buffer for a checkpoint (its samples suspended: the next step prefills them again)."""
        return self._partial().state_dict()

    def load_partial_state(self, state: dict[str, Any]) -> None:
        self._partial().load_state_dict(state)

    def _partial(self) -> PartialRollouts:
        if self.partial is None:
            raise RuntimeError("this rollout was built without rollout.partial; it has no in-flight buffer")
        return self.partial

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """(HF name, tensor) pairs copied into the engine in place, consumed one at a time; returns the count."""
        return self.engine.load_weights(named_tensors)


def seeded(params: SamplingParams, step: int, rank: int) -> SamplingParams:
    """`params` with its seed, if it has one, mixed with `step` and `rank` (`sampling_seed`)."""
    return params if params.seed is None else replace(params, seed=sampling_seed(params.seed, step, rank))


def sampling_seed(seed: int, step: int, rank: int) -> int:
    """The engine seed of one `generate` call on one rank: the given seed mixed with `step` (the number of
    the prompt batch in the run) and the rank, so each step draws new samples and data-parallel replicas
    draw different ones (distinct for every (step, rank) of a run shorter than 100,003 steps)."""
    return seed * 100_003 + step + 1_000_003 * rank

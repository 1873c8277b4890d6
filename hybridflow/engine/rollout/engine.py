"""`RolloutEngine`: load a model, generate with continuous batching, take weight updates, sleep/wake.

    engine = RolloutEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16)
    outs = engine.generate(prompt_token_ids, SamplingParams(n=4, temperature=1.0, max_tokens=256))
    outs[i][j].token_ids, outs[i][j].logprobs, outs[i][j].finish_reason
    session = engine.session(params, hold=True)   # sequences continued turn by turn (session.py)
    engine.load_weights(trainer_named_tensors)    # HF names, copied in place
    engine.weight_version = 3                     # recorded with each token sampled from now on
    engine.sleep(); engine.wake()                 # free / re-make the KV cache (and CUDA graphs)

The loop per `generate` call (a `Session`): admit waiting prompts into free slots and prefill them in one
packed forward (each prompt once; its KV written to the slots of all n samples, whose first tokens are
drawn from the shared last-position logits), otherwise run `decode_steps_per_sync` decode steps over every
running row (fewer when a row reaches its length limit sooner) before the one host sync that looks for
finished rows; rows that finished free their slot then. A session that holds its sequences lets a caller
continue one with appended tokens: only those are prefilled, attending over the slot's cached prefix.
With `record_routes` (a mixture of experts) each completion also carries the experts every token it fed
through the model was routed to (`Completion.routes`, from the blocks' `sparse_moe.RouteRecord`).
Architectures outside the fast families go to `HFRolloutEngine`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hybridflow.engine.rollout.attention import AttnMeta, pick_backend
from hybridflow.engine.rollout.busy_clock import BusyClock
from hybridflow.engine.rollout.checkpoint_files import checkpoint_tensors, eos_ids, model_stop_ids
from hybridflow.engine.rollout.cuda_graphs import DecodeGraphs, decode_forward, sample_and_record
from hybridflow.engine.rollout.kv_cache import resolve_budget
from hybridflow.engine.rollout.model import FAST_ARCHITECTURES, CausalLM, weight_target
from hybridflow.engine.rollout.scope import context_problems, default_max_model_len
from hybridflow.engine.rollout.sparse_moe import RouteRecord
from hybridflow.engine.rollout.sampler import sample
from hybridflow.engine.rollout.types import Completion, SamplingParams, check_prompts
from hybridflow.engine.rollout.sequence import Request, RunningBatch
from hybridflow.engine.rollout.session import Session
from hybridflow.utils.lm_class import language_model_name, text_view

if TYPE_CHECKING:  # hf_fallback imports transformers' generation: loaded only when an engine needs it
    from hybridflow.engine.rollout.hf_fallback import HFRolloutEngine


# prompt tokens one prefill forward packs, unless the caller (the device plan, under a memory cap) says fewer
MAX_PREFILL_TOKENS = 16384


def indexed_device(device: str | torch.device) -> torch.device:
    """`device` as a torch.device with its index filled in (`cuda` -> `cuda:<current device>`), so the cache,
    graphs and generator all land on one GPU."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _fp8_wanted(quantization: str, config, device: torch.device, dtype: torch.dtype, exact: bool) -> bool:
    """Whether `quantization` asks for FP8 weights; ValueError naming why they cannot run here, before any weight
    is allocated."""
    if quantization not in ("none", "fp8"):
        raise ValueError(f"quantization={quantization!r} is invalid; valid: 'none', 'fp8'")
    if quantization == "none":
        return False
    from hybridflow.engine.rollout import fp8

    problems = fp8.model_problems(config) + fp8.device_problems(device, dtype)
    if exact:
        problems.append("exact mode runs the trainer's bf16 arithmetic bit for bit, which FP8 weights cannot")
    if problems:
        raise ValueError(f"quantization='fp8' cannot run here: {'; '.join(problems)}")
    return True


class RolloutEngine:
    """The fast engine (Llama / Qwen2 / Qwen3 / Mistral / OLMo 2 / Phi-3, Qwen3-MoE / Mixtral / Qwen2-MoE / OLMoE).
    Build it with `from_pretrained`."""

    kind = "fast"

    def __init__(self, model: CausalLM, device: torch.device, dtype: torch.dtype, stop_ids: list[int],
                 max_num_seqs: int, max_model_len: int, kv_cache_memory: float | int | None,
                 cuda_graphs: bool, max_prefill_tokens: int, decode_steps_per_sync: int = 8,
                 record_routes: bool = False, rope_offsets: bool = False, never_sample: list[int] | None = None) -> None:
        """rope_offsets: decode rotates each row at its position plus its `RunningBatch.rope_offsets` (sequences a
        vision-language model prefilled: `vision_lm`); never_sample: token ids never drawn (`sampler.sample`'s never)."""
        if not isinstance(decode_steps_per_sync, int) or decode_steps_per_sync < 1:
            raise ValueError(f"decode_steps_per_sync={decode_steps_per_sync!r} is invalid; it must be an int >= 1")
        self.model, self.config, self.device, self.dtype = model, model.config, device, dtype
        self.default_stop_ids, self.max_model_len = stop_ids, max_model_len
        self.max_prefill_tokens, self.decode_steps_per_sync = max_prefill_tokens, decode_steps_per_sync
        self.backend = pick_backend(device, dtype, model.exact)
        self.use_graphs = cuda_graphs and device.type == "cuda"
        self.rope_offsets = rope_offsets
        self.never_sample = torch.tensor(never_sample, device=device) if never_sample else None
        self.kv = model.kv_cache(max_model_len, max_num_seqs, resolve_budget(kv_cache_memory, device))
        # one session decodes at a time (sessions share the slots): the engine owns the running rows'
        # buffers, so the CUDA graphs are captured over them
        self.batch = RunningBatch(self.kv.num_slots, self.kv.scratch_slot, max_model_len,
                                  self.config.vocab_size, device)
        self.routes: RouteRecord | None = None
        if record_routes:
            blocks = model.moe_blocks()
            if not blocks:
                raise ValueError(f"record_routes needs a mixture-of-experts model; {self.config.model_type!r} has "
                                 f"no expert layers")
            self.routes = RouteRecord(blocks, self.kv.num_slots + 1, max_model_len, blocks[0].gate.spec.top_k,
                                      device)
        self.graphs: DecodeGraphs | None = None
        self.weights_offloaded = False
        # the policy version of the weights loaded, recorded with every sampled token (`Completion.versions`);
        # its owner sets it when it loads new weights (a trainer: its update count)
        self.weight_version = 0
        self.busy = BusyClock(device)  # the GPU's time on the steps (sessions' busy_s)
        self.stats: dict[str, float] = {"kv_cache_gb": self.kv.bytes / 2**30, "num_slots": self.kv.num_slots,
                                        "kv_token_bytes": self.kv.token_bytes}
        self._capture()

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, max_num_seqs: int = 256,
                        max_model_len: int | None = None, kv_cache_memory: float | int | None = None,
                        cuda_graphs: bool = True, engine: str = "auto", max_prefill_tokens: int = MAX_PREFILL_TOKENS,
                        decode_steps_per_sync: int = 8, exact: bool = False, record_routes: bool = False,
                        moe_kernel: str = "auto", shared_weights: dict[str, torch.Tensor] | None = None,
                        quantization: str = "none") -> RolloutEngine | HFRolloutEngine:
        """Load a Hugging Face model directory.

        engine: "fast" (our decoder; the families of FAST_ARCHITECTURES), "hf" (`transformers.generate`), or
            "auto" (fast when the architecture has a fast path and it serves max_model_len, else hf).
        max_model_len: tokens per sequence, prompt + response (default min(max_position_embeddings, 4096)).
        kv_cache_memory: None, a fraction of free memory, or bytes; the cache takes at most max_num_seqs
            slots of max_model_len tokens within it.
        cuda_graphs: capture decode at bucketed batch sizes (CUDA only).
        max_prefill_tokens: prompt tokens packed into one prefill forward.
        decode_steps_per_sync: decode steps queued between two host looks for finished rows (a row
            that stops inside them idles, at most this many steps minus one; the outputs do not depend
            on it, except that the sampled noise follows the batch's composition).
        exact: run the training engine's batch-invariant arithmetic (`rollout.exact`, docs/exact.md): each
            sampled token's log-prob is, bit for bit, what the trainer's forward computes for it.
        record_routes: a mixture of experts records each token's experts per sparse layer
            (`Completion.routes`); the fast engine only.
        moe_kernel: the experts' grouped GEMMs: auto, grouped_mm, triton or gather (`grouped_gemm.py`).
        shared_weights: a colocated trainer's frozen weights by HF name, held by the fast engine as they are
            (no copy, not read from `path`; see `from_config`).
        quantization: "none", or "fp8": the decoder layers' projections run on FP8 weights with per-row scales,
            requantized at each `load_weights` (`fp8.py`; fast engine, dense models, CUDA sm_89+ in bf16).
        """
        from transformers import AutoConfig

        if engine not in ("auto", "fast", "hf"):
            raise ValueError(f"engine={engine!r} is invalid; valid: 'auto', 'fast', 'hf'")
        config = AutoConfig.from_pretrained(path)
        config = text_view(config)  # a published Qwen3.5 checkpoint: its language model alone
        device = indexed_device(device)
        stop_ids = model_stop_ids(path, config)
        fast = config.model_type in FAST_ARCHITECTURES
        # auto: a context the fast model of this config cannot serve (a sliding window, longrope) falls back
        refused = context_problems(config, default_max_model_len(config, max_model_len)) if fast else []
        fast = fast and not (engine == "auto" and refused)
        if engine == "fast" and config.model_type not in FAST_ARCHITECTURES:
            raise ValueError(f"engine='fast' has no path for model_type {config.model_type!r}; fast: "
                             f"{FAST_ARCHITECTURES}; use engine='auto' or 'hf'")
        if exact and (engine == "hf" or not fast):
            raise ValueError(f"exact mode needs the fast engine (model_type {config.model_type!r}, engine={engine!r}): "
                             f"transformers.generate runs other kernels than the trainer's; fast: "
                             f"{FAST_ARCHITECTURES}")
        if quantization != "none" and (engine == "hf" or not fast):
            raise ValueError(f"quantization={quantization!r} needs the fast engine, which has no path for model_type "
                             f"{config.model_type!r} with engine={engine!r}; fast: {FAST_ARCHITECTURES}")
        if engine == "hf" or not fast:
            from hybridflow.engine.rollout.hf_fallback import HFRolloutEngine

            if record_routes:
                raise ValueError(f"record_routes needs the fast engine, which has no path for model_type "
                                 f"{config.model_type!r} with engine={engine!r}; fast: {FAST_ARCHITECTURES}")
            why = ("rollout.engine=hf" if engine == "hf" else "; ".join(refused) if refused else
                   f"model_type {config.model_type!r} has no fast path (fast: {', '.join(FAST_ARCHITECTURES)})")
            return HFRolloutEngine(path, device, dtype, stop_ids, max_num_seqs, max_model_len or 4096, why)
        shared = shared_weights or {}
        tensors = checkpoint_tensors(path, keep=lambda name: weight_target(name)[0] not in shared,
                                     rename=language_model_name)
        return cls.from_config(config, tensors, device, dtype, stop_ids, max_num_seqs, max_model_len,
                               kv_cache_memory, cuda_graphs, max_prefill_tokens, decode_steps_per_sync, exact,
                               record_routes, moe_kernel, shared, quantization)

    @classmethod
    def from_config(cls, config, named_tensors: Iterable[tuple[str, torch.Tensor]],
                    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                    stop_token_ids: list[int] | None = None, max_num_seqs: int = 256,
                    max_model_len: int | None = None, kv_cache_memory: float | int | None = None,
                    cuda_graphs: bool = True, max_prefill_tokens: int = MAX_PREFILL_TOKENS,
                    decode_steps_per_sync: int = 8, exact: bool = False, record_routes: bool = False,
                    moe_kernel: str = "auto", shared_weights: dict[str, torch.Tensor] | None = None,
                    quantization: str = "none") -> RolloutEngine:
        """A fast engine from a HF config and (HF name, tensor) weights, e.g. a trainer's state dict, with
        no checkpoint on disk. stop_token_ids: the default stop ids (None: the config's eos id); exact: see
        `from_pretrained`. shared_weights: weights the engine holds as they are instead of copies (a LoRA
        trainer's frozen embeddings, head, norms, routers and experts on the same device:
        `TrainEngine.frozen_weights`), each one whose name, shape, dtype and device match a parameter of its own
        (fused q/k/v and gate/up never do); they are never loaded into nor moved by `sleep`, and
        `named_tensors` need not hold them. quantization: see `from_pretrained`."""
        device = indexed_device(device)
        fp8 = _fp8_wanted(quantization, config, device, dtype, exact)
        max_model_len = default_max_model_len(config, max_model_len)
        problems = context_problems(config, max_model_len)
        if problems:
            raise ValueError("; ".join(problems))
        if stop_token_ids is None:
            stop_token_ids = eos_ids(config) or []
        model = CausalLM.build(config, max_model_len, device, dtype, pick_backend(device, dtype, exact), moe_kernel,
                               shared_weights, fp8)
        loaded = model.load_weights((name, t) for name, t in named_tensors
                                    if weight_target(name)[0] not in model.shared)
        missing = model.expected_weights() - model.covered(loaded + [(name, None) for name in model.shared])
        if missing:
            raise ValueError(f"the weights lack {len(missing)} tensors the model needs, e.g. "
                             f"{sorted(str(m) for m in missing)[:4]}")
        return cls(model, device, dtype, stop_token_ids, max_num_seqs, max_model_len, kv_cache_memory,
                   cuda_graphs, max_prefill_tokens, decode_steps_per_sync, record_routes)

    # ---- generation -------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]],
                 params: SamplingParams | None = None) -> list[list[Completion]]:
        """outs[i][j]: the j-th of params.n samples for prompt i (see `Completion`)."""
        params = params or SamplingParams()
        check_prompts(prompt_token_ids, self.max_model_len, self.config.vocab_size)
        session = self.session(params)
        start = time.perf_counter()
        seqs = [session.add(prompt, params.n) for prompt in prompt_token_ids]
        done = session.run()
        elapsed = time.perf_counter() - start
        stats = session.stats
        self.stats.update(generate_s=elapsed, prefill_s=stats["prefill_s"], decode_s=elapsed - stats["prefill_s"],
                          generated_tokens=stats["generated_tokens"], decode_steps=stats["decode_steps"],
                          prefill_forwards=stats["prefill_forwards"], prefill_tokens=stats["prefill_tokens"],
                          row_steps=stats["row_steps"], context_steps=stats["context_steps"], busy_s=stats["busy_s"],
                          tokens_per_s=stats["generated_tokens"] / max(elapsed, 1e-9))
        return [[done[seq] for seq in row] for row in seqs]

    def session(self, params: SamplingParams, hold: bool = False) -> Session:
        """A generation loop that sequences join and leave (see `Session`); with `hold`, a sequence keeps
        its KV slot after a turn, to be continued with appended tokens."""
        if self.kv.k is None:
            raise RuntimeError("the engine is asleep (KV cache freed); call engine.wake() first")
        if self.model.exact and (params.top_k != -1 or params.top_p != 1.0):
            raise ValueError(f"exact mode reports each token's log-prob under the whole softmax, the trainer's; "
                             f"top_k={params.top_k} / top_p={params.top_p} would sample from a truncated one")
        return Session(self, params, hold)

    def prefill(self, admitted: list[Request], params: SamplingParams,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """One packed forward over the admitted requests' tokens (K/V written to all their slots); returns
        the first sampled token and its log-prob for each of their samples, request by request ([sum n]).
        A new prompt attends over its own tokens; when a request continues a sequence (start > 0), every
        request of the forward attends over its slot's cache, where its tokens were just written (in exact
        mode every forward does)."""
        lens = [len(r.prompt) for r in admitted]
        counts = torch.tensor([r.n for r in admitted])
        ids = torch.tensor([t for r in admitted for t in r.prompt], dtype=torch.long)
        positions = torch.cat([torch.arange(r.start, r.start + n) for r, n in zip(admitted, lens)])
        write_index = torch.cat([(torch.tensor(r.slots)[None, :] * self.max_model_len
                                  + torch.arange(r.start, r.start + n)[:, None]).reshape(-1)
                                 for r, n in zip(admitted, lens)])
        cu = torch.tensor([0] + lens).cumsum(0)
        dev = self.device
        write_rows = None if bool((counts == 1).all()) else \
            torch.arange(len(ids)).repeat_interleave(counts.repeat_interleave(torch.tensor(lens))).to(dev)
        if self.model.exact or any(r.start for r in admitted):  # every request attends over its (first) slot's cache
            slots = torch.tensor([r.slots[0] for r in admitted])
            context = torch.tensor([r.start + n for r, n in zip(admitted, lens)])
            starts = slots * self.max_model_len
            meta = AttnMeta(write_index=write_index.to(dev), write_rows=write_rows,
                            cu_seqlens=torch.cat([starts, starts[-1:] + self.max_model_len]).to(dev, torch.int32),
                            cu_seqlens_q=cu.to(dev, torch.int32), max_seqlen_q=max(lens),
                            max_seqlen=int(context.max()), context_lens=context.to(dev, torch.int32),
                            slots=slots.to(dev))
        else:
            meta = AttnMeta(write_index=write_index.to(dev), write_rows=write_rows, cu_seqlens=cu.to(dev, torch.int32),
                            seqlens=lens, max_seqlen=max(lens))
        self.busy.launch()
        logits = self.model(ids.to(dev), positions.to(dev), meta, self.kv, (cu[1:] - 1).to(dev))
        if bool((counts > 1).any()):
            logits = logits.repeat_interleave(counts.to(dev), dim=0)
        return sample(logits, params, generator, exact=self.model.exact, never=self.never_sample)

    def decode(self, batch: RunningBatch, params: SamplingParams, generator: torch.Generator, steps: int) -> None:
        """`steps` new tokens for every running row of `batch` (rows that finish on the way record no more),
        queued with no host sync in between: CUDA-graph replays when captured, else the same step eagerly."""
        size, last = len(batch), batch.max_position()
        self.busy.launch()
        for step in range(steps):
            if self.graphs is not None:
                self.graphs.step(batch, params, generator)
                continue
            # the SDPA path gathers the cache up to the longest context; flash reads each row's own length
            width = min(last + step + 1, self.max_model_len) if self.backend == "sdpa" else self.max_model_len
            logits = decode_forward(self.model, self.kv, batch.tokens[:size], batch.positions[:size],
                                    batch.slots[:size], width, ~batch.done(size),
                                    batch.rope_offsets[:size] if self.rope_offsets else None)
            sample_and_record(batch, size, logits, params, generator, self.model.exact, self.never_sample)
        batch.advanced(steps)

    # ---- weights and memory -----------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy (HF name, tensor) pairs into the weights in place (see `CausalLM.load_weights`); returns
        how many tensors were loaded. Offloaded weights come back to the device first and stay there (the
        next `wake` has nothing to move): one bulk copy in, where writing each trainer tensor into host
        memory was a synchronous device-to-host copy per tensor, most of the weight sync of an offloaded
        14B run (docs/benchmarks.md). The trainer has freed its gradients by then, so its parameters and
        these weights take no more than its update did."""
        if self.weights_offloaded:
            self._move_weights(self.device)
            self.weights_offloaded = False
        return len(self.model.load_weights(named_tensors))

    def sleep(self, offload_weights: bool = False) -> None:
        """Free the KV cache; with offload_weights, also move the weights to CPU. The CUDA graphs are
        kept when the cache comes back at the same addresses and the weights stay put (else dropped,
        and captured again on `wake`)."""
        if offload_weights or not self.kv.keeps_address:
            self.graphs = None
        self.kv.free()
        if offload_weights and not self.weights_offloaded:
            self._move_weights(torch.device("cpu"))
            self.weights_offloaded = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        """Bring the weights back (if offloaded), re-make the KV cache, capture the CUDA graphs if they
        were dropped."""
        start = time.perf_counter()
        if self.weights_offloaded:
            self._move_weights(self.device)
            self.weights_offloaded = False
        self.kv.allocate()
        self._capture()
        self.stats["wake_s"] = time.perf_counter() - start

    def _move_weights(self, device: torch.device) -> None:
        """Every parameter and buffer to `device`. From a GPU they go to page-locked host memory (PyTorch's
        host allocator caches the blocks, so each sleep reuses them) as asynchronous copies with one wait
        at the end; back, the copies from page-locked memory are asynchronous too. Copies through pageable
        memory were most of an offloaded 14B run's generation phase (docs/benchmarks.md)."""
        tensors: list[torch.Tensor] = [p for name, p in self.model.named_parameters() if name not in self.model.shared]
        tensors += list(self.model.buffers())
        if device.type == "cpu" and self.device.type == "cuda":
            for tensor in tensors:
                host = torch.empty_like(tensor.data, device="cpu", pin_memory=True)
                host.copy_(tensor.data, non_blocking=True)
                tensor.data = host
            torch.cuda.synchronize(self.device)
            return
        for tensor in tensors:
            tensor.data = tensor.data.to(device, non_blocking=True)

    @torch.inference_mode()
    def _capture(self) -> None:
        if self.use_graphs and self.graphs is None:
            start = time.perf_counter()
            self.graphs = DecodeGraphs(self.model, self.kv, self.batch, self.rope_offsets, self.never_sample)
            self.stats["graph_capture_s"] = time.perf_counter() - start

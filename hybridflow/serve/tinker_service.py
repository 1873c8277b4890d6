"""The Tinker service's state and operations, behind the HTTP layer (`http_api`).

`TinkerService` holds the base models it serves (`BaseModels`: each loaded once, shared by its LoRA clients), the
sessions (`Sessions`: a client silent past `session_timeout_s` has its session finished), the training clients'
`Trainee`s (LoRA or full-parameter), the weight snapshots `save_weights_for_sampler` took, the sampling sessions, one
`Sampler` per base model, and the `CheckpointStore` (saved states and Hugging Face exports under `checkpoint_dir`). Long
operations (create_model, forward_backward, optim_step, saving, loading and exporting weights, sampling) run on one
worker thread in arrival order (`WorkQueue`); waiting forward_backward requests of one model (with the same
`forward_only`) are packed together into the trainer's micro-batches (`micro_batch_tokens`), and waiting sample requests
on the same weights with the same unseeded sampling parameters run in one engine session, which those arriving while it
runs join (each answered when its samples end). `submit` returns a request id at once and `futures[request_id]` holds
the result later, as the SDK's futures expect. A result is a JSON dict, or protobuf bytes for the two types the SDK
reads as protobuf. Requests are read with the SDK's own types; a `ValueError` raised by an operation (unknown model,
unknown loss, bad shapes) is the caller's error, reported in the future as the SDK's `RequestFailedError` with category
`user`.
"""

from __future__ import annotations

import itertools
import json
import logging
import uuid
from collections import OrderedDict
from collections.abc import Hashable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable

from tinker import types

from hybridflow.engine.rollout import SamplingParams
from hybridflow.engine.rollout.kv_cache import free_memory
from hybridflow.serve.base_models import BaseModels
from hybridflow.serve.checkpoints import CheckpointStore
from hybridflow.serve.config import ServeConfig
from hybridflow.serve.sampler import Sampled, Sampler, Snapshot
from hybridflow.serve.sessions import Sessions
from hybridflow.serve.trainee import TRAIN_MEMORY_FRACTION, LossRequest, Trainee, auto_micro_batch_tokens
from hybridflow.serve.wire import FwdBwdRequest, forward_backward_output, sample_response
from hybridflow.serve.work_queue import Batch, Job, WorkQueue

log = logging.getLogger(__name__)
Result = dict[str, Any] | bytes


@dataclass
class _Snapshot:
    base: str
    weights: Snapshot
    time: datetime


@dataclass
class _Model:
    base: str
    trainee: Trainee


def _one(operation: Callable[[Any], Result]) -> Callable[[list[Any]], list[Result]]:
    """A job's `run` for an operation that serves one request at a time."""
    return lambda requests: [operation(requests[0])]


class TinkerService:
    """Sessions, training clients, snapshots and sampling sessions of one server (see the module docstring)."""

    def __init__(self, config: ServeConfig) -> None:
        for name, path in config.models.items():
            if not (path / "config.json").is_file():
                raise ValueError(f"--model {name}={path}: no config.json there; give a local Hugging Face "
                                 f"model directory")
        self.config = config
        self.bases = BaseModels(config.models, config.device, config.quantization)
        self.store = CheckpointStore(config.checkpoint_dir, config.merged_exports)
        self.sessions = Sessions(config.session_timeout_s)
        self.models: dict[str, _Model] = {}
        self.snapshots: OrderedDict[str, _Snapshot] = OrderedDict()
        self.sampling_sessions: dict[str, tuple[str, str | None]] = {}
        self.samplers: dict[str, Sampler] = {}
        self.futures: dict[str, Future[Result]] = {}
        self.queue = WorkQueue()
        self._ids = itertools.count()

    # ---- the futures ------------------------------------------------------------------------------
    def submit(self, job: Job) -> str:
        """Queue `job` on the worker thread; the request id its result is retrieved by."""
        request_id = str(uuid.uuid4())
        self.futures[request_id] = self.queue.submit(job)
        return request_id

    def queued(self, operation: Callable[[Any], Result], request: Any) -> str:
        """Queue a one-request operation; it runs in order with the other requests of its model."""
        return self.submit(Job(_one(operation), request, resource=getattr(request, "model_id", None)))

    def close(self) -> None:
        self.queue.close()

    # ---- immediate answers ------------------------------------------------------------------------
    def capabilities(self) -> dict[str, Any]:
        return types.GetServerCapabilitiesResponse(supported_models=[
            types.SupportedModel(model_name=name, trainable=True, sampleable=True)
            for name in self.config.models]).model_dump(mode="json")

    def create_session(self) -> str:
        return self.sessions.open()

    def finish_session(self, session_id: str) -> Future[int]:
        """The SDK's `ServiceClient.close`: the session ends at once, and its training clients' weights and optimizer
        state are released behind the requests queued before (checkpoints they saved stay listed and loadable); a
        later request naming one of them is refused as an unknown model. The future holds how many were released. An
        expired session finishes again quietly; `ValueError` for a session this server never opened or already
        finished."""
        if not self.sessions.finish(session_id) and session_id not in self.sessions.expired_ids:
            raise ValueError(f"no open session {session_id!r} on this server")
        return self.queue.submit(Job(self._release, session_id))

    def expire_sessions(self) -> list[str]:
        """Finish the sessions whose clients stopped sending heartbeats (`Sessions.expired`), as `finish_session`
        does; returns their ids."""
        expired = self.sessions.expired()
        for session_id in expired:
            self.queue.submit(Job(self._release_expired, session_id))
        return expired

    def _release(self, ids: list[str]) -> list[int]:
        """A queued job (on the worker thread, which alone changes `models`): drop the training clients of session
        `ids[0]`; how many there were."""
        held = [m for m in self.models if m.startswith(f"{ids[0]}:")]
        for model_id in held:
            del self.models[model_id]
        return [len(held)]

    def _release_expired(self, ids: list[str]) -> list[int]:
        """`_release` for a session `expire_sessions` finished, saying so."""
        released = self._release(ids)
        log.warning("session %s: no heartbeat for %.0f s (--session-timeout-s), so it is finished and its %d "
                    "training client(s) released; their saved checkpoints stay", ids[0],
                    self.config.session_timeout_s, released[0])
        return released

    def create_sampling_session(self, req: types.CreateSamplingSessionRequest) -> str:
        """A sampling session on a snapshot (`model_path`) or on a base model."""
        if req.model_path is not None:
            base = self._snapshot(req.model_path).base
        else:
            base = str(req.base_model)
            self.bases.path(base)
        return self._new_sampling_session(base, req.model_path)

    def _new_sampling_session(self, base: str, path: str | None) -> str:
        sampling_id = f"sampler-{uuid.uuid4()}"
        self.sampling_sessions[sampling_id] = (base, path)
        return sampling_id

    def sampler_info(self, sampling_id: str) -> dict[str, Any]:
        base, path = self._sampling_session(sampling_id)
        return types.GetSamplerResponse(sampler_id=sampling_id, base_model=base, model_path=path).model_dump()

    def info(self, model_id: str) -> dict[str, Any]:
        model = self._model(model_id)
        rank = model.trainee.rank
        return types.GetInfoResponse(
            model_id=model_id, model_data=types.ModelData(model_name=model.base, tokenizer_id=str(
                self.bases.path(model.base))), is_lora=rank > 0, lora_rank=rank or None,
            model_name=model.base).model_dump(mode="json")

    def checkpoints(self, model_id: str | None) -> dict[str, Any]:
        """The saved states and exports of `model_id` (None: all), then its sampler snapshots (in memory)."""
        if model_id is not None:
            self._model(model_id)
        found = self.store.checkpoints(model_id)
        found += [types.Checkpoint(checkpoint_id=path.split("/", 3)[3], checkpoint_type="sampler", tinker_path=path,
                                   time=snapshot.time)
                  for path, snapshot in reversed(self.snapshots.items())
                  if model_id is None or path.split("/")[2] == model_id]
        return types.CheckpointsListResponse(checkpoints=found).model_dump(mode="json")

    def weights_info(self, path: str) -> dict[str, Any]:
        return self.store.weights_info(path).model_dump(mode="json")

    # ---- worker-thread operations -----------------------------------------------------------------
    def create_model(self, req: types.CreateModelRequest) -> Result:
        """A LoRA client, or with no `lora_config` (or rank 0) a full-parameter one."""
        if req.optimizer_config.type != "adamw":
            raise ValueError(f"optimizer_config.type={req.optimizer_config.type!r} is not served; valid: adamw")
        lora = req.lora_config
        self.bases.path(req.base_model)
        self._check_session(req.session_id)
        model_id = f"{req.session_id}:train:{req.model_seq_id}"  # the SDK's own derivation (see load_weights)
        if lora is None or lora.rank == 0:
            trainee = Trainee.full(self.bases.full_model(req.base_model), self.bases.device,
                                   self._micro_batch_tokens(req.base_model), self.config.train_torch_dtype())
        else:
            if not (lora.train_attn and lora.train_mlp):
                raise ValueError(f"lora_config train_attn={lora.train_attn}, train_mlp={lora.train_mlp}: adapters "
                                 f"go on every attention and MLP projection here; both must be true")
            if lora.train_unembed:
                log.warning("lora_config.train_unembed=True: this server adapts the decoder layers' projections "
                            "only; the unembedding stays frozen")
            trainee = Trainee.lora(self.bases.lora_model(req.base_model), lora.rank, lora.seed, self.bases.device,
                                   self._micro_batch_tokens(req.base_model), self.config.train_torch_dtype())
        self.models[model_id] = _Model(req.base_model, trainee)
        return types.CreateModelResponse(model_id=model_id).model_dump(mode="json")

    def submit_forward_backward(self, req: FwdBwdRequest) -> str:
        """Queue a forward_backward; those of one model waiting together run as one batch."""
        return self.submit(Job(self._forward_backward, req, key=("forward_backward", req.model_id, req.forward_only),
                               resource=req.model_id))

    def _forward_backward(self, requests: list[FwdBwdRequest]) -> list[Any]:
        """One forward (and backward) of every request that passes its checks; each check's error is its own."""
        trainee = self._model(requests[0].model_id).trainee
        outcomes: list[Any] = []
        valid: list[int] = []
        for i, req in enumerate(requests):
            try:
                trainee.check(LossRequest(req.data, req.loss_fn, req.config))
                valid.append(i)
                outcomes.append(None)
            except ValueError as e:
                outcomes.append(e)
        if valid:
            results = trainee.forward_backward([LossRequest(requests[i].data, requests[i].loss_fn, requests[i].config)
                                                for i in valid], requests[0].forward_only)
            for i, (outputs, metrics) in zip(valid, results):
                outcomes[i] = forward_backward_output(outputs, metrics)
        return outcomes

    def optim_step(self, req: types.OptimStepRequest) -> Result:
        params = req.optim_params
        if not isinstance(params, types.AdamParams):
            raise ValueError(f"optim_params of type {getattr(params, 'type', type(params).__name__)!r} are not "
                             f"served; send AdamParams")
        metrics = self._model(req.model_id).trainee.optim_step(
            params.learning_rate, params.beta1, params.beta2, params.eps, params.weight_decay, params.grad_clip_norm)
        return types.OptimStepResponse(metrics=metrics).model_dump(mode="json")

    def save_weights(self, req: types.SaveWeightsRequest) -> Result:
        """Write the model's training state (`CheckpointStore.save_state`)."""
        model = self._model(req.model_id)
        name = req.path or f"step-{next(self._ids)}"
        path = self.store.save_state(req.model_id, name, bool(req.overwrite), model.base, model.trainee)
        return types.SaveWeightsResponse(path=path).model_dump(mode="json")

    def save_weights_external(self, req: types.SaveWeightsExternalRequest) -> Result:
        """Export the model as a Hugging Face directory (`CheckpointStore.export`)."""
        if req.age_encryption_recipients:
            raise ValueError("age_encryption_recipients: encrypted exports are not served; the files are written "
                             "to this machine's --checkpoint-dir")
        model = self._model(req.model_id)
        path = self.store.export(req.model_id, req.path, model.trainee, self.bases.base(model.base),
                                 self.bases.path(model.base))
        return {"path": path, "type": "save_weights_external"}

    def load_weights(self, req: types.LoadWeightsRequest) -> Result:
        """Load a `save_weights` checkpoint (with its optimizer state when `optimizer`) into a training client:
        the one `model_id` names (load_state), or a new one of the checkpoint's base and rank
        (create_training_client_from_state), under the id the SDK derives, `SESSION:train:SEQ`."""
        state = self.store.load_state(req.path)
        model_id = req.model_id
        if model_id is None:
            if req.session_id is None or req.model_seq_id is None:
                raise ValueError("load_weights needs model_id, or session_id with model_seq_id")
            if req.base_model not in (None, state["base"]):
                raise ValueError(f"checkpoint {req.path!r} trains base model {state['base']!r}, not {req.base_model!r}")
            lora = types.LoraConfig(rank=state["rank"]) if state["rank"] else None
            self.create_model(types.CreateModelRequest(
                session_id=req.session_id, model_seq_id=req.model_seq_id, base_model=state["base"], lora_config=lora,
                optimizer_config=req.optimizer_config or types.AdamOptimizerConfig()))
            model_id = f"{req.session_id}:train:{req.model_seq_id}"
        model = self._model(model_id)
        if state["base"] != model.base:
            raise ValueError(f"checkpoint {req.path!r} trains base model {state['base']!r}; this client's is "
                             f"{model.base!r}")
        model.trainee.load_state(state, req.optimizer)
        return types.LoadWeightsResponse(path=req.path, model_id=model_id).model_dump(mode="json")

    def save_weights_for_sampler(self, req: types.SaveWeightsForSamplerRequest) -> Result:
        """Snapshot the weights the sampler needs under `tinker://MODEL/sampler_weights/NAME`; without a name
        (save_weights_and_get_sampling_client), under a fresh one with a sampling session on it."""
        if req.kind != "snapshot":
            raise ValueError(f"kind={req.kind!r} is not served; valid: snapshot")
        model = self._model(req.model_id)
        name = req.path or f"ephemeral-{next(self._ids)}"
        path = f"tinker://{req.model_id}/sampler_weights/{name}"
        self.snapshots[path] = _Snapshot(model.base, model.trainee.sampler_weights(), datetime.now(timezone.utc))
        self.snapshots.move_to_end(path)
        while len(self.snapshots) > self.config.max_snapshots:
            self.snapshots.popitem(last=False)
        if req.path is not None:
            return types.SaveWeightsForSamplerResponseInternal(path=path).model_dump(mode="json")
        sampling_id = self._new_sampling_session(model.base, path)
        return types.SaveWeightsForSamplerResponseInternal(sampling_session_id=sampling_id).model_dump(mode="json")

    def submit_sample(self, req: types.SampleRequest) -> str:
        """Queue a sample request; unseeded ones on the same weights and sampling parameters share a batch."""
        key: Hashable | None = None
        try:
            base, path, _, p = self._sample_args(req)
            if p.seed is None and p.max_tokens is not None:  # seeded ones stay reproducible alone
                key = ("sample", base, path, req.num_samples, json.dumps(p.model_dump(mode="json"), sort_keys=True),
                       _scored(req))
        except ValueError:
            pass  # the job raises it again, into the caller's future
        return self.submit(Job(self._sample, req, key=key, stream=True))

    def _sample_args(self, req: types.SampleRequest) -> tuple[str, str | None, list[int], types.SamplingParams]:
        """(base, snapshot path, prompt, sampling parameters) of a request, refused when it asks for what is not
        served."""
        if req.sampling_session_id is not None:
            base, path = self._sampling_session(req.sampling_session_id)
        elif req.model_path is not None:
            base, path = self._snapshot(req.model_path).base, req.model_path
        else:
            base, path = str(req.base_model), None
            self.bases.path(base)
        unserved = {k: v for k, v in (("topk_sample_logprobs", req.topk_sample_logprobs),
                    ("prompt_alt_tokens_k", req.prompt_alt_tokens_k), ("record_stability_info",
                    req.record_stability_info)) if v}
        if unserved or req.target_prompt_logprobs is not None:
            raise ValueError(f"sample options {sorted(unserved) or ['target_prompt_logprobs']} are not served; "
                             f"this server returns the sampled tokens' log-probs, and the prompt's "
                             f"(prompt_logprobs, topk_prompt_logprobs, prompt_logprobs_last_n)")
        last_n, prompt = req.prompt_logprobs_last_n, req.prompt.to_ints()
        if req.topk_prompt_logprobs < 0:
            raise ValueError(f"topk_prompt_logprobs={req.topk_prompt_logprobs} must be >= 0")
        if last_n is not None and (not req.prompt_logprobs or not 1 <= last_n <= len(prompt) - 1):
            raise ValueError(f"prompt_logprobs_last_n={last_n} needs prompt_logprobs, and must be between 1 and the "
                             f"prompt's length - 1 ({len(prompt) - 1})")
        stop = req.sampling_params.stop
        if stop is not None and not all(isinstance(s, int) for s in ([stop] if isinstance(stop, str) else stop)):
            raise ValueError(f"sampling_params.stop={stop!r}: stop strings are not served; pass token ids")
        return base, path, prompt, req.sampling_params

    def _sample(self, batch: Batch) -> None:
        """One engine session for the batch's requests (they share weights and parameters: `submit_sample`) and those
        that join it while it runs; each request is answered as soon as its samples have ended, and a prompt the
        engine cannot hold fails alone."""
        first = batch.requests[0]
        base, path, prompt, p = self._sample_args(first)
        sampler = self._sampler(base)
        limit = sampler.engine.max_model_len
        params = SamplingParams(n=first.num_samples, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                max_tokens=p.max_tokens or max(limit - len(prompt), 1), seed=p.seed,
                                stop_token_ids=None if p.stop is None else [int(s) for s in p.stop])
        snapshot = None if path is None else self._snapshot(path).weights

        def prompts(indices: list[int]) -> list[tuple[int, list[int]]]:
            """The (index, prompt) of requests `indices` (the sampler answers one it cannot hold: `Sampler.stream`)."""
            return [(i, batch.jobs[i].request.prompt.to_ints()) for i in indices]

        def answer(i: int, out: Sampled | Exception) -> None:
            req = batch.jobs[i].request
            batch.answer(i, out if isinstance(out, Exception) else sample_response(
                *out, with_logprobs=bool(req.prompt_logprobs), last_n=req.prompt_logprobs_last_n))

        sampler.stream(path, snapshot, params, prompts(list(range(len(batch.jobs)))), lambda: prompts(batch.join()),
                       answer, score=_scored(first))

    # ---- lookups ----------------------------------------------------------------------------------
    def _check_session(self, session_id: str) -> None:
        if session_id in self.sessions.expired_ids:
            raise ValueError(f"session {session_id!r} expired: its client sent no heartbeat for "
                             f"{self.config.session_timeout_s:.0f} s (--session-timeout-s), and its training clients "
                             f"were released; open a new ServiceClient (saved checkpoints load with load_state)")

    def _model(self, model_id: str) -> _Model:
        if model_id not in self.models:
            self._check_session(model_id.split(":")[0])
            raise ValueError(f"model_id {model_id!r} is unknown; known: {sorted(self.models)}")
        return self.models[model_id]

    def _snapshot(self, path: str) -> _Snapshot:
        if path not in self.snapshots:
            raise ValueError(f"sampler weights {path!r} are unknown (never saved, or dropped: the server keeps "
                             f"the last {self.config.max_snapshots}); kept: {list(self.snapshots)}")
        return self.snapshots[path]

    def _sampling_session(self, sampling_id: str) -> tuple[str, str | None]:
        if sampling_id not in self.sampling_sessions:
            raise ValueError(f"sampling session {sampling_id!r} is unknown")
        return self.sampling_sessions[sampling_id]

    def _micro_batch_tokens(self, base: str) -> int:
        """`--micro-batch-tokens`, or (left out) what the device's free memory holds now, logged."""
        if self.config.micro_batch_tokens is not None:
            return self.config.micro_batch_tokens
        free = free_memory(self.bases.device)
        tokens = auto_micro_batch_tokens(self.bases.base(base).config, free, self.config.train_torch_dtype())
        log.info("a training client of %s: forward_backward in micro-batches of %d padded tokens (%.0f%% of %.1f GiB "
                 "free; --micro-batch-tokens sets it)", base, tokens, 100 * TRAIN_MEMORY_FRACTION, free / 2**30)
        return tokens

    def _sampler(self, base: str) -> Sampler:
        if base not in self.samplers:
            self.samplers[base] = Sampler(self.bases.path(base), self.config.device, self.config.max_num_seqs,
                                          self.config.sampler_torch_dtype(), self.config.kv_cache_memory,
                                          self.config.max_model_len or None)
        return self.samplers[base]


def _scored(req: types.SampleRequest) -> int | None:
    """The top-k a sample request's prompt is scored with (0: its log-probs alone), or None: not scored."""
    return req.topk_prompt_logprobs if req.prompt_logprobs or req.topk_prompt_logprobs else None

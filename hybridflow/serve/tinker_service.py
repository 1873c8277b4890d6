"""The Tinker service's state and operations, behind the HTTP layer (`http_api`).

`TinkerService` holds the base models it serves (a name -> a local directory), the sessions, the training
clients' `LoraTrainee`s, the weight snapshots `save_weights_for_sampler` took, the sampling sessions and one
`Sampler` per base model; `save_weights` / `load_weights` keep training state in files under `checkpoint_dir`.
Long operations (create_model, forward_backward, optim_step, saving and loading weights, sampling) run one at a
time, in arrival order, on one worker thread (the model and the engine are not thread-safe, and the SDK orders
a client's requests by sending them in turn); `submit` returns a request id at once and `futures[request_id]`
holds the result later, as the SDK's futures expect. A result is a JSON
dict, or protobuf bytes for the two types the SDK reads as protobuf. Requests are read with the SDK's own
types; a `ValueError` raised by an operation (unknown model, unknown loss, bad shapes) is the caller's
error, reported in the future as the SDK's `RequestFailedError` with category `user`.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import uuid
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from tinker import types

from hybridflow.engine.rollout import SamplingParams
from hybridflow.serve.lora_trainee import LoraTrainee
from hybridflow.serve.sampler import Sampler, Snapshot
from hybridflow.serve.wire import FwdBwdRequest, forward_backward_output, sample_response

log = logging.getLogger(__name__)
Result = dict[str, Any] | bytes
_NAME = re.compile(r"\w[\w.-]*")  # a checkpoint name: one file name, never a path
_CHECKPOINT = re.compile(r"tinker://(session-[\w-]+:train:\d+)/weights/(\w[\w.-]*)")


@dataclass
class ServeConfig:
    """What `hybridflow serve` was started with.

    models: served base-model name -> local Hugging Face directory.
    device: where training and sampling run ("cpu", "cuda").
    max_num_seqs: the rollout engine's concurrent sequences.
    max_snapshots: sampler weight snapshots kept in memory (the oldest is dropped first).
    checkpoint_dir: where `save_weights` writes training state (`MODEL_ID/NAME.pt`).
    """

    models: dict[str, Path]
    device: str = "cpu"
    max_num_seqs: int = 64
    max_snapshots: int = 8
    checkpoint_dir: Path = Path("tinker_checkpoints")


def model_map(specs: list[str]) -> dict[str, Path]:
    """`--model` values, each `NAME=PATH` or `PATH` (served under the path as written), as name -> directory."""
    models: dict[str, Path] = {}
    for spec in specs:
        name, _, path = spec.rpartition("=")
        name = name or path
        if not path or name in models:
            raise ValueError(f"--model {spec!r}: give NAME=PATH or PATH, each name once (served so far: "
                             f"{sorted(models)})")
        models[name] = Path(path)
    return models


@dataclass
class _Model:
    base: str
    trainee: LoraTrainee


class TinkerService:
    """Sessions, training clients, snapshots and sampling sessions of one server (see the module docstring)."""

    def __init__(self, config: ServeConfig) -> None:
        for name, path in config.models.items():
            if not (path / "config.json").is_file():
                raise ValueError(f"--model {name}={path}: no config.json there; give a local Hugging Face "
                                 f"model directory")
        self.config = config
        self.sessions: set[str] = set()
        self.models: dict[str, _Model] = {}
        self.snapshots: OrderedDict[str, tuple[str, Snapshot]] = OrderedDict()
        self.sampling_sessions: dict[str, tuple[str, str | None]] = {}
        self.samplers: dict[str, Sampler] = {}
        self.futures: dict[str, Future[Result]] = {}
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-service")
        self._ids = itertools.count()

    # ---- the futures ------------------------------------------------------------------------------
    def submit(self, fn: Callable[..., Result], *args: Any) -> str:
        """Queue `fn(*args)` on the worker thread; the request id its result is retrieved by."""
        request_id = str(uuid.uuid4())
        self.futures[request_id] = self._worker.submit(fn, *args)
        return request_id

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    # ---- immediate answers ------------------------------------------------------------------------
    def base_path(self, name: str | None) -> Path:
        """The directory of served base model `name`; a `ValueError` naming the served ones otherwise."""
        if name not in self.config.models:
            raise ValueError(f"base model {name!r} is not served here; served: {sorted(self.config.models)} "
                             f"(start hybridflow serve with --model NAME=PATH)")
        return self.config.models[name]

    def capabilities(self) -> dict[str, Any]:
        return types.GetServerCapabilitiesResponse(supported_models=[
            types.SupportedModel(model_name=name, trainable=True, sampleable=True)
            for name in self.config.models]).model_dump(mode="json")

    def create_session(self) -> str:
        session_id = f"session-{uuid.uuid4()}"
        self.sessions.add(session_id)
        return session_id

    def create_sampling_session(self, req: types.CreateSamplingSessionRequest) -> str:
        """A sampling session on a snapshot (`model_path`) or on a base model."""
        if req.model_path is not None:
            base = self._snapshot(req.model_path)[0]
        else:
            base = str(req.base_model)
            self.base_path(base)
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
        path = self.config.models[model.base]
        return types.GetInfoResponse(
            model_id=model_id, model_data=types.ModelData(model_name=model.base, tokenizer_id=str(path)),
            is_lora=True, lora_rank=model.trainee.rank, model_name=model.base).model_dump(mode="json")

    # ---- worker-thread operations -----------------------------------------------------------------
    def create_model(self, req: types.CreateModelRequest) -> Result:
        if req.lora_config is None:
            raise ValueError("create_model without lora_config (full-parameter training) is not served yet; "
                             "pass a rank (create_lora_training_client)")
        lora = req.lora_config
        if not (lora.train_attn and lora.train_mlp):
            raise ValueError(f"lora_config train_attn={lora.train_attn}, train_mlp={lora.train_mlp}: adapters "
                             f"go on every attention and MLP projection here; both must be true")
        if req.optimizer_config.type != "adamw":
            raise ValueError(f"optimizer_config.type={req.optimizer_config.type!r} is not served; valid: adamw")
        path = self.base_path(req.base_model)
        if lora.train_unembed:
            log.warning("lora_config.train_unembed=True: this server adapts the decoder layers' projections "
                        "only; the unembedding stays frozen")
        model_id = f"{req.session_id}:train:{req.model_seq_id}"  # the SDK's own derivation (see load_weights)
        self.models[model_id] = _Model(req.base_model, LoraTrainee(path, lora.rank, lora.seed, self.config.device))
        return types.CreateModelResponse(model_id=model_id).model_dump(mode="json")

    def forward_backward(self, req: FwdBwdRequest) -> Result:
        outputs, metrics = self._model(req.model_id).trainee.forward_backward(
            req.data, req.loss_fn, req.config, req.forward_only)
        return forward_backward_output(outputs, metrics)

    def optim_step(self, req: types.OptimStepRequest) -> Result:
        params = req.optim_params
        if not isinstance(params, types.AdamParams):
            raise ValueError(f"optim_params of type {getattr(params, 'type', type(params).__name__)!r} are not "
                             f"served; send AdamParams")
        metrics = self._model(req.model_id).trainee.optim_step(
            params.learning_rate, params.beta1, params.beta2, params.eps, params.weight_decay, params.grad_clip_norm)
        return types.OptimStepResponse(metrics=metrics).model_dump(mode="json")

    def save_weights(self, req: types.SaveWeightsRequest) -> Result:
        """Write the model's training state (adapters, optimizer moments) to `checkpoint_dir/MODEL/NAME.pt`,
        named `tinker://MODEL/weights/NAME`; written whole or not at all (a temporary file renamed)."""
        model = self._model(req.model_id)
        name = req.path or f"step-{next(self._ids)}"
        if not _NAME.fullmatch(name):
            raise ValueError(f"save_state name {name!r}: use letters, digits, '-', '_' and '.', not first")
        path = f"tinker://{req.model_id}/weights/{name}"
        file = self._checkpoint_file(path)
        if file.exists() and not req.overwrite:
            raise ValueError(f"{path} exists ({file}); pick another name or pass overwrite")
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(".tmp")
        torch.save({"base": model.base, **model.trainee.state()}, tmp)
        os.replace(tmp, file)
        return types.SaveWeightsResponse(path=path).model_dump(mode="json")

    def load_weights(self, req: types.LoadWeightsRequest) -> Result:
        """Load a `save_weights` checkpoint (with its optimizer state when `optimizer`) into a training client:
        the one `model_id` names (load_state), or a new one of the checkpoint's base and rank
        (create_training_client_from_state), under the id the SDK derives, `SESSION:train:SEQ`."""
        file = self._checkpoint_file(req.path)
        if not file.is_file():
            raise ValueError(f"checkpoint {req.path!r} is not saved here (no {file})")
        state = torch.load(file, map_location="cpu", weights_only=True)
        model_id = req.model_id
        if model_id is None:
            if req.session_id is None or req.model_seq_id is None:
                raise ValueError("load_weights needs model_id, or session_id with model_seq_id")
            if req.base_model not in (None, state["base"]):
                raise ValueError(f"checkpoint {req.path!r} trains base model {state['base']!r}, not {req.base_model!r}")
            if req.optimizer_config is not None and req.optimizer_config.type != "adamw":
                raise ValueError(f"optimizer_config.type={req.optimizer_config.type!r} is not served; valid: adamw")
            model_id = f"{req.session_id}:train:{req.model_seq_id}"
            trainee = LoraTrainee(self.base_path(state["base"]), state["rank"], None, self.config.device)
            self.models[model_id] = _Model(state["base"], trainee)
        model = self._model(model_id)
        if state["base"] != model.base:
            raise ValueError(f"checkpoint {req.path!r} trains base model {state['base']!r}; this client's is "
                             f"{model.base!r}")
        model.trainee.load_state(state, req.optimizer)
        return types.LoadWeightsResponse(path=req.path, model_id=model_id).model_dump(mode="json")

    def save_weights_for_sampler(self, req: types.SaveWeightsForSamplerRequest) -> Result:
        """Snapshot the model's merged weights under `tinker://MODEL/sampler_weights/NAME`; without a name
        (save_weights_and_get_sampling_client), under a fresh one with a sampling session on it."""
        if req.kind != "snapshot":
            raise ValueError(f"kind={req.kind!r} is not served; valid: snapshot")
        model = self._model(req.model_id)
        name = req.path or f"ephemeral-{next(self._ids)}"
        path = f"tinker://{req.model_id}/sampler_weights/{name}"
        self.snapshots[path] = (model.base, model.trainee.merged_weights())
        self.snapshots.move_to_end(path)
        while len(self.snapshots) > self.config.max_snapshots:
            self.snapshots.popitem(last=False)
        if req.path is not None:
            return types.SaveWeightsForSamplerResponseInternal(path=path).model_dump(mode="json")
        sampling_id = self._new_sampling_session(model.base, path)
        return types.SaveWeightsForSamplerResponseInternal(sampling_session_id=sampling_id).model_dump(mode="json")

    def sample(self, req: types.SampleRequest) -> Result:
        if req.sampling_session_id is not None:
            base, path = self._sampling_session(req.sampling_session_id)
        elif req.model_path is not None:
            base, path = self._snapshot(req.model_path)[0], req.model_path
        else:
            base, path = str(req.base_model), None
        unserved = {k: v for k, v in (("prompt_logprobs", req.prompt_logprobs), ("topk_prompt_logprobs",
                    req.topk_prompt_logprobs), ("topk_sample_logprobs", req.topk_sample_logprobs),
                    ("prompt_alt_tokens_k", req.prompt_alt_tokens_k)) if v}
        if unserved or req.target_prompt_logprobs is not None:
            raise ValueError(f"sample options {sorted(unserved) or ['target_prompt_logprobs']} are not served; "
                             f"this server returns the sampled tokens' log-probs only")
        sampler = self._sampler(base)
        prompt = req.prompt.to_ints()
        p = req.sampling_params
        stop = p.stop
        if stop is not None and not all(isinstance(s, int) for s in ([stop] if isinstance(stop, str) else stop)):
            raise ValueError(f"sampling_params.stop={stop!r}: stop strings are not served; pass token ids")
        room = sampler.engine.max_model_len - len(prompt)
        if room < 1:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the engine holds {sampler.engine.max_model_len}")
        params = SamplingParams(n=req.num_samples, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                max_tokens=p.max_tokens or room, seed=p.seed,
                                stop_token_ids=None if stop is None else [int(s) for s in stop])
        snapshot = None if path is None else self._snapshot(path)[1]
        return sample_response(sampler.sample(path, snapshot, prompt, params))

    # ---- lookups ----------------------------------------------------------------------------------
    def _model(self, model_id: str) -> _Model:
        if model_id not in self.models:
            raise ValueError(f"model_id {model_id!r} is unknown; known: {sorted(self.models)}")
        return self.models[model_id]

    def _checkpoint_file(self, path: str) -> Path:
        match = _CHECKPOINT.fullmatch(path)
        if match is None:
            raise ValueError(f"checkpoint path {path!r} is not one save_state returned (tinker://MODEL/weights/NAME)")
        return self.config.checkpoint_dir / match[1] / f"{match[2]}.pt"

    def _snapshot(self, path: str) -> tuple[str, Snapshot]:
        if path not in self.snapshots:
            raise ValueError(f"sampler weights {path!r} are unknown (never saved, or dropped: the server keeps "
                             f"the last {self.config.max_snapshots}); kept: {list(self.snapshots)}")
        return self.snapshots[path]

    def _sampling_session(self, sampling_id: str) -> tuple[str, str | None]:
        if sampling_id not in self.sampling_sessions:
            raise ValueError(f"sampling session {sampling_id!r} is unknown")
        return self.sampling_sessions[sampling_id]

    def _sampler(self, base: str) -> Sampler:
        if base not in self.samplers:
            self.samplers[base] = Sampler(self.base_path(base), self.config.device, self.config.max_num_seqs)
        return self.samplers[base]

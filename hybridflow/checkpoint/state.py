"""What goes into a checkpoint and how it comes back: sharded model/optimizer state and small state.

Layout of one checkpoint directory (written inside `CheckpointManager.begin`'s temp dir):

    config.yaml            the resolved run config
    meta.json              step, world sizes, versions, anything the controller adds
    controller.pt          the controller's small state (LR schedulers, KL controller, data-loader
                           position, ...) and its RNG state
    <role>/model/          torch.distributed.checkpoint (DCP) shards of the model (with LoRA, of its
                           trained parameters only: the frozen ones are the model directory's)
    <role>/optim/          DCP shards of the optimizer state (keys are parameter names)
    <role>/state.pt        the role's small state (e.g. its LR scheduler), written by rank 0
    <role>/rng_rank<R>.pt  RNG state of worker rank R

Model and optimizer go through `torch.distributed.checkpoint.state_dict.get_state_dict /
set_state_dict` and `dcp.save / dcp.load`, so a model sharded by FSDP2 `fully_shard` over N processes
loads into M processes (or a plain module in one process): DCP reshards. With no process group
initialised everything runs in the calling process (`no_dist=True`).

Small state is a mapping name → object with `state_dict()` / `load_state_dict()` (LR scheduler, KL
controller, a stateful data loader) or plain data (ints, floats, strings, lists, dicts, tensors). It
is checked at save time to load back with `torch.load(weights_only=True)`, so a bad value fails on
the first save, not at resume a week later.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import io
import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from hybridflow.checkpoint.manager import CheckpointError
from hybridflow.checkpoint.rng import capture_rng_state, restore_rng_state

CONFIG_FILE, META_FILE, CONTROLLER_FILE = "config.yaml", "meta.json", "controller.pt"
ROLE_STATE_FILE = "state.pt"
ALIASES_KEY = "_hybridflow_tied_aliases"

__all__ = ["ControllerState", "capture_rng_state", "estimate_checkpoint_bytes", "load_controller_state",
           "load_model_state", "load_worker_state", "read_config", "read_full_model_state", "read_meta",
           "restore_rng_state", "save_controller_state", "save_model_state", "save_worker_state"]


def _dist_args(process_group) -> dict[str, Any]:
    if dist.is_available() and dist.is_initialized():
        return {"process_group": process_group}
    return {"no_dist": True}


@contextlib.contextmanager
def _single_process_quiet():
    """Silence DCP's warning that it runs in one process: with no process group that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield


def _rank(process_group) -> int:
    return dist.get_rank(process_group) if dist.is_available() and dist.is_initialized() else 0


def _check_shapes(path: Path, state_dict: Mapping[str, Any], what: str, exact_keys: bool) -> None:
    """Refuse, with the keys named, a checkpoint whose tensors do not match `state_dict`'s (and, with
    `exact_keys`, one holding tensors the model lacks, e.g. the layers of a deeper model)."""
    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    problems = []
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            continue
        meta = saved.get(key)
        if meta is None:
            problems.append(f"{key}: missing in the checkpoint")
        elif hasattr(meta, "size") and tuple(meta.size) != tuple(value.shape):
            problems.append(f"{key}: checkpoint {list(meta.size)} vs now {list(value.shape)}")
    if exact_keys:
        problems += [f"{key}: in the checkpoint, not in the model" for key, meta in saved.items()
                     if isinstance(meta, TensorStorageMetadata) and key not in state_dict]
    if problems:
        shown = "; ".join(problems[:8]) + (f"; ... {len(problems) - 8} more" if len(problems) > 8 else "")
        raise CheckpointError(f"{what} at {path} does not fit this model ({shown}); was it saved "
                              f"from another model?")


def _split_aliases(model: torch.nn.Module, state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(the state dict with each tied parameter once, {alias key: key it repeats}): a tied
    `lm_head.weight` is written once, as `model.embed_tokens.weight`, and restored from it. Ties come
    from parameter identity, so every rank finds the same ones whatever its shards hold."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        source = first.setdefault(id(param), name)
        if source != name and name in state_dict and source in state_dict:
            aliases[name] = source
    return {key: value for key, value in state_dict.items() if key not in aliases}, aliases


def _state_dicts(model: torch.nn.Module, optimizers: tuple, trainable_only: bool) -> tuple[dict, dict]:
    """`get_state_dict`'s model and optimizer state dicts; with `trainable_only`, of the parameters that require
    grad alone (a LoRA model's adapters: its model directory holds the rest). DCP's own option drops a frozen
    parameter under one name only, so a frozen tied `lm_head.weight` would stay: names are filtered here."""
    model_sd, optim_sd = get_state_dict(model, optimizers, options=_options(trainable_only))
    if trainable_only:
        trained = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
        model_sd = {key: value for key, value in model_sd.items() if key in trained}
    return model_sd, optim_sd


def _options(trainable_only: bool) -> StateDictOptions:
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def save_model_state(path: str | Path, model: torch.nn.Module,
                     optimizer: torch.optim.Optimizer | None = None, *, process_group=None,
                     trainable_only: bool = False) -> None:
    """Save `model` (plain or FSDP2-sharded) to `<path>/model/` and `optimizer` to `<path>/optim/`;
    `trainable_only`: only the parameters that require grad (LoRA adapters).

    Collective over `process_group` when torch.distributed is initialised: every rank calls it with
    the same `path` and writes its own shards. Tied parameters are written once (`_split_aliases`).
    """
    path = Path(path)
    optimizers = (optimizer,) if optimizer is not None else ()
    model_sd, optim_sd = _state_dicts(model, optimizers, trainable_only)
    unique, aliases = _split_aliases(model, model_sd)
    unique[ALIASES_KEY] = json.dumps(aliases)
    with _single_process_quiet():
        dcp.save(unique, checkpoint_id=str(path / "model"), **_dist_args(process_group))
        if optimizer is not None:
            dcp.save(optim_sd, checkpoint_id=str(path / "optim"), **_dist_args(process_group))


def load_model_state(path: str | Path, model: torch.nn.Module,
                     optimizer: torch.optim.Optimizer | None = None, *, process_group=None,
                     trainable_only: bool = False) -> None:
    """Load what `save_model_state` wrote into `model` (and `optimizer`), in place, resharding to the
    current world size (`trainable_only` as it was saved). The optimizer may be fresh (no step taken
    yet). Keys and shapes are checked first."""
    path = Path(path)
    if not (path / "model").is_dir():
        raise CheckpointError(f"no model state at {path / 'model'}; is {path} a role dir of a checkpoint?")
    if optimizer is not None and not (path / "optim").is_dir():
        raise CheckpointError(f"no optimizer state at {path / 'optim'}; pass optimizer=None to load "
                              f"the weights only")
    optimizers = (optimizer,) if optimizer is not None else ()
    model_sd, optim_sd = _state_dicts(model, optimizers, trainable_only)
    unique, aliases = _split_aliases(model, model_sd)
    _check_shapes(path / "model", unique, "model state", exact_keys=True)
    with _single_process_quiet():
        dcp.load(unique, checkpoint_id=str(path / "model"), **_dist_args(process_group))
        if optimizer is not None:
            dcp.load(optim_sd, checkpoint_id=str(path / "optim"), **_dist_args(process_group))
    unique.update({alias: unique[source] for alias, source in aliases.items()})
    set_state_dict(model, optimizers, model_state_dict=unique,
                   optim_state_dict=optim_sd if optimizer is not None else {}, options=_options(trainable_only))


def read_full_model_state(path: str | Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU tensors of `<path>/model/`, whatever world size saved it, read in this
    process alone: {parameter name: tensor} (tied names share one tensor), floating tensors cast to
    `dtype` when given."""
    reader = FileSystemReader(str(Path(path) / "model"))
    metadata = reader.read_metadata()
    state: dict[str, Any] = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
                             for key, meta in metadata.state_dict_metadata.items()
                             if isinstance(meta, TensorStorageMetadata)}
    state[ALIASES_KEY] = ""
    with _single_process_quiet():
        dcp.load(state, storage_reader=reader, no_dist=True)
    aliases = json.loads(state.pop(ALIASES_KEY))
    if dtype is not None:
        state = {key: value.to(dtype) if value.is_floating_point() else value for key, value in state.items()}
    state.update({alias: state[source] for alias, source in aliases.items()})
    return state


def estimate_checkpoint_bytes(*modules: torch.nn.Module, optimizer_slots: int = 2) -> int:
    """Disk bytes one checkpoint of `modules` needs: every distinct parameter at its dtype (global
    size, also under FSDP2), plus `optimizer_slots` fp32 tensors per trainable parameter (AdamW: 2).
    Modules on the meta device work, so it can be called before any weights load."""
    seen, total = set(), 0
    for module in modules:
        for param in module.parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            total += param.numel() * param.element_size()
            if param.requires_grad:
                total += optimizer_slots * param.numel() * 4
    return total


def _state_of(value: Any) -> Any:
    return value.state_dict() if hasattr(value, "state_dict") and hasattr(value, "load_state_dict") else value


def _write_small_state(path: Path, state: Mapping[str, Any]) -> None:
    """torch.save `state`, refusing (with the entry named) anything weights_only loading rejects."""
    for name, value in state.items():
        buffer = io.BytesIO()
        try:
            torch.save(value, buffer)
            buffer.seek(0)
            torch.load(buffer, weights_only=True)
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint entry {name!r} ({type(value).__name__}) would not load back safely: "
                f"{str(exc).splitlines()[0]}; keep small state to tensors, numbers, strings, lists "
                f"and dicts") from None
    torch.save(dict(state), path)


def _read_small_state(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"missing {path}; the checkpoint is incomplete or from another layout")
    return torch.load(path, weights_only=True, map_location="cpu")


def _load_into(saved: Mapping[str, Any], stateful: Mapping[str, Any] | None, where: Path) -> dict[str, Any]:
    """Load saved entries into the objects of `stateful`; return the saved entries not consumed."""
    stateful = stateful or {}
    missing = [name for name in stateful if name not in saved]
    if missing:
        raise CheckpointError(f"{where} has no state for {missing}; it holds {sorted(saved)}")
    for name, target in stateful.items():
        if not hasattr(target, "load_state_dict"):
            raise TypeError(f"stateful[{name!r}] ({type(target).__name__}) has no load_state_dict(); "
                            f"plain values come back in the returned dict instead")
        target.load_state_dict(saved[name])
    return {name: value for name, value in saved.items() if name not in stateful}


def save_worker_state(role_dir: str | Path, model: torch.nn.Module,
                      optimizer: torch.optim.Optimizer | None = None,
                      stateful: Mapping[str, Any] | None = None, *, process_group=None,
                      trainable_only: bool = False) -> None:
    """Everything a worker rank owns: model (`trainable_only`: its trained parameters) + optimizer shards
    (collective), its RNG state as `rng_rank<R>.pt`, and (rank 0 only) `stateful` as `state.pt`."""
    role_dir = Path(role_dir)
    role_dir.mkdir(parents=True, exist_ok=True)
    save_model_state(role_dir, model, optimizer, process_group=process_group, trainable_only=trainable_only)
    rank = _rank(process_group)
    torch.save(capture_rng_state(), role_dir / f"rng_rank{rank}.pt")
    if rank == 0:
        _write_small_state(role_dir / ROLE_STATE_FILE, {k: _state_of(v) for k, v in (stateful or {}).items()})


def load_worker_state(role_dir: str | Path, model: torch.nn.Module,
                      optimizer: torch.optim.Optimizer | None = None,
                      stateful: Mapping[str, Any] | None = None, *, process_group=None,
                      trainable_only: bool = False) -> dict[str, Any]:
    """Load what `save_worker_state` wrote, on any number of ranks; return the saved small-state
    entries not named in `stateful`. Rank R restores `rng_rank<R>.pt`; a rank that did not exist when
    the checkpoint was saved (the world grew) keeps its current RNG state."""
    role_dir = Path(role_dir)
    load_model_state(role_dir, model, optimizer, process_group=process_group, trainable_only=trainable_only)
    rng_file = role_dir / f"rng_rank{_rank(process_group)}.pt"
    if rng_file.is_file():
        restore_rng_state(torch.load(rng_file, weights_only=True))
    return _load_into(_read_small_state(role_dir / ROLE_STATE_FILE), stateful, role_dir)


def _plain(value: Any) -> Any:
    """A config as YAML-safe builtins: OmegaConf containers, dataclasses, paths and enums converted."""
    if type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return _plain(OmegaConf.to_container(value, resolve=True, enum_to_str=True))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, Path):
        return str(value)
    return value


@dataclasses.dataclass
class ControllerState:
    """What `load_controller_state` returns: the step, the saved config and meta, and the saved
    small-state entries that were not loaded into an object (plain values such as a data position)."""

    step: int
    config: dict
    meta: dict
    values: dict[str, Any]


def save_controller_state(checkpoint_dir: str | Path, step: int, config: Any,
                          stateful: Mapping[str, Any] | None = None,
                          meta: Mapping[str, Any] | None = None) -> None:
    """Write the controller's part: `config.yaml` (resolved), `meta.json` (step + `meta`), and
    `controller.pt` with every `stateful` entry, the step and this process's RNG state."""
    checkpoint_dir = Path(checkpoint_dir)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    (checkpoint_dir / CONFIG_FILE).write_text(yaml.safe_dump(_plain(config), sort_keys=False))
    meta = {"step": step, "torch": torch.__version__, **_plain(dict(meta or {}))}
    (checkpoint_dir / META_FILE).write_text(json.dumps(meta, indent=1))
    state = {name: _state_of(value) for name, value in (stateful or {}).items()}
    reserved = {"step", "rng"} & set(state)
    if reserved:
        raise ValueError(f"stateful names {sorted(reserved)} are reserved; rename them")
    _write_small_state(checkpoint_dir / CONTROLLER_FILE, {**state, "step": step, "rng": capture_rng_state()})


def read_config(checkpoint_dir: str | Path) -> dict:
    """The resolved config a checkpoint was saved with."""
    path = Path(checkpoint_dir) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"missing {path}; is {checkpoint_dir} a hybridflow checkpoint?")
    return yaml.safe_load(path.read_text()) or {}


def read_meta(checkpoint_dir: str | Path) -> dict:
    """The `meta.json` of a checkpoint (step, versions, world sizes, ...)."""
    path = Path(checkpoint_dir) / META_FILE
    if not path.is_file():
        raise CheckpointError(f"missing {path}; is {checkpoint_dir} a hybridflow checkpoint?")
    return json.loads(path.read_text())


def load_controller_state(checkpoint_dir: str | Path, stateful: Mapping[str, Any] | None = None,
                          restore_rng: bool = True) -> ControllerState:
    """Load the controller's part into the `stateful` objects (and, by default, its RNG state)."""
    checkpoint_dir = Path(checkpoint_dir)
    saved = _read_small_state(checkpoint_dir / CONTROLLER_FILE)
    step, rng = saved.pop("step"), saved.pop("rng")
    values = _load_into(saved, stateful, checkpoint_dir / CONTROLLER_FILE)
    if restore_rng:
        restore_rng_state(rng)
    return ControllerState(step=int(step), config=read_config(checkpoint_dir),
                           meta=read_meta(checkpoint_dir), values=values)

"""How a controller call on a worker group is split over the ranks and how results come back.

`@register(Dispatch.X, ...)` marks a `Worker` method as callable from the controller; the group
uses `scatter` to build each rank's arguments and `gather` to collect the per-rank results.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from hybridflow.batch import Batch

F = TypeVar("F", bound=Callable[..., Any])  # a decorated method keeps its signature for type checkers
_ATTR = "__hybridflow_dispatch__"
COLLECT_MODES = ("default", "all", "same")


class Dispatch(enum.Enum):
    """Dispatch modes of a registered worker method.

    - ``BROADCAST``: every rank gets the same arguments; returns rank 0's result
      (``collect="all"``: the list of every rank's result).
    - ``DATA_PARALLEL``: each `Batch` argument is split over the ranks in order (uneven sizes, or
      ``pad=True`` to pad to a multiple of the world size and strip the padding from the results);
      other arguments are broadcast. Batch results are concatenated in rank order, other results
      come back as a list with one entry per rank.
    - ``RANK_ZERO``: only rank 0 runs the method (it must not use collectives); returns its result.
    - ``PER_RANK``: every argument is a list of ``world_size`` values, one per rank; returns the
      list of per-rank results.

    With ``collect="same"`` (any mode but ``RANK_ZERO``) the method promises a result equal on every
    rank (e.g. metrics already reduced over the ranks): the call returns that one result, and fails,
    naming the method, the rank and the differing keys, when the ranks disagree.
    """

    BROADCAST = "broadcast"
    DATA_PARALLEL = "data_parallel"
    RANK_ZERO = "rank_zero"
    PER_RANK = "per_rank"


@dataclass(frozen=True)
class DispatchSpec:
    """What `@register` recorded on a method."""

    mode: Dispatch
    collect: str = "default"
    pad: bool = False


def register(mode: Dispatch = Dispatch.BROADCAST, *, collect: str = "default",
             pad: bool = False) -> Callable[[F], F]:
    """Decorator exposing a `Worker` method to the controller with the given dispatch mode.

    Args:
        mode: a `Dispatch` member.
        collect: ``"default"``; ``"all"`` with ``Dispatch.BROADCAST`` to get every rank's result; ``"same"``
            for a result equal on every rank, returned once (checked; see `Dispatch`).
        pad: with ``Dispatch.DATA_PARALLEL``, pad Batch arguments to a multiple of the world size
            (repeating their last rows) and strip the padding rows from Batch results.
    """
    if not isinstance(mode, Dispatch):
        raise TypeError(
            f"register() takes a Dispatch member ({', '.join(m.name for m in Dispatch)}), got {mode!r}"
            + ("; write @register(Dispatch.BROADCAST) with parentheses" if callable(mode) else "")
        )
    if collect not in COLLECT_MODES:
        raise ValueError(f"collect={collect!r} is not valid; valid: {', '.join(map(repr, COLLECT_MODES))}")
    if (collect == "all" and mode is not Dispatch.BROADCAST) or (collect == "same" and mode is Dispatch.RANK_ZERO):
        raise ValueError(
            f"collect={collect!r} is not valid with {mode}; collect='all' exists only for Dispatch.BROADCAST, "
            f"collect='same' for every mode that runs on all ranks (not Dispatch.RANK_ZERO)"
        )
    if pad and mode is not Dispatch.DATA_PARALLEL:
        raise ValueError(f"pad=True is only valid with Dispatch.DATA_PARALLEL, not {mode}")
    spec = DispatchSpec(mode, collect, pad)

    def decorate(fn: F) -> F:
        setattr(fn, _ATTR, spec)
        return fn

    return decorate


def dispatch_spec(cls: type, name: str) -> DispatchSpec | None:
    """The spec registered for `cls.name`, looked up along the MRO (an undecorated override inherits)."""
    for klass in cls.__mro__:
        fn = klass.__dict__.get(name)
        spec = getattr(fn, _ATTR, None)
        if spec is not None:
            return spec
    return None


def registered_methods(cls: type) -> dict[str, DispatchSpec]:
    """All controller-callable methods of `cls` with their specs."""
    names = {n for klass in cls.__mro__ for n in klass.__dict__}
    specs = {n: dispatch_spec(cls, n) for n in sorted(names)}
    return {n: s for n, s in specs.items() if s is not None}


@dataclass
class Scattered:
    """Per-rank calls: ``calls[i] = (rank, args, kwargs)``; `n_pad` padding rows to strip after."""

    calls: list[tuple[int, tuple, dict]]
    n_pad: int = 0
    padded_len: int = 0


def scatter(spec: DispatchSpec, method: str, args: tuple, kwargs: dict, world_size: int) -> Scattered:
    """Builds each rank's arguments for one controller call."""
    if spec.mode is Dispatch.BROADCAST:
        return Scattered([(r, args, kwargs) for r in range(world_size)])
    if spec.mode is Dispatch.RANK_ZERO:
        return Scattered([(0, args, kwargs)])
    if spec.mode is Dispatch.PER_RANK:
        for name, value in [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
            if not isinstance(value, (list, tuple)) or len(value) != world_size:
                got = type(value).__name__
                if isinstance(value, (list, tuple)):
                    got += f" of length {len(value)}"
                raise ValueError(
                    f"{method} is Dispatch.PER_RANK: {name} must be a list of {world_size} values "
                    f"(one per rank), got {got}"
                )
        return Scattered(
            [(r, tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}) for r in range(world_size)]
        )
    return _scatter_data_parallel(spec, method, args, kwargs, world_size)


def _scatter_data_parallel(
    spec: DispatchSpec, method: str, args: tuple, kwargs: dict, world_size: int
) -> Scattered:
    named = [*((str(i), a) for i, a in enumerate(args)), *kwargs.items()]
    lengths = {name: len(v) for name, v in named if isinstance(v, Batch)}
    if not lengths:
        raise TypeError(f"{method} is Dispatch.DATA_PARALLEL but got no Batch argument to split")
    if len(set(lengths.values())) > 1:
        raise ValueError(f"{method}: Batch arguments must have equal lengths to split together, got {lengths}")
    n_pad = 0
    pieces: dict[str, list[Batch]] = {}
    for name, value in named:
        if isinstance(value, Batch):
            if spec.pad:
                value, n_pad = value.pad_to_multiple(world_size)
            pieces[name] = value.chunk(world_size, allow_empty=True)
    padded_len = next(iter(lengths.values())) + n_pad
    calls = []
    for r in range(world_size):
        rank_args = tuple(pieces[str(i)][r] if str(i) in pieces else a for i, a in enumerate(args))
        rank_kwargs = {k: pieces[k][r] if k in pieces else v for k, v in kwargs.items()}
        calls.append((r, rank_args, rank_kwargs))
    return Scattered(calls, n_pad, padded_len)


def gather(spec: DispatchSpec, method: str, scattered: Scattered, results: list[Any]) -> Any:
    """Collects the per-rank results (ordered like ``scattered.calls``) into the call's return value."""
    if spec.collect == "same":
        return _agreed(method, results)
    if spec.mode is Dispatch.RANK_ZERO or (spec.mode is Dispatch.BROADCAST and spec.collect == "default"):
        return results[0]
    if spec.mode is not Dispatch.DATA_PARALLEL or not all(isinstance(r, Batch) for r in results):
        return list(results)
    merged = Batch.concat(results)
    if scattered.n_pad:
        if len(merged) != scattered.padded_len:
            raise ValueError(
                f"{method} (pad=True) returned {len(merged)} rows in total for {scattered.padded_len} "
                f"padded input rows; padding can only be stripped when each rank returns one row per input row"
            )
        merged = merged.unpad(scattered.n_pad)
    return merged


def _equal(a: Any, b: Any) -> bool:
    """`a == b`, element-wise for dicts, lists and tuples, `torch.equal` for tensors, NaN equal to NaN."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def _agreed(method: str, results: list[Any]) -> Any:
    """The one result every rank returned (`collect="same"`); a disagreement names the rank and the keys."""
    first = results[0]
    for rank, other in enumerate(results[1:], start=1):
        if _equal(first, other):
            continue
        if isinstance(first, dict) and isinstance(other, dict):
            keys = [k for k in sorted({*first, *other}, key=str)
                    if k not in first or k not in other or not _equal(first[k], other[k])]
            where = "; ".join(f"{k}: {first.get(k, '<absent>')!r} vs {other.get(k, '<absent>')!r}"
                              for k in keys[:5])
        else:
            where = f"{first!r:.200} vs {other!r:.200}"
        raise ValueError(f"{method} is registered with collect='same' but rank {rank}'s result differs from "
                         f"rank 0's ({where}); reduce the value over the ranks in the method, or use the "
                         f"default collect to get one result per rank")
    return first

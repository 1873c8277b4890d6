"""`colocate(actor=A, ref=B)`: several roles sharing one process (and device) per rank.

The returned class is itself a `Worker`; a group built from it exposes each member as an
attribute (``group.actor.method(...)``), and each member sees the same rank, device and process
group with its own `role` (the keyword it was given).
"""

from __future__ import annotations

import copyreg
from dataclasses import replace
from typing import Any, cast

from hybridflow.controller.worker import Worker, WorkerContext


class _ColocatedMeta(type):
    """Metaclass so classes made by `colocate` pickle as their member list (they have no import path)."""


class ColocatedWorker(Worker, metaclass=_ColocatedMeta):
    """Holds one instance of each member role; built by `colocate`."""

    members: dict[str, type[Worker]] = {}
    instances: dict[str, Worker]  # this rank's member workers, by name

    @classmethod
    def create(cls, context: WorkerContext, init_kwargs: dict | None = None) -> Worker:
        """`init_kwargs` maps member name -> that member's constructor kwargs."""
        init_kwargs = dict(init_kwargs or {})
        unknown = set(init_kwargs) - set(cls.members)
        if unknown:
            raise ValueError(
                f"init_kwargs of a colocated worker are keyed by member; unknown {sorted(unknown)}, "
                f"members are {sorted(cls.members)}"
            )
        obj = cls.__new__(cls)
        obj._bind(context)
        obj.instances = {
            name: member.create(replace(context, role=name), init_kwargs.get(name))
            for name, member in cls.members.items()
        }
        return obj


def colocate(**members: type[Worker]) -> type[ColocatedWorker]:
    """A worker class whose single process per rank holds one instance of each member class."""
    if not members:
        raise ValueError("colocate() needs at least one member, e.g. colocate(actor=ActorWorker, ref=RefWorker)")
    for name, member in members.items():
        if not (isinstance(member, type) and issubclass(member, Worker)):
            raise TypeError(f"colocate member '{name}' must be a Worker subclass, got {member!r}")
        if issubclass(member, ColocatedWorker):
            raise TypeError(f"colocate member '{name}' is itself colocated; list its members directly")
        if name in Worker.__dict__ or name.startswith("_"):
            raise ValueError(f"colocate member name '{name}' clashes with a Worker attribute; pick another")
    label = "_".join(members)
    return cast(type[ColocatedWorker], _ColocatedMeta(
        f"Colocated_{label}", (ColocatedWorker,), {"members": dict(members), "__module__": __name__}
    ))


def _rebuild(members: dict[str, type[Worker]]) -> type[ColocatedWorker]:
    return colocate(**members)


def _reduce_colocated(cls: Any) -> str | tuple:
    return cls.__qualname__ if cls is ColocatedWorker else (_rebuild, (cls.members,))


copyreg.pickle(_ColocatedMeta, _reduce_colocated)

"""How a config field is declared: `opt(default, help, choices)` keeps a field's one-line help and its valid
choices in the dataclass field's metadata, where the loader's errors and the generated `docs/config.md` read
them; `registered(attr)` makes choices of a registry that users extend; `field_default` reads a field's default
back."""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable
from dataclasses import MISSING, field, is_dataclass
from typing import Any


def registered(attr: str) -> Callable[[], tuple[str, ...]]:
    """Choices read from `hybridflow.algorithms.<attr>` (a registry or a tuple) when they are checked,
    so an estimator or loss a user registers before loading the config is accepted."""

    def names() -> tuple[str, ...]:
        return tuple(getattr(importlib.import_module("hybridflow.algorithms"), attr))

    return names


def opt(default: Any, help: str, choices: tuple | Callable[[], tuple] | None = None) -> Any:
    """A dataclass field with its default, a one-line `help` and optional valid `choices`
    (a tuple, or a function returning one, for names that live in a registry).

    Mutable defaults (lists, dicts, tuples are fine as is) and nested config classes become
    default factories, so every instance gets its own copy.
    """
    metadata: dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = choices if callable(choices) else tuple(choices)
    if isinstance(default, type) and is_dataclass(default):
        return field(default_factory=default, metadata=metadata)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def field_default(f) -> Any:
    """The default value of a dataclass field (calling its factory when it has one)."""
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING

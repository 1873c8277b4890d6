"""`Registry`: a name -> function table with did-you-mean lookup and config filtering.

One `Registry` backs each family (advantage estimators, policy losses), so a user adds an entry by
name with a decorator instead of editing our code. `call` forwards only the configuration keys the
entry's signature accepts, so a trainer can hand its whole algorithm config to any entry; a key that
no entry of the family accepts is an error with a did-you-mean.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any


def did_you_mean(name: str, choices: list[str]) -> str:
    """A ' Did you mean ...?' suffix for an error message, or '' when nothing is close."""
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else ""


class Registry(Mapping[str, Callable[..., Any]]):
    """Named functions of one family, e.g. `Registry("advantage estimator", n_args=1)`.

    Every entry takes `n_args` leading positional inputs (the data), then keyword options.
    Read it like a dict (`registry["gae"]`, `"gae" in registry`, `list(registry)`); add to it with
    `@registry.register("name")`; fetch with `registry.get_fn("name")` (clear error when unknown).
    """

    def __init__(self, kind: str, n_args: int) -> None:
        self.kind = kind
        self.n_args = n_args
        self._fns: dict[str, Callable[..., Any]] = {}

    def __getitem__(self, name: str) -> Callable[..., Any]:
        return self._fns[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fns)

    def __len__(self) -> int:
        return len(self._fns)

    def register(self, name: str, override: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator adding `fn` under `name`; a second, different function under a taken name needs `override=True`."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r}")

        def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
            taken = self._fns.get(name)
            if taken is not None and taken is not fn and not override:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered ({taken.__module__}.{taken.__qualname__}); "
                    f"pass override=True to replace it"
                )
            self._fns[name] = fn
            return fn

        return decorator

    def unregister(self, name: str) -> Callable[..., Any]:
        """Remove and return entry `name` (e.g. a plugin's, in its teardown)."""
        fn = self.get_fn(name)
        del self._fns[name]
        return fn

    def get_fn(self, name: str) -> Callable[..., Any]:
        """The function registered under `name`; a `ValueError` naming the valid ones otherwise."""
        if name not in self._fns:
            names = sorted(self._fns)
            raise ValueError(f"unknown {self.kind} {name!r}.{did_you_mean(str(name), names)} Registered: {names}")
        return self._fns[name]

    def known_keys(self) -> set[str]:
        """Every keyword parameter accepted by some registered function."""
        keys: set[str] = set()
        for fn in self._fns.values():
            keys.update(_keyword_params(fn, self.n_args)[0])
        return keys

    def call(self, name: str, args: tuple[Any, ...], config: Mapping[str, Any]) -> Any:
        """Call entry `name` with `*args` and the keys of `config` its signature accepts.

        A key accepted by no entry of this registry raises `TypeError` (a typo, most likely); a key
        another entry accepts (e.g. `lam` given to `grpo`) is silently left out. An entry taking
        `**kwargs` receives the whole config.
        """
        fn = self.get_fn(name)
        params, takes_any = _keyword_params(fn, self.n_args)
        if takes_any:
            return fn(*args, **config)
        known = self.known_keys()
        unknown = sorted(set(config) - known)
        if unknown:
            raise TypeError(
                f"unknown {self.kind} option {unknown[0]!r}.{did_you_mean(unknown[0], sorted(known))} "
                f"Options any {self.kind} accepts: {sorted(known)}"
            )
        return fn(*args, **{k: v for k, v in config.items() if k in params})


def _keyword_params(fn: Callable[..., Any], n_args: int) -> tuple[set[str], bool]:
    """(option names `fn` accepts after its `n_args` data inputs, whether it takes **kwargs)."""
    params = list(inspect.signature(fn).parameters.values())[n_args:]
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names, any(p.kind is p.VAR_KEYWORD for p in params)

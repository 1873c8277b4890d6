"""How a reward function's parameters are filled: by keyword, from the names hybridflow has, bound once.

Two shapes of function are recognised from their signature:

- **per row** (verl's): ``fn(data_source, solution_str, ground_truth, extra_info, **reward.kwargs)``
  returning a float or a dict with ``score``. It is called by keyword with those of verl's names it
  declares, so ``compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0)``
  (verl's own ``reward_score`` modules) gets the response and the ground truth and keeps its defaults. A
  required first parameter of another name (``model_output``, ``predict_str``: verl's math_verify, geo3k,
  prime_math) is the response, passed by position.
- **batched** (TRL's): a function with a parameter named ``completions``, ``completion_ids`` or ``prompts``,
  e.g. ``fn(prompts, completions, completion_ids, **kwargs) -> list[float | None]``, called once per batch
  with lists: the prompts, the completions, their token ids and every dataset column, plus TRL's
  ``log_extra(column, values)`` and ``log_metric(name, value)``.

Either shape may be ``async def`` (`is_async`): the scorer awaits it (`hybridflow.rewards.scorer`).

A function taking ``**kwargs`` gets every name there is. A required parameter that no name fills is
refused when the function is bound (when the run starts), naming the parameter and the names there are;
so is a `reward.kwargs` key that the function does not take.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

ROW_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids")  # any of them makes a function TRL's batched shape
BATCH_ARGUMENTS = (*TRL_ARGUMENTS, "log_extra", "log_metric")


def is_batched(fn: Callable) -> bool:
    """A TRL-style batched function: it has a parameter named ``prompts``, ``completions`` or
    ``completion_ids``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature are per-row functions
        return False
    return any(name in params for name in TRL_ARGUMENTS)


def is_async(fn: Callable) -> bool:
    """An ``async def`` function (or a callable object whose ``__call__`` is one, or a partial of either)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


@dataclass(frozen=True)
class Binding:
    """Which names a function gets: `positional` (the names whose values it takes by position, in order: its
    positional-only parameters, or ``solution_str`` for a per-row function's first parameter of another name),
    `keywords` (by name) and whether it takes ``**kwargs`` (then it gets every name given); `unbound` are its
    required parameters that no known name fills (a batched function's dataset columns, checked later)."""

    fn: Callable
    positional: tuple[str, ...]
    keywords: tuple[str, ...]
    var_keyword: bool
    unbound: tuple[str, ...] = ()

    def call(self, values: Mapping[str, Any]) -> Any:
        """`fn` called with its share of `values` (a mapping of every name there is)."""
        args = [values[name] for name in self.positional]
        if self.var_keyword:
            kwargs = {k: v for k, v in values.items() if k not in self.positional}
        else:
            kwargs = {k: values[k] for k in self.keywords if k in values}
        return self.fn(*args, **kwargs)

    def names(self, name: str) -> bool:
        """Whether the function declares the argument `name` (a ``**kwargs`` function gets every name, but
        needs none of them)."""
        return name in self.positional or name in self.keywords


def bind(fn: Callable, where: str, names: Iterable[str], kwargs: Mapping[str, Any] | None = None,
         open_names: bool = False) -> Binding:
    """The `Binding` of `fn` to `names` (what hybridflow passes) plus the `kwargs` keys (`reward.kwargs`).

    `open_names`: names not known yet may fill required parameters (a batched function's dataset
    columns); they are listed in `Binding.unbound`. Without it (a per-row function), a required first
    parameter that no name fills gets ``solution_str`` by position. Raises TypeError naming `where`, the
    parameter and the names there are when a required parameter cannot be filled or a `kwargs` key is not
    taken.
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: trust it with every name
        return Binding(fn, (), (), True)
    known = [*names, *(kwargs or {})]
    params = list(sig.parameters.values())
    var_keyword = any(p.kind is p.VAR_KEYWORD for p in params)
    positional: list[str] = []
    keywords: list[str] = []
    unbound: list[str] = []
    for i, p in enumerate(params):
        if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        if (i == 0 and not open_names and p.name not in known and p.default is p.empty
                and p.kind is not p.KEYWORD_ONLY and "solution_str" in known):
            positional.append("solution_str")  # verl's scorers that call the response model_output, predict_str
        elif p.name in known:
            (positional if p.kind is p.POSITIONAL_ONLY else keywords).append(p.name)
        elif p.default is p.empty:
            if open_names and p.kind is not p.POSITIONAL_ONLY:
                unbound.append(p.name)
                continue
            first = "" if open_names else " (and the response by position to a first parameter of another name)"
            raise TypeError(f"reward function {where} (signature {sig}): its parameter {p.name!r} has no value to "
                            f"take; hybridflow passes {', '.join(known)} by keyword{first}. Rename the parameter or "
                            f"give it a default")
    declared = {p.name for p in params}
    extra = [k for k in kwargs or {} if k not in declared]
    if extra and not var_keyword:
        raise TypeError(f"reward kwargs {dict(kwargs or {})} do not fit reward function {where} (signature {sig}): "
                        f"it takes no parameter {', '.join(map(repr, extra))}")
    return Binding(fn, tuple(positional), tuple(keywords), var_keyword, tuple(unbound))

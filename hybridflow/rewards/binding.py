"""How a reward function's parameters are filled: by keyword, from the names hybridflow has, bound once.

Two shapes of function are recognised from their signature:

- **per row** (verl's): ``fn(data_source, solution_str, ground_truth, extra_info, **reward.kwargs)``
  returning a float or a dict with ``score``. It is called by keyword with those of verl's names it
  declares, so ``compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0)``
  (verl's own ``reward_score`` modules) gets the response and the ground truth and keeps its defaults.
- **batched** (TRL's): a function with a parameter named ``completions``, e.g.
  ``fn(prompts, completions, completion_ids, **kwargs) -> list[float | None]``, called once per batch
  with lists: the prompts, the completions, their token ids and every dataset column.

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
BATCH_ARGUMENTS = ("prompts", "completions", "completion_ids")


def is_batched(fn: Callable) -> bool:
    """A TRL-style batched function: it has a parameter named ``completions``."""
    try:
        return "completions" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature are per-row functions
        return False


@dataclass(frozen=True)
class Binding:
    """Which names a function gets: `positional` (its positional-only parameters, in order), `keywords` (by
    name) and whether it takes ``**kwargs`` (then it gets every name given); `unbound` are its required
    parameters that no known name fills (a batched function's dataset columns, checked later)."""

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

    def reads(self, name: str) -> bool:
        """Whether the function gets the argument `name`."""
        return self.var_keyword or name in self.positional or name in self.keywords


def bind(fn: Callable, where: str, names: Iterable[str], kwargs: Mapping[str, Any] | None = None,
         open_names: bool = False) -> Binding:
    """The `Binding` of `fn` to `names` (what hybridflow passes) plus the `kwargs` keys (`reward.kwargs`).

    `open_names`: names not known yet may fill required parameters (a batched function's dataset
    columns); they are listed in `Binding.unbound`. Raises TypeError naming `where`, the parameter and
    the names there are when a required parameter cannot be filled or a `kwargs` key is not taken.
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
    for p in params:
        if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        if p.name in known:
            (positional if p.kind is p.POSITIONAL_ONLY else keywords).append(p.name)
        elif p.default is p.empty:
            if open_names and p.kind is not p.POSITIONAL_ONLY:
                unbound.append(p.name)
                continue
            raise TypeError(f"reward function {where} (signature {sig}): its parameter {p.name!r} has no value to "
                            f"take; hybridflow passes {', '.join(known)} by keyword. Rename the parameter or give "
                            f"it a default")
    declared = {p.name for p in params}
    extra = [k for k in kwargs or {} if k not in declared]
    if extra and not var_keyword:
        raise TypeError(f"reward kwargs {dict(kwargs or {})} do not fit reward function {where} (signature {sig}): "
                        f"it takes no parameter {', '.join(map(repr, extra))}")
    return Binding(fn, tuple(positional), tuple(keywords), var_keyword, tuple(unbound))

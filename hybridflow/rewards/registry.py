"""The reward-function registry: built-in names, `auto` routing by `data_source`, and user files.

A reward function takes verl's arguments, by keyword (`hybridflow.rewards.binding`), so functions
written for verl work unchanged::

    fn(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None) -> float | dict

A dict result holds ``score`` plus extra values (logged as ``reward/<name>/mean``). `get_reward_fn`
turns a spec into such a function (`load_function` finds the function itself, batched TRL-style ones
too):

- a registered name (``gsm8k``, ``math``, ``reasoning_gym``, ``exact_match``, or one added with
  `register_reward`);
- ``auto``: the built-in is picked per row from ``data_source`` (see `AUTO_ROUTES`);
- ``path/to/file.py:function_name``: a user function loaded from a Python file;
- an import path, ``package.module.function`` or ``package.module:function`` (``trl.rewards.accuracy_reward``,
  ``verl.utils.reward_score.gsm8k.compute_score``): a function of an installed package.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import importlib.util
from collections.abc import Callable
from typing import Any

from hybridflow.rewards.binding import ROW_ARGUMENTS, bind, is_async, is_batched
from hybridflow.utils.imports import load_from_file, load_from_module

RewardFn = Callable[[str, str, Any, Any], "float | dict"]

REWARD_FUNCTIONS: dict[str, RewardFn] = {}
# name -> (module imported on first use, pip requirement that provides it)
REQUIREMENTS: dict[str, tuple[str, str]] = {}

# (fnmatch pattern on the lower-cased data_source, built-in name); the first match wins.
AUTO_ROUTES: list[tuple[str, str]] = [
    ("openai/gsm8k", "gsm8k"),
    ("gsm8k*", "gsm8k"),
    ("*/gsm8k*", "gsm8k"),
    ("lighteval/math*", "math"),
    ("digitallearninggmbh/math-lighteval", "math"),
    ("huggingfaceh4/math-500", "math"),
    ("math*", "math"),
    ("aime*", "math"),
    ("*/aime*", "math"),
    ("reasoning_gym*", "reasoning_gym"),
    ("reasoning-gym*", "reasoning_gym"),
]

def register_reward(name: str, requires: tuple[str, str] | None = None) -> Callable[[RewardFn], RewardFn]:
    """Decorator adding a reward function to `REWARD_FUNCTIONS` under `name`.

    ``@register_reward("my_task")`` then ``reward.function=my_task``. Re-registering a name replaces it.
    `requires` is ``(module, pip requirement)`` for a function that imports an optional package on
    first use; `check_requirements` refuses the name early, with the install command, when it is missing.
    """
    if not name or ":" in name or name == "auto":
        raise ValueError(f"invalid reward name {name!r}: it must be non-empty, not 'auto', and contain no ':'")

    def decorator(fn: RewardFn) -> RewardFn:
        REWARD_FUNCTIONS[name] = fn
        if requires:
            REQUIREMENTS[name] = requires
        else:
            REQUIREMENTS.pop(name, None)
        return fn

    return decorator


def check_requirements(name: str) -> None:
    """Raises ImportError, with the pip command, when the package reward `name` needs is not installed."""
    if name in REQUIREMENTS:
        module, requirement = REQUIREMENTS[name]
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"the {name!r} reward needs the {module} module: pip install '{requirement}'")


def register_route(pattern: str, name: str) -> None:
    """Routes data sources matching the fnmatch `pattern` (lower-cased) to reward `name` under ``auto``.

    New routes are tried before the built-in ones.
    """
    AUTO_ROUTES.insert(0, (pattern.lower(), name))


def route_data_source(data_source: str) -> str:
    """The registered reward name that ``auto`` uses for `data_source`.

    Raises:
        ValueError: naming the data source and the known patterns, when none matches.
    """
    key = str(data_source).lower()
    for pattern, name in AUTO_ROUTES:
        if fnmatch.fnmatchcase(key, pattern):
            return name
    patterns = ", ".join(f"{p} -> {n}" for p, n in AUTO_ROUTES)
    raise ValueError(
        f"reward.function=auto has no reward for data_source {data_source!r}; known data sources: "
        f"{patterns}. Set reward.function to one of {sorted(REWARD_FUNCTIONS)} or to "
        f"'path/to/file.py:function_name'"
    )


def auto_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float | dict:
    """Scores with the built-in that `route_data_source` picks for this row's `data_source`."""
    return REWARD_FUNCTIONS[route_data_source(data_source)](data_source, solution_str, ground_truth, extra_info)


def load_function(spec: str | Callable) -> tuple[Callable, str]:
    """``(function, how to name it in errors)`` for a spec: a callable, a registered name,
    ``path/to/file.py:function_name`` (path relative to the working directory, or absolute) or an import path
    (``package.module:function`` or ``package.module.function``, e.g. ``trl.rewards.accuracy_reward``).
    ``auto`` and unknown names are `get_reward_fn`'s to handle."""
    if callable(spec):
        return spec, getattr(spec, "__name__", repr(spec))
    if not isinstance(spec, str) or not spec:
        raise TypeError(f"reward.function must be a name, 'file.py:function' or 'package.module.function', "
                        f"got {spec!r}")
    if spec in REWARD_FUNCTIONS:
        check_requirements(spec)
        return REWARD_FUNCTIONS[spec], repr(spec)
    by_file = spec.endswith(".py") or ".py:" in spec or "/" in spec.partition(":")[0]
    if by_file or ":" in spec or "." in spec:
        fn = (load_from_file(spec, "reward", "function", "reward.function") if by_file
              else load_from_module(spec, "reward function", "reward.function"))
        if not callable(fn):
            raise TypeError(f"reward.function={spec!r} is a {type(fn).__name__}, not a function")
        return fn, spec
    hint = difflib.get_close_matches(spec, list(REWARD_FUNCTIONS), n=1)
    raise ValueError(
        f"unknown reward function {spec!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
        + f"; valid: auto, {', '.join(sorted(REWARD_FUNCTIONS))}, 'path/to/file.py:function_name' or an import "
          f"path 'package.module.function'"
    )


def get_reward_fn(spec: str | Callable, kwargs: dict | None = None) -> RewardFn:
    """The per-row reward function named by `spec` (see the module docstring), callable as
    ``fn(data_source, solution_str, ground_truth, extra_info)``, with `kwargs` bound.

    The function is called by keyword with the parameters it declares (`hybridflow.rewards.binding`);
    one whose parameters cannot all be filled is refused here, naming the parameter. A batched (TRL-style)
    function scores whole batches: `hybridflow.rewards.scorer.Scorer` calls those.

    Args:
        spec: a registered name, ``auto``, ``path/to/file.py:function_name``, or a callable.
        kwargs: extra keyword arguments for the function (e.g. ``{"method": "flexible"}`` for gsm8k);
            not allowed with ``auto``, whose rows may reach different functions.
    """
    if spec == "auto":
        if kwargs:
            raise ValueError(f"reward kwargs {sorted(kwargs)} cannot be used with reward.function=auto; "
                             f"name the function instead (one of {sorted(REWARD_FUNCTIONS)})")
        return auto_reward
    fn, where = load_function(spec)
    if is_batched(fn):
        raise TypeError(f"reward function {where} is batched (TRL-style: it takes `completions`) and scores a "
                        f"whole batch at once; RewardManager and the trainer call it that way, not per row")
    if is_async(fn):
        raise TypeError(f"reward function {where} is `async def`: RewardManager and the trainer await it; called "
                        f"here it would return a coroutine, not a score")
    binding = bind(fn, where, ROW_ARGUMENTS, kwargs)
    extra = dict(kwargs or {})

    @functools.wraps(fn)
    def by_name(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> Any:
        return binding.call({"data_source": data_source, "solution_str": solution_str,
                             "ground_truth": ground_truth, "extra_info": extra_info, **extra})

    return by_name


def split_result(result: Any) -> tuple[float, dict[str, Any]]:
    """``(score, extras)`` from a reward function's return value (a number, or a dict with ``score``).

    Extras keep numbers, strings, booleans and None; other values are turned into their ``str``.

    Raises:
        TypeError / ValueError: when the result is not a finite number or a dict with a numeric ``score``.
    """
    extras: dict[str, Any] = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"reward dict has no 'score' key (keys: {sorted(result)})")
        extras = {str(k): v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
                  for k, v in result.items() if k != "score"}
        result = result["score"]
    try:
        if isinstance(result, (str, bytes)):
            raise TypeError
        score = float(result)
    except (TypeError, ValueError):
        raise TypeError(f"reward must be a number or a dict with 'score', got {type(result).__name__} "
                        f"{result!r:.80}") from None
    if score != score or score in (float("inf"), float("-inf")):
        raise ValueError(f"reward is not finite: {score}")
    return score, extras

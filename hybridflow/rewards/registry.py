"""The reward-function registry: built-in names, `auto` routing by `data_source`, and user files.

A reward function has verl's signature, so functions written for verl work unchanged::

    fn(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None) -> float | dict

A dict result holds ``score`` plus extra values (logged as ``reward/<name>/mean``). `get_reward_fn`
turns a spec into such a function:

- a registered name (``gsm8k``, ``math``, ``reasoning_gym``, ``exact_match``, or one added with
  `register_reward`);
- ``auto``: the built-in is picked per row from ``data_source`` (see `AUTO_ROUTES`);
- ``path/to/file.py:function_name``: a user function loaded from a Python file.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import importlib.util
import inspect
from collections.abc import Callable
from typing import Any

from hybridflow.utils.imports import load_from_file

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

_VERL_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")


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


def _adapt_signature(fn: Callable, where: str, kwargs: dict | None = None) -> RewardFn:
    """Returns `fn` callable as ``fn(data_source, solution_str, ground_truth, extra_info, **kwargs)``.

    Functions whose parameters carry verl's names (in any order, keyword-only included) are called by
    keyword, as verl does; others that take four positional arguments are called positionally. `kwargs`
    (`reward.kwargs`) must fit too. Raises TypeError naming the signature otherwise.
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: trust them
        return fn
    extra = dict(kwargs or {})
    try:
        sig.bind(**dict.fromkeys(_VERL_PARAMS), **extra)
    except TypeError:
        pass
    else:
        @functools.wraps(fn)
        def by_name(data_source, solution_str, ground_truth, extra_info=None, **kw):
            return fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                      extra_info=extra_info, **kw)

        return by_name
    try:
        sig.bind(*_VERL_PARAMS, **extra)
    except TypeError:
        verl = "verl's (data_source, solution_str, ground_truth, extra_info)"
        raise TypeError(
            f"reward kwargs {extra} do not fit reward function {where} (signature {sig}): it must accept {verl} "
            f"and these keyword arguments" if extra else
            f"reward function {where} has signature {sig}; it must accept {verl}"
        ) from None

    @functools.wraps(fn)
    def positional(data_source, solution_str, ground_truth, extra_info=None, **kw):
        return fn(data_source, solution_str, ground_truth, extra_info, **kw)

    return positional


def load_file_function(spec: str) -> RewardFn:
    """Loads ``path/to/file.py:function_name`` (path relative to the working directory or absolute); its
    signature is checked by `get_reward_fn`."""
    fn = load_from_file(spec, "reward", "function", "reward.function")
    path_str, _, fn_name = spec.rpartition(":")
    if not callable(fn):
        raise TypeError(f"{fn_name!r} in reward file {path_str} is a {type(fn).__name__}, not a function")
    return fn


def get_reward_fn(spec: str | Callable, kwargs: dict | None = None) -> RewardFn:
    """The reward function named by `spec` (see the module docstring), with `kwargs` bound.

    Args:
        spec: a registered name, ``auto``, ``path/to/file.py:function_name``, or a callable.
        kwargs: extra keyword arguments for the function (e.g. ``{"method": "flexible"}`` for gsm8k);
            not allowed with ``auto``, whose rows may reach different functions.
    """
    if callable(spec):
        fn = _adapt_signature(spec, getattr(spec, "__name__", repr(spec)), kwargs)
    elif not isinstance(spec, str) or not spec:
        raise TypeError(f"reward.function must be a name or 'file.py:function', got {spec!r}")
    elif spec == "auto":
        if kwargs:
            raise ValueError(f"reward kwargs {sorted(kwargs)} cannot be used with reward.function=auto; "
                             f"name the function instead (one of {sorted(REWARD_FUNCTIONS)})")
        fn = auto_reward
    elif ":" in spec or spec.endswith(".py"):
        fn = _adapt_signature(load_file_function(spec), spec, kwargs)
    elif spec in REWARD_FUNCTIONS:
        check_requirements(spec)
        fn = _adapt_signature(REWARD_FUNCTIONS[spec], repr(spec), kwargs)
    else:
        hint = difflib.get_close_matches(spec, list(REWARD_FUNCTIONS), n=1)
        raise ValueError(
            f"unknown reward function {spec!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
            + f"; valid: auto, {', '.join(sorted(REWARD_FUNCTIONS))}, or 'path/to/file.py:function_name'"
        )
    if kwargs:
        fn = functools.partial(fn, **kwargs)
    return fn


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

"""`Scorer`: the run's reward functions, one or several with weights, bound once and scoring what the reward
manager sends them.

`reward.function` names one function; `reward.functions` several, with `reward.weights` (TRL's
``reward_funcs`` and ``reward_weights``; default weight 1 each). A row's score is the weighted sum of the
functions' scores, and with several functions each one's own score is logged as ``reward/<name>/mean``.
Functions come in two shapes (`hybridflow.rewards.binding`), each plain or ``async def``; `Scorer.jobs`
lays a batch out as jobs, each scored on its own (in a `ScoringPool` process, under the reward timeout):

- ``("row", (data_source, solution_str, ground_truth, extra_info))``: the plain per-row functions (verl's)
  of one row; its payload is ``(score, extras)``;
- ``("batch", i, arguments)``: plain batched function i (TRL's), the whole batch at once, where `arguments`
  are the lists `batch_arguments` builds (prompts, completions, completion ids, dataset columns);
- ``("async", arguments, rows)``: every ``async def`` function, awaited concurrently (a per-row one over
  every row, a batched one once), so one slow call does not hold the others up.

A batch job's payload is ``{function index: PartScores}``. A batched function may return None for a row it
does not score (TRL's convention: it adds nothing there); a row that no function scores is an error.
`reward.kwargs` go to every function that takes them; a batched function also gets TRL's
``log_extra(column, values)`` (a per-row column, kept with the reward's extras) and ``log_metric(name, value)``
(logged as ``reward/<name>``, the mean of the step's values).
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridflow.rewards.binding import BATCH_ARGUMENTS, ROW_ARGUMENTS, Binding, bind, is_async, is_batched
from hybridflow.rewards.registry import auto_reward, load_function, split_result

Row = tuple[str, str, Any, Any]  # (data_source, solution_str, ground_truth, extra_info)
Job = tuple  # ("row", Row) | ("batch", function index, arguments) | ("async", arguments, rows)


@dataclass(frozen=True)
class RewardSpec:
    """What scores the rows: function specs (names, ``file.py:fn``, import paths, callables), their weights
    and `reward.kwargs`. Picklable: each scoring process builds its own `Scorer` from it."""

    functions: tuple[Any, ...]
    weights: tuple[float, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, functions: Any, weights: Sequence[float] | None = None,
           kwargs: Mapping[str, Any] | None = None) -> RewardSpec:
        """A spec from one function spec or a list of them (weights default to 1 each)."""
        specs = tuple(functions) if isinstance(functions, (list, tuple)) else (functions,)
        if not specs:
            raise ValueError("no reward function given")
        weights = tuple(float(w) for w in weights or [1.0] * len(specs))
        if len(weights) != len(specs):
            raise ValueError(f"reward.weights has {len(weights)} values for {len(specs)} reward.functions; give one "
                             f"weight per function (or none: 1 each)")
        return cls(specs, weights, dict(kwargs or {}))

    @classmethod
    def from_config(cls, reward_cfg: Any) -> RewardSpec:
        """The spec of a `reward` config section: `functions` (with `weights`) when set, else `function`."""
        if reward_cfg.functions:
            return cls.of(list(reward_cfg.functions), list(reward_cfg.weights) or None, reward_cfg.kwargs)
        if reward_cfg.weights:
            raise ValueError(f"reward.weights={list(reward_cfg.weights)} weighs reward.functions, which is empty; "
                             f"list the functions in reward.functions")
        return cls.of(reward_cfg.function, None, reward_cfg.kwargs)

    def label(self) -> str:
        """How errors name the functions: ``'gsm8k'`` or ``['a.py:f', 'b.py:g']``."""
        specs = [s if isinstance(s, str) else getattr(s, "__name__", repr(s)) for s in self.functions]
        return repr(specs[0]) if len(specs) == 1 else repr(specs)


@dataclass(frozen=True)
class Part:
    """One bound function: its name (for ``reward/<name>/mean``), weight, binding, shape and whether it is
    ``async def``."""

    name: str
    weight: float
    binding: Binding
    batched: bool
    is_async: bool = False


@dataclass
class PartScores:
    """One function's results over a batch: a score per row (None where it did not score the row), a
    per-row error message (an ``async`` per-row call that raised), per-row extras (a dict result's entries,
    TRL's ``log_extra`` columns) and TRL's ``log_metric`` values."""

    scores: list[float | None]
    errors: dict[int, str] = field(default_factory=dict)
    extras: dict[str, list] = field(default_factory=dict)
    metrics: dict[str, list[float]] = field(default_factory=dict)


class RewardLog:
    """TRL's ``log_extra`` and ``log_metric`` for one call of a batched function over `rows` rows."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.extras: dict[str, list] = {}
        self.metrics: dict[str, list[float]] = {}

    def log_extra(self, column: str, values: Sequence[Any]) -> None:
        if len(values) != self.rows:
            raise ValueError(f"log_extra({column!r}, ...) got {len(values)} values; give one per completion "
                             f"({self.rows})")
        self.extras[str(column)] = list(values)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(str(name), []).append(float(value))


def _name(spec: Any, fn: Callable) -> str:
    if isinstance(spec, str):
        return spec.rpartition(":")[2] if ":" in spec else spec.rpartition(".")[2] if "." in spec else spec
    return getattr(fn, "__name__", "reward")


def _parts(spec: RewardSpec) -> list[Part]:
    kwargs = dict(spec.kwargs)
    if kwargs and "auto" in spec.functions and len(spec.functions) == 1:
        raise ValueError(f"reward kwargs {sorted(kwargs)} cannot be used with reward.function=auto; name the "
                         f"function instead")
    loaded = [(auto_reward, "'auto'") if s == "auto" else load_function(s) for s in spec.functions]
    parts: list[Part] = []
    taken: set[str] = set()
    for s, (fn, where), weight in zip(spec.functions, loaded, spec.weights):
        batched = is_batched(fn)
        names = BATCH_ARGUMENTS + ROW_ARGUMENTS if batched else ROW_ARGUMENTS
        # one function must take every kwarg; of several, each takes those it declares
        own = kwargs if len(loaded) == 1 else {k: v for k, v in kwargs.items() if _takes(fn, k)}
        binding = bind(fn, where, names, own, open_names=batched)
        taken |= set(own)
        name, n = _name(s, fn), 2
        while name in {p.name for p in parts}:
            name, n = f"{_name(s, fn)}_{n}", n + 1
        parts.append(Part(name, weight, binding, batched, is_async(fn)))
    if kwargs and not set(kwargs) <= taken:
        raise TypeError(f"reward kwargs {sorted(set(kwargs) - taken)} fit none of reward.functions "
                        f"{spec.label()}")
    return parts


def _takes(fn: Callable, key: str) -> bool:
    """Whether `fn` has a parameter `key` or takes ``**kwargs``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return key in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class Scorer:
    """The bound functions of a `RewardSpec` (see the module docstring). Building it loads every function
    and refuses, naming it, a parameter that cannot be filled."""

    def __init__(self, spec: RewardSpec) -> None:
        self.spec = spec
        self.parts = _parts(spec)
        self.kwargs = dict(spec.kwargs)

    @property
    def batched(self) -> list[int]:
        """Indices (in `parts`) of the plain batched functions."""
        return [i for i, p in enumerate(self.parts) if p.batched and not p.is_async]

    @property
    def has_row_functions(self) -> bool:
        """Whether some plain per-row function scores each row in a ``row`` job."""
        return any(not p.batched and not p.is_async for p in self.parts)

    @property
    def has_async_functions(self) -> bool:
        return any(p.is_async for p in self.parts)

    def names(self, name: str) -> bool:
        """Whether some function declares the argument `name` (e.g. ``ground_truth``)."""
        return any(p.binding.names(name) for p in self.parts)

    def missing_columns(self, columns: Sequence[str]) -> list[str]:
        """``"fn: parameter"`` for each required parameter of a batched function that neither hybridflow's
        arguments nor the dataset's `columns` fill."""
        have = set(columns) | set(BATCH_ARGUMENTS) | set(ROW_ARGUMENTS) | {"ability"}
        return [f"{p.name}: {name}" for p in self.parts for name in p.binding.unbound if name not in have]

    def jobs(self, rows: Sequence[Row], arguments: Callable[[], Mapping[str, list]]) -> list[Job]:
        """The jobs scoring `rows` (module docstring): a ``row`` job per row, then a ``batch`` job per plain
        batched function, then one ``async`` job; `arguments` builds the batched functions' arguments."""
        jobs: list[Job] = [("row", r) for r in rows] if self.has_row_functions else []
        if self.batched or self.has_async_functions:
            args = dict(arguments())
            jobs += [("batch", i, args) for i in self.batched]
            if self.has_async_functions:
                jobs.append(("async", args, list(rows)))
        return jobs

    def score_row(self, row: Sequence[Any]) -> tuple[float, dict[str, Any]]:
        """The weighted sum of the plain per-row functions' scores of one row, and their extras."""
        values = dict(zip(ROW_ARGUMENTS, row), **self.kwargs)
        total, extras = 0.0, {}
        for part in self.parts:
            if not part.batched and not part.is_async:
                score, more = split_result(part.binding.call(values))
                total += part.weight * score
                extras.update(more)
                if len(self.parts) > 1:
                    extras[part.name] = score
        return total, extras

    def _batch_values(self, arguments: Mapping[str, list], log: RewardLog) -> dict[str, Any]:
        return {**arguments, **self.kwargs, "log_extra": log.log_extra, "log_metric": log.log_metric}

    def _checked(self, part: Part, scores: Any, rows: int, log: RewardLog) -> PartScores:
        """A batched function's return value checked: a list of `rows` finite numbers or None."""
        if not isinstance(scores, (list, tuple)) or len(scores) != rows:
            got = f"{len(scores)} values" if isinstance(scores, (list, tuple)) else f"a {type(scores).__name__}"
            raise TypeError(f"batched reward function {part.name!r} must return a list of {rows} numbers (one per "
                            f"completion, None to skip one); it returned {got}")
        out: list[float | None] = []
        for value in scores:
            if value is None:
                out.append(None)
                continue
            score = float(value)
            if not math.isfinite(score):
                raise ValueError(f"batched reward function {part.name!r} returned a non-finite score {score}")
            out.append(score)
        return PartScores(out, extras=log.extras, metrics=log.metrics)

    def score_batch(self, index: int, arguments: Mapping[str, list]) -> dict[int, PartScores]:
        """Plain batched function `index`'s scores of a batch (None where it does not score a row)."""
        part, rows = self.parts[index], len(arguments["completions"])
        log = RewardLog(rows)
        return {index: self._checked(part, part.binding.call(self._batch_values(arguments, log)), rows, log)}

    def score_async(self, arguments: Mapping[str, list], rows: Sequence[Row]) -> dict[int, PartScores]:
        """Every ``async def`` function's scores of a batch, awaited concurrently."""
        indices = [i for i, p in enumerate(self.parts) if p.is_async]

        async def batched(part: Part) -> PartScores:
            log = RewardLog(len(rows))
            try:
                scores = await part.binding.call(self._batch_values(arguments, log))
                return self._checked(part, scores, len(rows), log)
            except Exception as e:  # its rows fail; the other functions keep their scores
                return PartScores([None] * len(rows), {r: f"{type(e).__name__}: {e}" for r in range(len(rows))})

        async def per_row(part: Part) -> PartScores:
            calls = [part.binding.call(dict(zip(ROW_ARGUMENTS, row), **self.kwargs)) for row in rows]
            out = PartScores([None] * len(rows))
            for r, result in enumerate(await asyncio.gather(*calls, return_exceptions=True)):
                try:
                    if isinstance(result, BaseException):
                        raise result
                    out.scores[r], more = split_result(result)
                except Exception as e:  # this row fails, the others keep their scores
                    out.errors[r] = f"{type(e).__name__}: {e}"
                    continue
                for name, value in more.items():
                    out.extras.setdefault(name, [None] * len(rows))[r] = value
            return out

        async def everything() -> list[PartScores]:
            return await asyncio.gather(*(batched(self.parts[i]) if self.parts[i].batched else per_row(self.parts[i])
                                          for i in indices))

        return dict(zip(indices, asyncio.run(everything())))

    def __call__(self, job: Job) -> Any:
        """The payload of one job (module docstring)."""
        if job[0] == "row":
            return self.score_row(job[1])
        if job[0] == "async":
            return self.score_async(job[1], job[2])
        return self.score_batch(job[1], job[2])

    def combine(self, row: tuple[float, dict] | None, parts: Mapping[int, PartScores], i: int
                ) -> tuple[float, dict]:
        """Row `i`'s ``(score, extras)`` from its ``row`` job's payload (None without plain per-row functions)
        and the other functions' `parts`. Raises ValueError when a function failed on it or none scored it."""
        total, extras = row if row is not None else (0.0, {})
        scored = row is not None
        extras = dict(extras)
        for index, result in sorted(parts.items()):
            if i in result.errors:
                raise ValueError(f"reward function {self.parts[index].name!r}: {result.errors[i]}")
            extras.update({name: values[i] for name, values in result.extras.items()})
            value = result.scores[i]
            if value is None:
                continue
            part = self.parts[index]
            total += part.weight * value
            scored = True
            if len(self.parts) > 1:
                extras[part.name] = value
        if not scored:
            raise ValueError("every reward function returned None for this row")
        return total, extras


def batch_arguments(rows: Sequence[Sequence[Any]], batch: Any = None) -> dict[str, list]:
    """The keyword arguments of a batched (TRL-style) function for `rows` (``(data_source, solution_str,
    ground_truth, extra_info)``) of a `Batch` (or None for bare rows):

    - ``prompts``: the prompts as in the dataset (chat messages or text; None without a batch);
    - ``completions``: for chat prompts, each completion as messages (``[{"role": "assistant", "content":
      text}]``, or a multi-turn row's turns, `extra_info["messages"]`), else the text;
    - ``completion_ids``: each response's token ids (None without a batch);
    - every dataset column but the prompt (the row's `columns` and ``ability``), then ``data_source``,
      ``ground_truth`` and ``extra_info`` (a multi-turn row's with its trajectory).
    """
    n = len(rows)
    texts = [r[1] for r in rows]
    infos = [r[3] for r in rows]
    prompts = list(batch["raw_prompt"]) if batch is not None and "raw_prompt" in batch else [None] * n
    completions: list[Any] = []
    for prompt, text, info in zip(prompts, texts, infos):
        if isinstance(prompt, (list, tuple)):
            turns = info.get("messages") if isinstance(info, dict) else None
            completions.append(list(turns) if turns else [{"role": "assistant", "content": text}])
        else:
            completions.append(text)
    ids = [None] * n
    if batch is not None and "responses" in batch and "attention_mask" in batch:
        responses = batch["responses"]
        real = batch["attention_mask"][:, -responses.shape[1]:].bool()
        ids = [row[mask].tolist() for row, mask in zip(responses, real)]
    arguments: dict[str, list] = {}
    if batch is not None and "columns" in batch:
        names = list(dict.fromkeys(k for cols in batch["columns"] for k in (cols or {})))
        arguments = {k: [(cols or {}).get(k) for cols in batch["columns"]] for k in names}
    if batch is not None and "ability" in batch:
        arguments["ability"] = list(batch["ability"])
    arguments.update(prompts=prompts, completions=completions, completion_ids=ids,
                     data_source=[r[0] for r in rows], ground_truth=[r[2] for r in rows], extra_info=infos)
    return arguments

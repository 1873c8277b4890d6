"""`RewardManager`: scores a step's responses, asynchronously, without ever stopping the run.

The trainer submits the rows right after generation and collects the result after the log-prob
passes, so scoring overlaps GPU work::

    manager = RewardManager("auto", num_workers=2, timeout_s=10, fallback_score=0.0)
    future = manager.submit(batch)          # batch has data_source, response_text, ground_truth, extra_info
    ...                                     # old / reference log-probs, values
    result = future.result()                # RewardResult: scores, extras, errors, metrics
    batch["token_scores"] = scores_to_token_scores(result.scores, batch["response_mask"])

The functions (one, or several with weights; per-row verl-style or batched TRL-style) are bound by
`hybridflow.rewards.scorer.Scorer`. Rows are scored in a `ScoringPool` of spawned processes. A row whose
function raises or runs past `timeout_s` gets `fallback_score` and is counted in ``reward/errors`` and
``reward/error_share`` (timeouts also in ``reward/timeouts``). A function that fails every row of
`max_failed_batches` counted batches in a row is broken, not unlucky: the next result raises
`RewardFunctionFailed` with the first error of the last batch (`submit(..., counted=False)` for validation).
With ``num_workers=0`` rows are scored inline in the caller's thread (so a ``breakpoint()`` in a reward
function works; no timeout is enforced then).
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybridflow.rewards.failures import FailureStreak, RewardFunctionFailed
from hybridflow.rewards.scoring_pool import Outcome, ScoringPool, score_job
from hybridflow.rewards.registry import check_requirements, route_data_source
from hybridflow.rewards.scorer import PartScores, RewardSpec, Row, Scorer, batch_arguments

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

ROW_KEYS = ("data_source", "response_text", "ground_truth", "extra_info")


@dataclass
class RewardResult:
    """Scores of one batch.

    Attributes:
        scores: one float per row (the fallback score where the function failed).
        extras: ``{name: [value or None per row]}`` from dict results' non-``score`` entries.
        errors: per row, None or the error / timeout message.
        metrics: ``reward/mean``, ``reward/errors``, ``reward/error_share``, ``reward/timeouts``,
            ``reward/<name>/mean`` (extras, and each function's score when there are several),
            ``reward/<name>`` (the mean of what TRL-style functions passed to ``log_metric(name, value)``).
    """

    scores: list[float]
    extras: dict[str, list] = field(default_factory=dict)
    errors: list[str | None] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


def rows_from(batch_like: Any) -> list[Row]:
    """``(data_source, solution_str, ground_truth, extra_info)`` rows from a batch-like object.

    Accepts a `hybridflow.batch.Batch` or any mapping of per-row columns with keys ``data_source``,
    ``response_text`` (or ``solution_str``), ``ground_truth`` and optionally ``extra_info``; or a
    sequence of 4-tuples / dicts with those keys.
    """
    if isinstance(batch_like, Sequence) and not isinstance(batch_like, (str, bytes)):
        return [_row_from_record(r, i) for i, r in enumerate(batch_like)]
    if not hasattr(batch_like, "__getitem__") or not hasattr(batch_like, "__contains__"):
        raise TypeError(f"cannot score a {type(batch_like).__name__}; pass a Batch, a dict of columns or a list of rows")
    text_key = "response_text" if "response_text" in batch_like else "solution_str"
    missing = [k for k in ("data_source", text_key, "ground_truth") if k not in batch_like]
    if missing:
        raise KeyError(f"reward scoring needs columns {list(ROW_KEYS)}; missing {missing}")
    columns = [batch_like["data_source"], batch_like[text_key], batch_like["ground_truth"]]
    n = len(columns[1])
    infos = batch_like["extra_info"] if "extra_info" in batch_like else [None] * n
    if any(len(c) != n for c in (*columns, infos)):
        raise ValueError(f"reward columns have different lengths: {[len(c) for c in (*columns, infos)]}")
    return [(str(ds), str(text), gt, info) for ds, text, gt, info in zip(*columns, infos)]


def _row_from_record(record: Any, i: int) -> Row:
    if isinstance(record, Mapping):
        text = record.get("response_text", record.get("solution_str"))
        if text is None or "data_source" not in record or "ground_truth" not in record:
            raise KeyError(f"reward row {i} needs keys {list(ROW_KEYS)}; has {sorted(record)}")
        return (str(record["data_source"]), str(text), record["ground_truth"], record.get("extra_info"))
    if len(record) != 4:
        raise ValueError(f"reward row {i} must be (data_source, solution_str, ground_truth, extra_info), "
                         f"got {len(record)} items")
    return (str(record[0]), str(record[1]), record[2], record[3])


class RewardManager:
    """Scores rows with reward functions in a process pool; see the module docstring.

    Args:
        fn_spec: reward spec (``auto``, a registered name, ``path/to/file.py:function_name``) or a
            callable (must be picklable by reference, i.e. module-level, when ``num_workers > 0``); or a
            list of them, summed with `weights`.
        num_workers: scoring processes; 0 scores inline in the caller's thread.
        timeout_s: limit in seconds of one row (of one batch for a batched function, and for the async
            functions together: they are awaited concurrently) in pool mode; None or 0 for no limit.
        fallback_score: the score of a row whose function raised or timed out.
        fn_kwargs: keyword arguments for the functions (e.g. ``{"method": "flexible"}``).
        max_failed_batches: raise `RewardFunctionFailed` after this many counted batches in a row where every
            row failed; 0 never does.
        weights: one per function of a list `fn_spec` (default 1 each).
    """

    def __init__(self, fn_spec: Any = "auto", num_workers: int = 2, timeout_s: float | None = 10.0,
                 fallback_score: float = 0.0, fn_kwargs: dict | None = None, max_failed_batches: int = 3,
                 weights: Sequence[float] | None = None) -> None:
        if num_workers < 0:
            raise ValueError(f"reward num_workers must be >= 0, got {num_workers}")
        spec = RewardSpec.of(fn_spec, weights, fn_kwargs)
        self.spec, self.fallback_score = spec, float(fallback_score)
        self.scorer = Scorer(spec)  # fails here, early, on a bad spec or a parameter it cannot fill
        self.failures = FailureStreak(f"reward function {spec.label()}", max_failed_batches, RewardFunctionFailed)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward") if num_workers else None
        # the finalizer right after the pool: nothing between them for a stop signal to interrupt, orphaning it
        self._pool = ScoringPool(spec, num_workers, timeout_s) if num_workers else None
        self._finalizer = weakref.finalize(self, RewardManager._shutdown, self._pool, self._executor)

    @classmethod
    def from_config(cls, reward_cfg: Any, num_workers: int | None = None) -> RewardManager:
        """The manager of a `reward` config section; `num_workers` in place of its `num_workers` (0: a manager that
        starts no process, to check what the functions need before any row is scored)."""
        spec = RewardSpec.from_config(reward_cfg)
        workers = reward_cfg.num_workers if num_workers is None else num_workers
        return cls(list(spec.functions), workers, reward_cfg.timeout_s, reward_cfg.fallback_score,
                   dict(spec.kwargs), reward_cfg.max_failed_steps, list(spec.weights))

    def check_data_sources(self, data_sources: Sequence[str]) -> None:
        """With ``auto``: raises ValueError (naming it) for a data source no built-in covers, and
        ImportError (with the pip command) when a routed built-in's package is missing.

        The trainer calls it on the datasets' data sources before training; `submit` calls it per batch.
        """
        if "auto" in self.spec.functions:
            for name in sorted({route_data_source(str(d)) for d in set(data_sources)}):
                check_requirements(name)

    def submit(self, batch_like: Any, counted: bool = True) -> Future:
        """Starts scoring; returns a Future of `RewardResult`. Input errors raise here, at once.

        counted: whether the batch counts towards `max_failed_batches` (validation batches do not).
        """
        rows = rows_from(batch_like)
        self.check_data_sources([r[0] for r in rows])
        jobs = self.scorer.jobs(rows, lambda: batch_arguments(
            rows, None if isinstance(batch_like, Sequence) else batch_like))
        pool = self._pool
        if self._executor is None or pool is None:
            future: Future = Future()
            future.set_result(self._result(rows, [score_job(self.scorer, j) for j in jobs], counted))
            return future
        return self._executor.submit(lambda: self._result(rows, pool.run(jobs), counted))

    def score(self, batch_like: Any, counted: bool = True) -> RewardResult:
        """Scores and waits: ``submit(batch_like, counted).result()``."""
        return self.submit(batch_like, counted).result()

    def _result(self, rows: list[Row], outcomes: list[Outcome], counted: bool) -> RewardResult:
        n = len(rows)
        per_row = outcomes[:n] if self.scorer.has_row_functions else [None] * n
        whole = outcomes[n if self.scorer.has_row_functions else 0:]  # the batch and async jobs
        parts: dict[int, PartScores] = {}
        for outcome in whole:
            if outcome[0] == "ok":
                parts.update(outcome[1])
        scores: list[float] = []
        errors: list[str | None] = []
        extras: dict[str, list] = {}
        for i, row_outcome in enumerate(per_row):
            failed = next((o for o in (row_outcome, *whole) if o is not None and o[0] != "ok"), None)
            if failed is None:
                try:
                    score, row_extras = self.scorer.combine(row_outcome[1] if row_outcome else None, parts, i)
                except ValueError as e:
                    failed = ("error", str(e))
            if failed is not None:
                scores.append(self.fallback_score)
                errors.append(f"{failed[0]}: {failed[1]}")
                continue
            for name, value in row_extras.items():
                extras.setdefault(name, [None] * n)[i] = value
            scores.append(score)
            errors.append(None)
        n_timeouts = sum(status == "timeout" for status, _ in outcomes)
        n_errors = sum(e is not None for e in errors)
        if n_errors:
            first = next(e for e in errors if e is not None)
            logger.warning("reward function failed on %d of %d rows (fallback score %g); first: %s",
                           n_errors, n, self.fallback_score, first)
        if counted:
            self.failures.update(errors)
        metrics = {
            "reward/mean": sum(scores) / n if n else math.nan,
            "reward/errors": float(n_errors),
            "reward/error_share": n_errors / n if n else 0.0,
            "reward/timeouts": float(n_timeouts),
        }
        for name, values in extras.items():
            numbers = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, str)]
            if numbers:
                metrics[f"reward/{name}/mean"] = sum(numbers) / len(numbers)
        logged: dict[str, list[float]] = {}  # TRL's log_metric values, each function's
        for result in parts.values():
            for name, values in result.metrics.items():
                logged.setdefault(name, []).extend(values)
        metrics.update({f"reward/{name}": sum(values) / len(values) for name, values in logged.items() if values})
        return RewardResult(scores, extras, errors, metrics)

    @staticmethod
    def _shutdown(pool: ScoringPool | None, executor: ThreadPoolExecutor | None) -> None:
        if executor is not None:
            executor.shutdown(wait=True)
        if pool is not None:
            pool.close()

    def close(self) -> None:
        """Stops the scoring processes (also done at garbage collection and interpreter exit)."""
        self._finalizer()

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def scores_to_token_scores(scores: Sequence[float] | torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Places each row's score on its last response token the mask counts (a multi-turn row's mask has
    holes where the environment's tokens are).

    Args:
        scores: ``[B]`` per-row scores.
        response_mask: ``[B, R]``, 1 on the model's response tokens.

    Returns:
        ``token_scores [B, R]`` float32, zero except ``score`` at each row's last masked index (index 0
        for an empty response, so no score is lost).
    """
    import torch

    values = torch.as_tensor(scores, dtype=torch.float32, device=response_mask.device)
    if values.ndim != 1 or values.shape[0] != response_mask.shape[0]:
        raise ValueError(f"scores must be [B={response_mask.shape[0]}], got shape {tuple(values.shape)}")
    steps = torch.arange(1, response_mask.shape[1] + 1, device=response_mask.device)
    last = ((response_mask > 0) * steps).amax(-1) - 1 if response_mask.shape[1] else steps.new_zeros(len(values))
    last = last.clamp(min=0)
    token_scores = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    token_scores[torch.arange(len(values), device=response_mask.device), last] = values
    return token_scores

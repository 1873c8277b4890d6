"""Stopping a run whose rewards are all failures: a reward function, or an environment, that fails on every
row of `reward.max_failed_steps` training batches in a row is broken, not unlucky, and training on its
fallback scores would only hide it. Validation batches do not count."""

from __future__ import annotations

from collections.abc import Sequence


class RowsFailed(RuntimeError):
    """Every row of several training batches in a row failed (`hybridflow train` exits with status 2)."""


class RewardFunctionFailed(RowsFailed):
    """The reward function failed (raised or timed out) on every row of several batches in a row."""


class EnvironmentFailed(RowsFailed):
    """The environment failed on every trajectory of several training steps in a row, or the endpoint's agent
    runners on every trajectory of one batch (none is left to train on)."""


class FailureStreak:
    """Counts batches in a row where every row failed; `update` raises `error` when they reach `limit`.

    what: how the message names the failing code (``"reward function 'gsm8k'"``); rows: what a row is
    (``"row"``, ``"trajectory"``); limit: 0 = never raise.
    """

    def __init__(self, what: str, limit: int, error: type[RowsFailed], rows: str = "row") -> None:
        self.what, self.limit, self.error, self.rows = what, limit, error, rows
        self.count = 0

    def update(self, errors: Sequence[str | None]) -> None:
        """Records one batch's per-row errors (None where the row did not fail)."""
        failed = [e for e in errors if e is not None]
        self.count = self.count + 1 if errors and len(failed) == len(errors) else 0
        if self.limit and self.count >= self.limit:
            raise self.error(f"{self.what} failed on every {self.rows} of {self.count} training batches in a row "
                             f"(reward.max_failed_steps={self.limit}); the first error of the last one: {failed[0]}")

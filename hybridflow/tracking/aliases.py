"""Other frameworks' names for our metrics, logged beside ours so a verl or TRL dashboard reads a hybridflow
run unchanged: `with_aliases(metrics, context)` adds, for each metric `ALIASES` names, the same value under
the other name (ours stay; an alias never replaces a metric the step already has).

`ALIASES` is the one table: ``(our name as a regular expression, the alias)``. The alias may use the
expression's named groups and the `context` fields (``val_n``: responses per validation prompt); an alias
whose field the context lacks is left out. verl's names that equal ours (``response_length/mean``,
``actor/pg_loss``, ``timing_s/gen``, ...) need no entry.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

ALIASES: tuple[tuple[str, str], ...] = (
    # verl (trainer/ppo/metric_utils.py): the score before the KL penalty, the reward after it
    (r"reward/(?P<stat>mean|max|min)", "critic/score/{stat}"),
    (r"reward/with_kl/mean", "critic/rewards/mean"),
    (r"(?P<name>advantages|returns|values)/(?P<stat>mean|max|min)", "critic/{name}/{stat}"),
    # verl's validation: the mean over the val_n responses of each prompt, per data source
    (r"val/(?P<source>.+)/reward/mean", "val-core/{source}/reward/mean@{val_n}"),
    # TRL's DPOTrainer
    (r"dpo/accuracy", "rewards/accuracies"),
    (r"dpo/margin", "rewards/margins"),
    (r"dpo/rewards/(?P<side>chosen|rejected)", "rewards/{side}"),
)

_COMPILED = tuple((re.compile(pattern), alias) for pattern, alias in ALIASES)


def with_aliases(metrics: Mapping[str, Any], context: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`metrics` plus each one's aliases (module docstring)."""
    out = dict(metrics)
    fields = dict(context or {})
    for name, value in metrics.items():
        for pattern, alias in _COMPILED:
            match = pattern.fullmatch(name)
            if match is None:
                continue
            try:
                other = alias.format(**fields, **match.groupdict())
            except KeyError:  # the context lacks a field this alias needs (no val_n outside RL)
                continue
            out.setdefault(other, value)
    return out

"""The configuration reference (`docs/config.md`), rendered from the schema's field metadata and the keys that
follow others (`hybridflow.config.follow.FOLLOWS`).

`python scripts/gen_config_docs.py` writes it; a test compares the file with `render_reference()` so
the reference can never drift from the defaults and help lines in `hybridflow/config/schema.py`.
"""

from __future__ import annotations

import json
from typing import Any

from hybridflow.config.follow import FOLLOWS
from hybridflow.config.loader import schema_fields, type_name
from hybridflow.config.options import field_default
from hybridflow.config.schema import RLConfig

INTRO = """# Configuration reference

`hybridflow train [--config FILE.yaml] key=value ...` builds one typed config: the defaults below, then
the YAML file (a recipe from `recipes/`; a top-level `base: other.yaml`, or a list, layers the file on
top of others, relative to it), then each dotted override in order. Lists are written
`data.train_files=[a.parquet,b.parquet]` (one value alone becomes a one-element list), `null` unsets an
optional value. Unknown keys fail with a did-you-mean, a value of the wrong type or outside a key's
choices names the valid ones, and the batch-size relations are checked before any model loads
(`hybridflow.config.validate`):

- `data.train_batch_size` % `actor.mini_batch_size` == 0 (a null mini-batch is the whole batch);
- `mini_batch_size` x `rollout.n` (rows per optimizer step) divides by `trainer.n_workers`;
- `micro_batch_size` divides those rows per rank (`mini_batch_size` x `rollout.n` / `n_workers`);
- the same for `critic.*` when `algorithm.adv_estimator=gae`; grpo, rloo and
  reinforce_plus_plus_baseline need `rollout.n` >= 2; remax needs `rollout.temperature` > 0.

## Replacing a mapping, or forgetting a key

A mapping given on the command line merges into the one the recipe set (`agent.env_kwargs={start: 2}` over a
recipe's `{decay: 0.5}` gives `{decay: 0.5, start: 2}`); lists are replaced whole. Hydra's `~key` forgets what
the YAML files and the earlier overrides set for a key (or a whole section), which is then its default again;
a `key=value` after it sets it anew:

    hybridflow train --config recipes/multiturn_retry.yaml ... '~agent.env_kwargs' 'agent.env_kwargs={start: 2}'
    hybridflow config --no-checks --config recipes/multiturn_retry.yaml '~agent.env_kwargs'   # env_kwargs: {}

## Keys that follow others

Turning a feature on needs that key alone where the feature needs one value of another key: left unset by the
YAML files and the overrides, that key follows (`hybridflow.config.follow`). A key that was set keeps its value,
and a value the feature cannot run with is refused before any model loads, naming both keys. `hybridflow
config` prints what followed, and a run writes it at the top of its `resolved_config.yaml`, as YAML comments
(the file loads again with `--config`). A config built in Python has no unset keys: nothing follows there.

| key | follows to | when |
|---|---|---|
{follows}

This file is generated from `hybridflow/config/schema.py` (and `model_schema.py`) by `python scripts/gen_config_docs.py`;
do not edit it by hand.
"""


def _format_default(value: Any) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (list, dict)):
        return f"`{json.dumps(value)}`"
    return f"`{value}`"


def render_reference(schema: type = RLConfig) -> str:
    """Markdown: the intro (with the keys that follow others), then `render_sections(schema)`."""
    follows = "\n".join(f"| `{rule.key}` | {_format_default(rule.value)} | {rule.when}"
                         + (f" (also when set to `{rule.auto}`)" if rule.auto is not None else "") + " |"
                         for rule in FOLLOWS)
    return INTRO.replace("{follows}", follows) + "\n" + render_sections(schema)


def render_sections(schema: type = RLConfig) -> str:
    """Markdown: one table per section of `schema` (key, type, default, meaning); the SFT and preference pages
    hold their programs' tables."""
    known = schema_fields(schema)
    lines: list[str] = []
    sections = [k for k, info in known.items() if info.kind == "section"]
    for section in sections:
        info = known[section]
        doc = (info.type.__doc__ or "").strip().splitlines()[0]
        about = doc if "." not in section else f"{info.help[:1].upper()}{info.help[1:]}."
        lines += [f"## `{section}`", "", about, "",
                  "| key | type | default | meaning |", "|---|---|---|---|"]
        for key, child in known.items():
            if key.rsplit(".", 1)[0] != section or "." not in key or child.kind == "section":
                continue
            meaning = child.help
            if child.choices:
                meaning += "; one of " + ", ".join(f"`{c}`" for c in child.choices)
            default = _format_default(field_default(child.field))
            lines.append(f"| `{key}` | {type_name(child.type)} | {default} | {meaning} |")
        lines.append("")
    return "\n".join(lines)

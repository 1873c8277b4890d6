"""`hybridflow migrate`: a hybridflow recipe from a verl command line or a verl YAML config.

    hybridflow migrate examples/grpo_trainer/run_qwen2-7b.sh > recipes/qwen2_7b.yaml
    hybridflow migrate verl_config.yaml --out recipes/mine.yaml

A shell script is read as verl's command line: the ``key=value`` arguments after ``verl.trainer.main_ppo``
(backslash continuations joined, ``+key`` as ``key``, shell variables the script assigns, or the environment
holds, substituted). A YAML
file is flattened to dotted keys. Each key goes through the one table of verl's keys
(`hybridflow.config.verl_keys`), with verl's defaults that differ from ours added (`VERL_DEFAULTS`), so the
recipe does what the verl run did. Each key written says in a comment which verl key it came from; every verl
key not carried is listed at the end with why (no equivalent, a value ours lacks, a shell variable left
unset). The recipe is loaded once before it is returned; a value our config refuses is moved to that list.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from hybridflow.config.validate import ConfigError
from hybridflow.config.verl_keys import VERL_DEFAULTS, VERL_KEYS, VERL_PREFIXES

KEY = re.compile(r"^\+{0,2}[a-z_][\w]*(\.[\w]+)+$")
ASSIGNMENT = re.compile(r"^\s*(?:export\s+)?([A-Za-z_]\w*)=(.*)$")
VARIABLE = re.compile(r"\$\{?([A-Za-z_]\w*)\}?")


def _shell_assignments(text: str) -> dict[str, str]:
    """`NAME=value` lines of a script (quotes removed), for substituting ``$NAME`` in verl's arguments; the
    environment's variables (``$HOME``) where the script sets none."""
    out: dict[str, str] = dict(os.environ)
    for line in text.splitlines():
        match = ASSIGNMENT.match(line)
        if match and "." not in match.group(1):
            try:
                words = shlex.split(match.group(2), comments=True)
            except ValueError:
                continue
            if len(words) == 1:
                out[match.group(1)] = VARIABLE.sub(lambda m: out.get(m.group(1), m.group(0)), words[0])
    return out


def read_script(text: str) -> dict[str, str]:
    """verl's ``key=value`` arguments of a shell script, raw (see the module docstring)."""
    variables = _shell_assignments(text)
    words = shlex.split(text.replace("\\\n", " "), comments=True)
    start = next((i + 1 for i, w in enumerate(words) if "main_ppo" in w or w.startswith("verl.trainer")), 0)
    out: dict[str, str] = {}
    for word in words[start:]:
        key, sep, raw = word.partition("=")
        if sep and KEY.match(key):
            out[key.lstrip("+")] = VARIABLE.sub(lambda m: variables.get(m.group(1), m.group(0)), raw)
    return out


def _flatten(node: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(node, Mapping) and node:
        for name, value in node.items():
            _flatten(value, f"{prefix}{name}.", out)
    else:
        out[prefix[:-1]] = node


def read_verl(path: str | Path) -> dict[str, Any]:
    """verl's settings in `path` (a ``.yaml`` config or a shell script) as ``{dotted key: value}``."""
    from omegaconf import OmegaConf

    from hybridflow.config.overrides import parse_override

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"hybridflow migrate: {path} not found (give a verl shell script or YAML config)")
    if path.suffix in (".yaml", ".yml"):
        out: dict[str, Any] = {}
        _flatten(OmegaConf.to_container(OmegaConf.load(path), resolve=False), "", out)
        return out
    raw = read_script(path.read_text())
    if not raw:
        raise ConfigError(f"{path}: no verl key=value arguments found (expected a command running "
                          f"verl.trainer.main_ppo with dotted overrides)")
    return {key: parse_override(f"{key}={value}")[1] for key, value in raw.items()}


def translate(settings: Mapping[str, Any]) -> tuple[dict[str, tuple[Any, str]], list[tuple[str, Any, str]]]:
    """``({our key: (value, where from)}, [(verl key, value, why not carried)])`` for verl's `settings`."""
    given = {**VERL_DEFAULTS, **settings}
    ours: dict[str, tuple[Any, str]] = {}
    skipped: list[tuple[str, Any, str]] = []
    for key, value in given.items():
        origin = key if key in settings else f"verl's default {key}={value}"
        prefix = next((p for p in VERL_PREFIXES if key.startswith(p)), None)
        entry = VERL_KEYS.get(key)
        if prefix is not None:
            ours[VERL_PREFIXES[prefix] + key[len(prefix):]] = (value, origin)
        elif isinstance(value, str) and "${" in value:
            skipped.append((key, value, "an interpolation of verl's config; set its value here"))
        elif "$" in str(value):
            skipped.append((key, value, "holds a shell variable neither the script nor the environment sets"))
        elif entry is None:
            skipped.append((key, value, "hybridflow has no such key"))
        elif entry.ours is None:
            skipped.append((key, value, entry.note))
        else:
            try:
                values = entry.values(value, given)
            except (ValueError, TypeError) as e:
                skipped.append((key, value, str(e)))
                continue
            for ours_key, ours_value in values.items():  # a key read with another (name with path) adds nothing
                if ours.get(ours_key, (None,))[0] != ours_value:
                    ours[ours_key] = (ours_value, origin)
    return ours, skipped


def _yaml_value(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()


def render(ours: Mapping[str, tuple[Any, str]], skipped: list[tuple[str, Any, str]], source: str) -> str:
    """The recipe's text: sections of our keys, each commented with its verl origin, then what was not carried."""
    lines = [f"# Migrated from verl ({source}) by `hybridflow migrate`. Check it: hybridflow config --config THIS.yaml",
             "# Each key says which verl key it came from; verl defaults that differ from hybridflow's are set too."]
    tree: dict[str, Any] = {}
    for key in sorted(ours, key=lambda k: k.split(".")):
        node = tree
        *sections, leaf = key.split(".")
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = ours[key]

    def emit(node: dict[str, Any], indent: str) -> None:
        for name, item in node.items():
            if isinstance(item, dict):
                lines.append(f"{indent}{name}:")
                emit(item, indent + "  ")
            else:
                value, origin = item
                lines.append(f"{indent}{name}: {_yaml_value(value)}  # {origin}")

    emit(tree, "")
    if skipped:
        lines.append("# Not carried from verl:")
        lines += [f"#   {key}={_yaml_value(value)}: {why}" for key, value, why in skipped]
    return "\n".join(lines) + "\n"


def migrate(path: str | Path) -> str:
    """The recipe text for verl's script or config at `path` (see the module docstring)."""
    import tempfile

    from hybridflow.config.loader import load_config

    ours, skipped = translate(read_verl(path))
    while True:
        text = render(ours, skipped, str(path))
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as recipe:
            recipe.write(text)
            recipe.flush()
            try:
                load_config([], recipe.name)
                return text
            except ConfigError as e:
                bad = next((k for k in ours if f"'{k}'" in str(e)), None)
                if bad is None:
                    raise
                value, origin = ours.pop(bad)
                skipped.append((origin, value, f"{bad}: {str(e).split(': ', 1)[-1]}"))

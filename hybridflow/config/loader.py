"""Loading a typed config: schema defaults, then a YAML file (and its `base:` files), then dotted
`key=value` overrides.

    cfg = load_config(["rollout.n=8", "data.train_files=[a.parquet,b.parquet]"], "recipes/grpo.yaml")
    validate(cfg)                         # batch-size relations, before any model loads

Every key is checked against the schema before it is merged, in the YAML file as on the command line:
the unknown keys are reported all at once, each with a did-you-mean (for one of verl's or TRL's names, ours)
and where it came from; Hydra's `+key=value` is `key=value`, and its `~key` forgets what the files and earlier
overrides set for a key (so `~agent.env_kwargs 'agent.env_kwargs={a: 1}'` replaces a recipe's mapping, which
`agent.env_kwargs={a: 1}` alone merges into; lists are always replaced); a value of the wrong type names
the key, the value and the expected type; a value outside a field's choices names the valid ones. A
list field given one value (`data.train_files=a.parquet`) becomes a one-element list. A key neither the
files nor the overrides set follows a key that needs one value of it (`hybridflow.config.follow`:
`rollout.partial=true` alone keeps the KV cache). Also here: `to_yaml(cfg)` and `config_diff(a, b)` (used by
resume to name what changed).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hybridflow.config.follow import follow_defaults
from hybridflow.config.overrides import nest, parse_override, split_config_arg
from hybridflow.config.schema import RLConfig
from hybridflow.config.validate import ConfigError, validate
from hybridflow.config.trl_keys import trl_hint
from hybridflow.config.verl_keys import verl_hint

__all__ = ["ConfigError", "load_config", "validate", "to_yaml", "config_diff", "schema_fields",
           "type_name", "split_config_arg"]


@dataclasses.dataclass(frozen=True)
class FieldInfo:
    """One schema key: its dotted name, resolved type and dataclass field."""

    key: str
    type: Any
    field: dataclasses.Field

    @property
    def kind(self) -> str:
        """`section` (a nested config), `list`, `dict` or `scalar`."""
        tp = _strip_optional(self.type)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            return "section"
        origin = typing.get_origin(tp)
        if origin in (list, tuple) or tp in (list, tuple):
            return "list"
        if origin is dict or tp is dict:
            return "dict"
        return "scalar"

    @property
    def help(self) -> str:
        return self.field.metadata.get("help", "")

    @property
    def choices(self) -> tuple | None:
        """The valid values, or None when any value of the type is fine."""
        choices = self.field.metadata.get("choices")
        return choices() if callable(choices) else choices


def _strip_optional(tp: Any) -> Any:
    """`Optional[X]` -> `X`; any other type unchanged."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def type_name(tp: Any) -> str:
    """A readable name of a field type: `int`, `float or null`, `list of str`."""
    inner = _strip_optional(tp)
    suffix = " or null" if inner is not tp else ""
    origin = typing.get_origin(inner)
    if origin in (list, tuple):
        args = typing.get_args(inner)
        if origin is tuple:
            return f"list of {len(args)} {type_name(args[0])}" + suffix
        return f"list of {type_name(args[0])}" + suffix
    if origin is dict:
        return "mapping" + suffix
    if isinstance(inner, type) and dataclasses.is_dataclass(inner):
        return "section" + suffix
    return getattr(inner, "__name__", str(inner)) + suffix


def schema_fields(schema: type) -> dict[str, FieldInfo]:
    """Every key of `schema` (sections included) by dotted name, in declaration order."""
    out: dict[str, FieldInfo] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            info = FieldInfo(prefix + f.name, hints[f.name], f)
            out[info.key] = info
            if info.kind == "section":
                walk(_strip_optional(info.type), info.key + ".")

    walk(schema, "")
    return out


def _unknown_key(key: str, known: dict[str, FieldInfo]) -> str:
    """`unknown key 'rollout.temprature'; did you mean 'rollout.temperature'?`; for one of verl's or TRL's
    names, ours (`hybridflow.config.verl_keys`, `hybridflow.config.trl_keys`)."""
    hint = verl_hint(key) or trl_hint(key, known)
    if hint is not None:
        return f"unknown key '{key}': {hint}"
    names = list(known)
    guess = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    if not guess:
        leaf = key.rsplit(".", 1)[-1]
        leaves = {k: k.rsplit(".", 1)[-1] for k in names}
        close = difflib.get_close_matches(leaf, set(leaves.values()), n=1, cutoff=0.75)
        guess = [k for k, v in leaves.items() if close and v == close[0]][:1]
    section = key.rsplit(".", 1)[0] if "." in key else ""
    if guess:
        return f"unknown key '{key}'; did you mean '{guess[0]}'?"
    siblings = [k.rsplit(".", 1)[-1] for k in names if k.rsplit(".", 1)[0] == section and "." in k]
    if section in known and siblings:
        return f"unknown key '{key}'; '{section}' has: {', '.join(siblings)}"
    tops = [k for k in names if "." not in k]
    return f"unknown key '{key}'; top-level sections: {', '.join(tops)}"


def _leaves(data: Any, prefix: str) -> list[str]:
    """The dotted keys of a nested mapping's leaves (`prefix` itself for a leaf)."""
    if isinstance(data, Mapping) and data:
        return [k for name, value in data.items() for k in _leaves(value, f"{prefix}.{name}")]
    return [prefix]


def _check_tree(data: Mapping, known: dict[str, FieldInfo], source: str, problems: list[str],
                prefix: str = "") -> dict:
    """Checks every key of a nested mapping against the schema, adding what is wrong to `problems` (each leaf
    of an unknown section of verl's keys on its own, so each is named with ours); returns the tree with lists
    normalised."""
    out: dict = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        info = known.get(key)
        if info is None:
            leaves = _leaves(value, key)
            named = leaves if any(verl_hint(leaf) for leaf in leaves) else [key]
            problems += [f"{source}: {_unknown_key(leaf, known)}" for leaf in named]
            continue
        kind = info.kind
        if kind == "section":
            if value is None:
                continue
            if not isinstance(value, Mapping):
                problems.append(f"{source}: '{key}' is a section; expected a mapping of its keys, got {value!r}")
                continue
            out[name] = _check_tree(value, known, source, problems, key + ".")
        elif kind == "list" and value is not None and not isinstance(value, (list, tuple)):
            out[name] = [value]
        elif kind in ("list", "scalar") and isinstance(value, Mapping):
            problems.append(f"{source}: invalid value {value!r} for '{key}': expected {type_name(info.type)}")
        else:
            out[name] = value
    return out


def _deep_update(dst: dict, src: Mapping, sources: dict[str, str], source: str, prefix: str = "") -> None:
    """Merges the checked tree `src` into `dst` (later values win) and records each key's `source`."""
    for name, value in src.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping) and isinstance(dst.get(name), dict):
            _deep_update(dst[name], value, sources, source, key + ".")
        else:
            dst[name] = value
            sources[key] = source


def _source_of(key: str, sources: dict[str, str]) -> str:
    """Where `key` (or the section holding it) was set."""
    while key:
        if key in sources:
            return sources[key]
        key = key.rpartition(".")[0]
    return "config"


@functools.lru_cache(maxsize=None)
def _structured(schema: type) -> Any:
    """The schema's defaults as an OmegaConf structured config (built once; merging copies it)."""
    return OmegaConf.structured(schema)


def _merge(schema: type, tree: dict, known: dict[str, FieldInfo], sources: dict[str, str]) -> Any:
    """The schema's defaults with `tree` merged in; OmegaConf's type errors become ConfigErrors."""
    try:
        return OmegaConf.merge(_structured(schema), tree)
    except OmegaConfBaseException as e:
        key = (getattr(e, "full_key", "") or "").split("[")[0]
        info = known.get(key)
        value = getattr(e, "value", None)
        expected = type_name(info.type) if info else "a valid value"
        raise ConfigError(f"{_source_of(key, sources)}: invalid value {value!r} for '{key}': "
                          f"expected {expected}") from None


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file {path} not found")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as e:  # a YAML syntax error, reported with the file named
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of sections at the top, got {data!r}")
    return data


def _recipe_file(spec: Any, folder: Path) -> Any:
    """`spec` (``file.py:Name``, ``tools.yaml`` or a name) with its file made absolute when it is relative and
    exists next to the recipe in `folder`; otherwise unchanged (then relative to the working directory)."""
    if not isinstance(spec, str):
        return spec
    file, colon, name = spec.rpartition(":") if ":" in spec else (spec, "", "")
    if not file.endswith((".py", ".yaml", ".yml")) or Path(file).expanduser().is_absolute():
        return spec
    candidate = folder / file
    return f"{candidate.resolve()}{colon}{name}" if candidate.is_file() else spec


def _resolve_code_paths(data: dict, folder: Path) -> None:
    """The code files a recipe names (`agent.environment`, `agent.tools` entries and their `class`,
    `reward.function`, `reward.functions`) are found next to the recipe first, as its `base:` files are."""
    agent, reward = data.get("agent"), data.get("reward")
    if isinstance(agent, dict):
        if "environment" in agent:
            agent["environment"] = _recipe_file(agent["environment"], folder)
        tools = agent.get("tools")
        tools = tools if isinstance(tools, list) else []
        for i, entry in enumerate(tools):
            if isinstance(entry, dict) and "class" in entry:
                entry["class"] = _recipe_file(entry["class"], folder)
            else:
                tools[i] = _recipe_file(entry, folder)
    if isinstance(reward, dict):
        if "function" in reward:
            reward["function"] = _recipe_file(reward["function"], folder)
        if isinstance(reward.get("functions"), list):
            reward["functions"] = [_recipe_file(f, folder) for f in reward["functions"]]


def _yaml_layers(path: str | Path, chain: tuple[Path, ...] = ()) -> list[tuple[str, dict]]:
    """`[(source, tree), ...]` of a YAML file and its `base:` files (paths relative to it), bases first.

    `base: grpo.yaml` (or a list) makes a recipe a set of changes to another one. Code files it names are
    found next to it too (`_resolve_code_paths`).
    """
    path = Path(path)
    if path.resolve() in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path.resolve()))
        raise ConfigError(f"config file {path}: 'base' files form a cycle: {cycle}")
    data = _read_yaml(path)
    _resolve_code_paths(data, path.parent)
    bases = data.pop("base", None)
    layers: list[tuple[str, dict]] = []
    for base in [bases] if isinstance(bases, str) else bases or []:
        if not isinstance(base, str):
            raise ConfigError(f"config file {path}: 'base' must be a file name or a list of them, got {base!r}")
        layers += _yaml_layers(path.parent / base, (*chain, path.resolve()))
    return layers + [(f"config file {path}", data)]


def _drop(tree: dict, item: str, known: dict[str, FieldInfo], problems: list[str]) -> None:
    """`~key` (Hydra's deletion): forgets what the YAML files and earlier overrides set for `key` (a section
    too), which is then its default again, so a following `key=value` replaces a mapping instead of merging."""
    key = item[1:]
    if "=" in key or not key:
        problems.append(f"override {item!r}: ~ takes a key alone (~agent.env_kwargs), then key=value sets it anew")
    elif key not in known:
        problems.append(f"override {item!r}: {_unknown_key(key, known)}")
    else:
        *parents, leaf = key.split(".")
        node: Any = tree
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)


def _check_choices(obj: Any, known: dict[str, FieldInfo], sources: dict[str, str]) -> None:
    """Refuses values outside a field's `choices` (list fields: every element), naming their source; all of
    them at once."""
    problems = []
    for key, info in known.items():
        if not info.choices:
            continue
        value: Any = obj
        for part in key.split("."):
            value = getattr(value, part)
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if item not in info.choices:
                hint = difflib.get_close_matches(str(item), [str(c) for c in info.choices], n=1)
                mean = f"; did you mean '{hint[0]}'?" if hint else ""
                problems.append(f"{_source_of(key, sources)}: invalid value {item!r} for '{key}'; valid: "
                                f"{', '.join(map(str, info.choices))}{mean}")
    if problems:
        raise ConfigError(problems[0] if len(problems) == 1 else
                          f"{len(problems)} problems in the configuration:\n  - " + "\n  - ".join(problems))


def load_config(overrides: Sequence[str] = (), config_file: str | Path | None = None,
                schema: type = RLConfig) -> Any:
    """Builds a `schema` instance from its defaults, then `config_file` (YAML), then `overrides`.

    `overrides` are dotted `key=value` strings (`rollout.n=8`, `trainer.loggers=[console,jsonl]`);
    they may also contain `--config FILE`, so a command line's remaining arguments pass straight in.
    Raises `ConfigError` naming the file or override, the key and the valid keys/values/types.
    """
    in_argv, overrides = split_config_arg(overrides)
    if in_argv is not None and config_file is not None:
        raise ConfigError(f"two config files given: {config_file} and --config {in_argv}")
    config_file = config_file if config_file is not None else in_argv
    known = schema_fields(schema)
    tree: dict = {}
    sources: dict[str, str] = {}
    problems: list[str] = []
    for source, layer in _yaml_layers(config_file) if config_file is not None else []:
        _deep_update(tree, _check_tree(layer, known, source, problems), sources, source)
    for item in overrides:
        if item.startswith("~"):
            _drop(tree, item, known, problems)
            continue
        key, value = parse_override(item)
        source = f"override {item!r}"
        _deep_update(tree, _check_tree(nest(key, value), known, source, problems), sources, source)
    if problems:  # every unknown key at once
        raise ConfigError(problems[0] if len(problems) == 1 else
                          f"{len(problems)} problems in the configuration:\n  - " + "\n  - ".join(problems))
    cfg = _merge(schema, tree, known, sources)
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:  # e.g. an interpolation `${...}` that does not resolve
        raise ConfigError(f"cannot build the config: {e}") from None
    _check_choices(obj, known, sources)
    follow_defaults(obj, {key for name, value in tree.items() for key in _leaves(value, name)})
    return obj


def to_yaml(cfg: Any) -> str:
    """The config as YAML text (loadable again with `load_config(config_file=...)`)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _flatten(cfg: Any) -> dict[str, Any]:
    """A config (dataclass or nested mapping) as `{dotted key: leaf value}`."""
    tree = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type) else cfg
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, Mapping) and node:
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = list(node) if isinstance(node, tuple) else node

    walk(tree, "")
    return out


_ABSENT = "<absent>"


def config_diff(a: Any, b: Any) -> dict[str, tuple[Any, Any]]:
    """`{key: (value in a, value in b)}` for every leaf that differs (`'<absent>'` when missing)."""
    fa, fb = _flatten(a), _flatten(b)
    keys = list(fa) + [k for k in fb if k not in fa]
    return {k: (fa.get(k, _ABSENT), fb.get(k, _ABSENT)) for k in keys if fa.get(k, _ABSENT) != fb.get(k, _ABSENT)}

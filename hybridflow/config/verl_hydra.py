"""verl's Hydra configs as `hybridflow migrate` reads them: the YAML a script names with ``--config-path`` /
``--config-name`` (or a YAML given directly), composed with its ``defaults:`` list into ``{dotted key: value}``.

A defaults entry (``- name``, ``- group: option``, ``- group@package: option``, ``override``/``optional``
prefixes) is looked up in the config's own folder, then in the folders its ``hydra.searchpath`` names, then in
a verl checkout's ``verl/trainer/config`` found above the script. verl's own configs there are verl's defaults:
they are named (`Composed.bases`) but not flattened, since `VERL_DEFAULTS` already carries the ones that differ
from ours and the rest would drown the recipe in hundreds of keys verl sets by default. Layers compose in
order, ``_self_`` where it stands (last when absent, as in Hydra 1.1+).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hybridflow.config.validate import ConfigError

VERL_CONFIG_DIR = Path("verl") / "trainer" / "config"
# verl's trainer configs, known without a checkout: `defaults: [ppo_trainer]` is verl's defaults.
VERL_BASES = ("ppo_trainer", "ppo_megatron_trainer", "sft_trainer", "sft_trainer_engine", "generation",
              "evaluation")


@dataclass
class Composed:
    """The settings of a composed config, the verl base configs it builds on, and notes (entries not found)."""

    settings: dict[str, Any] = field(default_factory=dict)
    bases: list[str] = field(default_factory=list)
    notes: list[tuple[str, str]] = field(default_factory=list)  # (what, why)


def flatten(node: Any, prefix: str, out: dict[str, Any]) -> None:
    """A nested mapping as ``{dotted key: leaf}`` (an empty mapping is a leaf)."""
    if isinstance(node, Mapping) and node:
        for name, value in node.items():
            flatten(value, f"{prefix}{name}.", out)
    else:
        out[prefix[:-1]] = node


def verl_config_dir(start: Path) -> Path | None:
    """``verl/trainer/config`` of the verl checkout holding `start` (searched upwards), if any."""
    for folder in (start, *start.parents):
        if (folder / VERL_CONFIG_DIR).is_dir():
            return folder / VERL_CONFIG_DIR
    return None


def _load(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read it as YAML ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a Hydra config must be a mapping of keys, got {type(data).__name__}")
    return data


def compose(path: Path, workdir: Path, verl_dir: Path | None) -> Composed:
    """The config at `path` with its defaults (see the module docstring)."""
    out = Composed()
    _compose(path, "", workdir, verl_dir, out, depth=0)
    return out


def find(name: str, folders: list[Path]) -> Path | None:
    """``name`` (with or without ``.yaml``) in the first of `folders` holding it."""
    stem = name[:-5] if name.endswith(".yaml") else name
    return next((f / f"{stem}.yaml" for f in folders if (f / f"{stem}.yaml").is_file()), None)


def _compose(path: Path, package: str, workdir: Path, verl_dir: Path | None, out: Composed, depth: int) -> None:
    if depth > 16:
        raise ConfigError(f"{path}: defaults nest more than 16 deep (a cycle?)")
    data = _load(path)
    searchpath = [str(p) for p in (data.get("hydra") or {}).get("searchpath", []) if isinstance(p, str)]
    folders = [path.parent] + [_search_folder(p, workdir, path.parent) for p in searchpath]
    own: dict[str, Any] = {}
    body = {k: v for k, v in data.items() if k not in ("defaults", "hydra")}
    if body:
        flatten(_nest(package, body), "", own)
    entries = data.get("defaults") or []
    if not isinstance(entries, list):
        raise ConfigError(f"{path}: defaults must be a list, got {entries!r}")
    if "_self_" not in entries:
        entries = [*entries, "_self_"]
    for entry in entries:
        if entry == "_self_":
            out.settings.update(own)
            continue
        group, option = (next(iter(entry.items())) if isinstance(entry, dict) and len(entry) == 1
                         else (None, entry))
        if not isinstance(option, str) and option is not None:
            out.notes.append((f"defaults entry {entry!r} in {path}", "not a name hybridflow migrate can look up"))
            continue
        if option is None:
            continue  # `group: null` selects nothing
        where = package
        if group is not None:
            group = str(group).replace("override ", "").replace("optional ", "").strip()
            group, _, at = group.partition("@")
            where = (at if at != "_global_" else "") if at else ".".join(p for p in (package, group) if p)
            name = f"{group}/{option}"
        else:
            name = option
        local = find(name, folders)
        base = find(name, [verl_dir]) if verl_dir is not None else None
        if local is not None and (verl_dir is None or local.parent.resolve() != verl_dir.resolve()):
            _compose(local, where, workdir, verl_dir, out, depth + 1)
        elif base is not None or name in VERL_BASES:
            out.bases.append(name)
        else:
            out.notes.append((f"defaults: {name}", f"not found beside {path} or in a verl checkout's "
                                                   f"{VERL_CONFIG_DIR}; its keys are not read"))


def _nest(package: str, body: dict[str, Any]) -> dict[str, Any]:
    """`body` placed under the dotted `package` (``actor_rollout_ref.actor``)."""
    for part in reversed([p for p in package.split(".") if p]):
        body = {part: body}
    return body


def _search_folder(entry: str, workdir: Path, folder: Path) -> Path:
    """A ``hydra.searchpath`` entry (``file://dir`` or ``pkg://verl.trainer.config``) as a folder."""
    if entry.startswith("pkg://"):
        return workdir / Path(*entry[len("pkg://"):].split("."))
    text = entry.removeprefix("file://")
    target = Path(text)
    if target.is_absolute():
        return target
    return workdir / target if (workdir / target).is_dir() else folder / target

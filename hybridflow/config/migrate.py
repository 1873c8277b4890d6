"""`hybridflow migrate`: a hybridflow recipe from a verl launch script or a verl YAML config.

    hybridflow migrate examples/grpo_trainer/run_qwen2-7b.sh > recipes/qwen2_7b.yaml
    hybridflow migrate verl_config.yaml --out recipes/mine.yaml

A script is read as the shell would read it, without running anything (`hybridflow.config.shell_eval`: its
variables, defaults, arithmetic, arrays, ``$(pwd)``-style paths, with ``$(pwd)`` the script's project root, the
nearest folder above it holding ``.git``, ``pyproject.toml`` or ``setup.py``, where verl's scripts are run from).
Its verl command is the one running ``main_ppo``; its ``key=value`` arguments (``+key`` as ``key``) are laid over
the config it names with ``--config-path`` / ``--config-name`` (`hybridflow.config.verl_hydra`, following
``defaults:``). A YAML file is composed the same way. Each key goes through the one table of verl's keys
(`hybridflow.config.verl_keys`), with verl's defaults that differ from ours added (`VERL_DEFAULTS`), so the
recipe does what the verl run did. Each key written says in a comment which verl key it came from; every verl
key not carried is listed at the end with why, and so is each variable the script exports. A value that came
from a secret (`shell_eval.is_secret`: ``*_KEY``, ``*_TOKEN``, ``WANDB_*``, ...) or a key named like one is
never written: only its name is. A multi-turn, tool, interaction or reward key not carried is also a warning
(`Migration.warnings`), printed by the command. The recipe is loaded once before it is returned; a value our
config refuses is moved to the list.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hybridflow.config.shell_eval import evaluate
from hybridflow.config.shell_words import Word, is_secret
from hybridflow.config.shell_lexer import ShellSyntaxError
from hybridflow.config.validate import ConfigError
from hybridflow.config.verl_hydra import VERL_BASES, compose, find, verl_config_dir
from hybridflow.config.verl_keys import VERL_DEFAULTS, VERL_KEYS, VERL_PREFIXES, VerlKey
from hybridflow.config.verl_sft_keys import VERL_SFT_DEFAULTS, VERL_SFT_ENGINE_DEFAULTS, VERL_SFT_KEYS

# Each command's table of verl keys, verl's defaults that differ from ours, and dict-valued key prefixes.
TABLES: dict[str, tuple[dict[str, VerlKey], dict[str, Any], dict[str, str]]] = {
    "train": (VERL_KEYS, VERL_DEFAULTS, VERL_PREFIXES), "sft": (VERL_SFT_KEYS, VERL_SFT_DEFAULTS, {})}

KEY = re.compile(r"^\+{0,2}[A-Za-z_][\w]*(\.[\w-]+)*$")
ENTRIES = {"train": re.compile(r"(^|[./])main_ppo\w*(\.py)?$"),
           "sft": re.compile(r"(^|[./])(fsdp_sft_trainer|sft_trainer)(\.py)?$")}
ENGINE_SFT = re.compile(r"(^|[./])sft_trainer(\.py)?$")  # verl's engine SFT trainer: its own defaults
OTHER_ENTRY = re.compile(r"(^|[./])(main_generation|main_eval)(\.py)?$")
TORCHRUN = re.compile(r"^--(nproc[_-]per[_-]node|nnodes)(=(.*))?$")
SECRET_KEY = re.compile(r"(api_key|token|secret|password)$", re.I)
PROJECT_MARKERS = (".git", "pyproject.toml", "setup.py")
WARN = re.compile(r"multi_turn|tool|interaction|reward")
NOT_AGENT = ("global_profiler.",)  # its `tool` is a profiler's, not the model's
HIDDEN = "<not written: a secret>"


class _NoValue:
    """What a listed entry has when it is not a key with a value (a Hydra deletion, a config file not found)."""

    def __repr__(self) -> str:
        return "NO_VALUE"


NO_VALUE: Any = _NoValue()


@dataclass
class VerlRun:
    """What a verl script or config sets: ``{dotted key: value}``, the keys whose value came from a secret
    variable (and which), what was read but cannot be carried (what, value, why), and reading notes."""

    command: str = "train"  # the hybridflow command the recipe is for: train, or sft for verl's SFT trainer
    defaults: dict[str, Any] | None = None  # verl's defaults of the trainer it runs (None: its command's table's)
    settings: dict[str, Any] = field(default_factory=dict)
    secrets: dict[str, frozenset[str]] = field(default_factory=dict)
    skipped: list[tuple[str, Any, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class Migration:
    """The recipe's text, the warnings to print (multi-turn, tool, interaction, reward keys not carried) and the
    command the recipe is for (train, sft)."""

    text: str
    warnings: list[str]
    command: str = "train"


def project_root(script: Path) -> Path:
    """The folder verl's scripts are run from: the nearest above `script` with a project marker, else the
    working directory."""
    for folder in script.resolve().parents:
        if any((folder / marker).exists() for marker in PROJECT_MARKERS):
            return folder
    return Path.cwd()


def _parse(key: str, raw: str) -> Any:
    """A Hydra override's value (OmegaConf's grammar); one it cannot parse stays the string written."""
    from hybridflow.config.overrides import parse_override

    try:
        return parse_override(f"{key}={raw}")[1]
    except ConfigError:
        return raw


def _command(words: list[list[Word]], path: Path) -> tuple[str, Word, list[Word], list[Word]]:
    """The script's verl command: which of ours it becomes, the word naming verl's trainer, the words before it
    (a launcher's: torchrun, ray job submit) and its arguments after it."""
    for command in words:
        for i, word in enumerate(command):
            kind = next((k for k, entry in ENTRIES.items() if entry.search(word.text)), None)
            if kind is not None:
                return kind, word, command[:i], command[i + 1:]
    other = next((w.text for c in words for w in c if OTHER_ENTRY.search(w.text)), None)
    if other is not None:
        raise ConfigError(f"{path}: runs {other}, which hybridflow has no equivalent of (`hybridflow migrate` reads "
                          f"verl.trainer.main_ppo and verl's SFT trainers)")
    raise ConfigError(f"{path}: no python command running verl found (expected a line such as `python3 -m "
                      f"verl.trainer.main_ppo key=value ...`)")


def _read_script(path: Path, text: str) -> VerlRun:
    workdir = project_root(path)
    try:
        script = evaluate(text, path.resolve(), workdir, os.environ)
    except ShellSyntaxError as e:
        raise ConfigError(f"{path}: {e}") from None
    pwd = [f"$(pwd) and $PWD read as {workdir} (the script's project root)"] if "pwd" in text or "PWD" in text else []
    run = VerlRun(notes=pwd + script.notes)
    for name in script.exported:
        secret = is_secret(name)
        value = HIDDEN if secret else script.variables.get(name, "")
        run.skipped.append((f"export {name}", value, "a secret: set it in the environment of the run, never in a "
                            "recipe" if secret else "an environment variable the script exports: set it in the "
                            "shell that runs hybridflow"))
    run.command, trainer, launcher, args = _command([c for _, c in script.commands], path)
    if ENGINE_SFT.search(trainer.text):
        run.defaults = VERL_SFT_ENGINE_DEFAULTS
    for i, word in enumerate(launcher):  # torchrun's world size is verl SFT's
        match = TORCHRUN.match(word.text)
        if match:
            value = match.group(3) if match.group(2) else (launcher[i + 1].text if i + 1 < len(launcher) else "")
            run.settings[f"torchrun.{match.group(1).replace('-', '_')}"] = _parse("torchrun", value)
    config_path, config_name = _arguments(args, run)
    run.settings = {**_composed(config_path, config_name, path, workdir, run), **run.settings}
    return run


def _arguments(args: list[Word], run: VerlRun) -> tuple[str | None, str | None]:
    """verl's command-line arguments into `run` (settings, secrets, what is not carried); returns its
    ``--config-path`` and ``--config-name``."""
    config_path: str | None = None
    config_name: str | None = None
    i = 0
    while i < len(args):
        word = args[i]
        flag, sep, value = word.text.partition("=")
        if flag in ("--config-path", "-cp", "--config-name", "-cn"):
            if not sep:
                i += 1
                value = args[i].text if i < len(args) else ""
            if flag in ("--config-path", "-cp"):
                config_path = value
            else:
                config_name = value
        elif word.text.startswith("~"):
            run.skipped.append((word.text, NO_VALUE, "a Hydra deletion of a verl default; hybridflow's defaults differ"))
        elif sep and KEY.match(flag):
            key = flag.lstrip("+")
            if key.startswith("hydra."):
                run.skipped.append((key, value, "Hydra's own setting (run directory, logging)"))
            else:
                run.settings[key] = _parse(key, value)
                if word.secrets:
                    run.secrets[key] = word.secrets
        elif word.text:
            run.skipped.append((word.text, NO_VALUE, "not a key=value argument of verl's command"))
        i += 1
    return config_path, config_name


def _composed(config_path: str | None, config_name: str | None, script: Path, workdir: Path,
              run: VerlRun) -> dict[str, Any]:
    """The settings of the config ``--config-path`` / ``--config-name`` name (none for verl's own)."""
    verl_dir = verl_config_dir(script.resolve().parent) or verl_config_dir(workdir)
    if config_name is None:
        return {}
    folders = []
    if config_path:
        given = Path(config_path)
        folders = [given] if given.is_absolute() else [workdir / given, script.parent / given]
    local = find(config_name, folders)
    name = config_name.removesuffix(".yaml")
    if local is None:
        if name in VERL_BASES or (verl_dir is not None and find(name, [verl_dir])):
            run.notes.append(_base_note(f"--config-name={config_name}"))
        else:
            run.skipped.append((f"--config-name={config_name}", NO_VALUE, f"not found in "
                                f"{', '.join(map(str, folders)) or 'the folders given'}; its keys are not read"))
        return {}
    composed = compose(local, workdir, verl_dir)
    run.notes += [f"{local}: read with its defaults"] + [_base_note(f"defaults: {b}") for b in composed.bases]
    run.skipped += [(what, NO_VALUE, why) for what, why in composed.notes]
    return composed.settings


def _base_note(what: str) -> str:
    return f"{what}: verl's own config; its defaults that differ from hybridflow's are set"


def read_verl(path: str | Path) -> VerlRun:
    """verl's settings in `path`, a shell script or a ``.yaml`` config (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path} not found (give a verl shell script or YAML config)")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read it ({type(e).__name__}: {e})") from None
    if path.suffix in (".yaml", ".yml"):
        workdir = project_root(path)
        composed = compose(path, workdir, verl_config_dir(path.resolve().parent) or verl_config_dir(workdir))
        return VerlRun(settings=composed.settings, skipped=[(w, NO_VALUE, y) for w, y in composed.notes],
                       notes=[_base_note(f"defaults: {b}") for b in composed.bases])
    return _read_script(path, text)


Entries = list[tuple[str, Any, str]]  # (verl key, value, why)


def translate(run: VerlRun) -> tuple[dict[str, tuple[Any, str]], Entries, Entries]:
    """``({our key: (value, where from)}, not carried, read with nothing of their own to write)`` for verl's
    settings; the last are keys another key carries (``kl_loss_coef`` with ``use_kl_loss``) or whose value
    writes nothing (``use_dynamic_bsz=False``), each with its note."""
    keys, defaults, prefixes = TABLES[run.command]
    defaults = run.defaults if run.defaults is not None else defaults
    settings = run.settings
    given = {**defaults, **settings}
    ours: dict[str, tuple[Any, str]] = {}
    skipped: Entries = list(run.skipped)
    through: Entries = []
    for key, value in given.items():
        origin = key if key in settings else f"verl's default {key}={value}"
        prefix = next((p for p in prefixes if key.startswith(p)), None)
        entry = keys.get(key)
        if key in run.secrets or SECRET_KEY.search(key.rsplit(".", 1)[-1]):
            names = ", ".join(f"${n}" for n in sorted(run.secrets.get(key, ()))) or "its value"
            skipped.append((key, HIDDEN, f"holds a secret ({names}): set it in the environment of the run, "
                                         f"never in a recipe"))
        elif prefix is not None:
            ours[prefixes[prefix] + key[len(prefix):]] = (value, origin)
        elif "$(" in str(value) or "`" in str(value):
            skipped.append((key, value, "holds a command substitution hybridflow migrate does not run"))
        elif isinstance(value, str) and "${" in value:
            skipped.append((key, value, "an interpolation of verl's config; set its value here"))
        elif "$" in str(value):
            skipped.append((key, value, "holds a shell variable neither the script nor the environment sets"))
        elif entry is None:
            skipped.append((key, value, "hybridflow has no such key"))
        elif entry.ours is None:
            skipped.append((key, value, entry.note))
        elif value is None and entry.convert is None:
            through.append((key, value, "null: hybridflow's default applies"))
        else:
            try:
                values = entry.values(value, given)
            except (ValueError, TypeError) as e:
                skipped.append((key, value, str(e)))
                continue
            if not values and key in settings:
                through.append((key, value, entry.note))
            for ours_key, ours_value in values.items():
                if ours_key not in ours:
                    ours[ours_key] = (ours_value, origin)
                    continue
                old_value, old_origin = ours[ours_key]
                if old_value == ours_value:  # several verl keys agree (n_gpus_per_node with nnodes): name them all
                    ours[ours_key] = (old_value, old_origin if origin in old_origin.split(", ")
                                      else f"{old_origin}, {origin}")
                    continue
                if old_origin in settings:  # two verl keys disagree: the later wins, as in Hydra
                    skipped.append((old_origin, old_value, f"{ours_key} is set by {origin} too; that value wins"))
                ours[ours_key] = (ours_value, origin)
    return ours, skipped, through


def _yaml_value(value: Any) -> str:
    """`value` as YAML on one line (JSON, which YAML reads, where YAML would break a line: a chat template)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()
    return json.dumps(value) if "\n" in text else text


def _comments(entries: Entries) -> list[str]:
    """One comment line per entry, whatever the lines of its value or reason."""
    return [f"#   {key}" + ("" if value is NO_VALUE else f"={_yaml_value(value)}") + ": " + " ".join(why.split())
            for key, value, why in entries]


def render(ours: Mapping[str, tuple[Any, str]], skipped: Entries, source: str, notes: list[str] | None = None,
           command: str = "train", through: Entries | None = None) -> str:
    """The recipe's text: sections of our keys, each commented with its verl origin, then what was not carried."""
    check = "hybridflow config" + (f" --command {command}" if command != "train" else "")
    lines = [f"# Migrated from verl ({source}) by `hybridflow migrate`: a recipe for `hybridflow {command}`. "
             f"Check it: {check} --config THIS.yaml",
             "# Each key says which verl key it came from; verl defaults that differ from hybridflow's are set too."]
    lines += [f"# Read: {note}" for note in notes or ()]
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
    if through:
        lines += ["# Read, with nothing of their own to write (another key carries them, or they are off):",
                  *_comments(through)]
    if skipped:
        lines += ["# Not carried from verl:", *_comments(skipped)]
    return "\n".join(lines) + "\n"


def _warnings(ours: Mapping[str, Any], skipped: Entries) -> list[str]:
    """Multi-turn, tool, interaction and reward keys not carried, and config files not found."""
    agent = any(k.startswith("agent.") for k in ours)
    out = []
    for key, value, why in skipped:
        if key.endswith("multi_turn.enable") and (agent or str(value).lower() == "false"):
            continue  # multi-turn is on exactly when the tools or interaction it names are carried
        if WARN.search(key) and not key.startswith(NOT_AGENT) or "not found" in why:
            out.append(f"not carried: {key}" + ("" if value is NO_VALUE else f"={_yaml_value(value)}") + f": {why}")
    return out


def migrate(path: str | Path) -> Migration:
    """The recipe for verl's script or config at `path`, and its warnings (see the module docstring)."""
    import tempfile

    from hybridflow.config.loader import load_config

    from hybridflow.config.commands import COMMANDS

    run = read_verl(path)
    ours, skipped, through = translate(run)
    while True:
        text = render(ours, skipped, str(path), run.notes, run.command, through)
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as recipe:
            recipe.write(text)
            recipe.flush()
            try:
                load_config([], recipe.name, schema=COMMANDS[run.command][0])
                return Migration(text, _warnings(ours, skipped), run.command)
            except ConfigError as e:
                bad = next((k for k in ours if f"'{k}'" in str(e) or f"{k}=" in str(e)), None)
                if bad is None:
                    raise
                value, origin = ours.pop(bad)
                skipped.append((origin, value, f"{bad}: {str(e).split(': ', 1)[-1]}"))

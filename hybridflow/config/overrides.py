"""The command line's overrides: `key=value` parsed with OmegaConf's grammar (`parse_override`), nested into a
mapping (`nest`), and `--config FILE` told apart from them (`split_config_arg`). The loader
(`hybridflow.config.loader`) checks and merges what they give; `~key` is the loader's too, since forgetting a key
reads the layers merged so far."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from omegaconf import OmegaConf

from hybridflow.config.validate import ConfigError


def parse_override(item: str) -> tuple[str, Any]:
    """`"rollout.n=8"` -> `("rollout.n", 8)`; values use OmegaConf's grammar (lists, null, quotes). Hydra's
    `+key=value` / `++key=value` (verl's way to add a key) mean `key=value`: every key exists here."""
    key, sep, raw = item.partition("=")
    key = key.strip().lstrip("+")
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not of the form key=value (e.g. rollout.n=8)")
    try:
        value = cast(dict, OmegaConf.to_container(OmegaConf.from_dotlist([f"_v={raw}"])))["_v"]
    except Exception as e:
        raise ConfigError(f"override {item!r}: cannot parse the value {raw!r}: {e}") from None
    return key, value


def nest(key: str, value: Any) -> dict:
    """`("a.b.c", 1)` -> `{"a": {"b": {"c": 1}}}`."""
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def split_config_arg(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """Separates `--config FILE` / `--config=FILE` from the `key=value` overrides in argv."""
    config_file, rest = None, []
    items = list(argv)
    i = 0
    while i < len(items):
        item = items[i]
        if item == "--config" or item.startswith("--config="):
            if config_file is not None:
                raise ConfigError("--config given more than once")
            if item == "--config":
                if i + 1 >= len(items):
                    raise ConfigError("--config needs a file name")
                config_file, i = items[i + 1], i + 1
            else:
                config_file = item.split("=", 1)[1]
        else:
            rest.append(item)
        i += 1
    return config_file, rest

"""Helpers of the agent tests: an `agent` config section with overrides."""

from __future__ import annotations

from types import SimpleNamespace


def agent_cfg(**overrides):
    """An `agent` config section (the schema's defaults) with `overrides`."""
    from hybridflow.config.schema import AgentConfig

    return SimpleNamespace(**{**vars(AgentConfig()), **overrides})

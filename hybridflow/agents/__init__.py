"""Multi-turn episodes on the rollout engine: environments, tools and the agent loop.

- `environment`: the `Environment` protocol (`step(text, turn) -> EnvStep`), loaded from
  `agent.environment=path/to/file.py:Class`.
- `tools` / `toolset`: the `Tool` protocol and the run's tools (built-ins `calculator` and `python`, or
  `file.py:Class`); `parsing`: Hermes / Qwen `<tool_call>` blocks; `calculator`, `sandbox` (+
  `sandbox_child`, `sandbox_seccomp`): the built-ins.
- `verl_tools`, `verl_interaction`: verl's tool config YAML / `BaseTool` classes and its `BaseInteraction`
  classes / interaction config YAML, behind the tool and environment protocols.
- `host` / `host_process`: the process where environments and tools run, apart from the rollout.
- `rendering`: the chat template's ids for new messages; `trajectory`: an episode as token ids, mask
  and log-probs; `driver`: the engine session under asyncio; `loop`: `AgentLoop`, which runs them.
- The OpenAI-compatible endpoint: `endpoint` (routes; `openai_wire`: the wire format; `http_server`;
  `stitching`: a trajectory's requests as one token sequence; `token_check`), `endpoint_rollout` (runners
  in the runner process: `runner_host`, `runner_child`), the adapters `gym_runner`, `verifiers_runner`,
  `openenv_runner`, and `episodes` (which rollout a run uses).

Imports only `engine/rollout`, `data` and `utils`; the rollout worker drives it (docs/agents.md). The
names below are imported on first use, so the processes that run user code (`host_process`,
`runner_child`, which import modules of this package) do not load PyTorch.
"""

import importlib
from typing import Any

_EXPORTS = {"AgentLoop": "agent_loop", "EnvStep": "environment", "Environment": "environment", "Tool": "tools",
            "ToolContext": "tools", "ToolResult": "tools", "Trajectory": "trajectory"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hybridflow.agents' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hybridflow.agents.{_EXPORTS[name]}"), name)

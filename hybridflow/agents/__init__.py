"""Multi-turn episodes on the rollout engine, one subpackage per concern:

- `loop/`: the in-process episode loop (`AgentLoop`) and what the endpoint shares with it: the engine's
  session under asyncio, the chat template's ids for new messages, `Trajectory`, the `Environment`
  protocol, and the process where environments and tools run (`host`, `host_process`).
- `endpoint/`: the OpenAI-compatible endpoint (routes, wire format, HTTP server, a trajectory's requests
  stitched into one token sequence) and `EndpointRollout`, agent runners driving it from their own process.
- `adapters/`: Gymnasium, verifiers and OpenEnv environments through the endpoint; verl's tools and
  interactions in the loop.
- `tools/`: the `Tool` protocol, the run's tools, `<tool_call>` parsing, the built-in calculator and the
  sandboxed Python executor.
- `episodes`: which of the two rollouts (`AgentLoop`, `EndpointRollout`) a run uses.

Imports only `engine/rollout`, `data` and `utils`; the rollout worker drives it (docs/agents.md). The
names below are imported on first use, so the processes that run user code (`host_process`,
`runner_child`, which import modules of this package) do not load PyTorch.
"""

import importlib
from typing import Any

_EXPORTS = {"AgentLoop": "loop.agent_loop", "EnvStep": "loop.environment", "Environment": "loop.environment",
            "Tool": "tools.tool", "ToolContext": "tools.tool", "ToolResult": "tools.tool",
            "Trajectory": "loop.trajectory"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hybridflow.agents' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hybridflow.agents.{_EXPORTS[name]}"), name)

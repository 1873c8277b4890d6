"""Multi-turn episodes on the rollout engine: environments, tools and the agent loop.

- `environment`: the `Environment` protocol (`step(text, turn) -> EnvStep`), loaded from
  `agent.environment=path/to/file.py:Class`.
- `tools` / `toolset`: the `Tool` protocol and the run's tools (built-ins `calculator` and `python`, or
  `file.py:Class`); `parsing`: Hermes / Qwen `<tool_call>` blocks; `calculator`, `sandbox` (+
  `sandbox_child`): the built-ins.
- `verl_tools`, `verl_interaction`: verl's tool config YAML / `BaseTool` classes and its `BaseInteraction`
  classes / interaction config YAML, behind the tool and environment protocols.
- `rendering`: the chat template's ids for new messages; `trajectory`: an episode as token ids, mask
  and log-probs; `driver`: the engine session under asyncio; `loop`: `AgentLoop`, which runs them.

Imports only `engine/rollout`, `data` and `utils`; the rollout worker drives it (docs/agents.md).
"""

from hybridflow.agents.environment import Environment, EnvStep
from hybridflow.agents.loop import AgentLoop
from hybridflow.agents.tools import Tool, ToolContext, ToolResult
from hybridflow.agents.trajectory import Trajectory

__all__ = ["AgentLoop", "EnvStep", "Environment", "Tool", "ToolContext", "ToolResult", "Trajectory"]

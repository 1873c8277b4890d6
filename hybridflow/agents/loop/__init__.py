"""The in-process episode loop and what it shares with the endpoint: the engine's session under asyncio
(`engine_driver`), the chat template's ids for new messages (`rendering`), an episode as token ids
(`trajectory`), the `Environment` protocol (`environment`), `AgentLoop` (`agent_loop`), and the process
environments and tools run in (`host`, `host_process`; `calls`: user code under a time limit)."""

"""The OpenAI-compatible endpoint on the rollout engine: its routes (`routes`), the wire format
(`openai_wire`), the HTTP server (`http_server`), a trajectory's requests as one token sequence
(`stitching`, `token_check`), and a rollout phase of agent runners through it (`endpoint_rollout`; the
runners' process: `runner_host`, `runner_child`)."""

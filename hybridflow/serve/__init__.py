"""`hybridflow serve`: a local service speaking the Tinker REST API, so the `tinker` SDK trains and samples here.

Modules: `http_api` (the aiohttp routes under `/api/v1`, the API key), `tinker_service` (sessions, training
clients, weight snapshots, sampling sessions, the futures the SDK polls), `lora_trainee` (one training client's
LoRA model and optimizer), `tinker_losses` (Tinker's loss names on our algorithms library), `sampler` (the
rollout engine per base model), `wire` (the SDK's protobuf bodies). docs/tinker.md says what is served.
"""

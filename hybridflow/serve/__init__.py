"""`hybridflow serve`: a local service speaking the Tinker REST API, so the `tinker` SDK trains and samples here.

Modules: `config` (what the server was started with), `http_api` (the aiohttp routes under `/api/v1`, the API
key, the session-expiry loop), `sessions` (open sessions, their heartbeats, expiry), `tinker_service` (training
clients, weight snapshots, sampling sessions, the futures the SDK polls), `work_queue` (the one worker thread,
batching requests that arrive together), `base_models` (each base loaded once, the clients' models on it),
`trainee` (one training client's model, LoRA or full-parameter, and its optimizer), `tinker_losses` (Tinker's loss
names on our algorithms library), `checkpoints` (saved states, Hugging Face exports, their listing), `sampler` (the
rollout engine per base model), `wire` (the SDK's protobuf bodies). docs/tinker.md says what is served.
"""

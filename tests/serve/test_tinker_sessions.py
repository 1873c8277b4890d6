"""Sessions whose client vanished: `Sessions` expires a session after `session_timeout_s` without a heartbeat, and a
server with the real SDK as client then releases its training clients, answers the SDK's heartbeat with 410, names
the expiry when a late request arrives, and lets the client close quietly."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

tinker = pytest.importorskip("tinker")

from hybridflow.serve.sessions import Sessions  # noqa: E402

from tests.serve.conftest import API_KEY, TOKENS, start_server  # noqa: E402
from tests.serve.conftest import datum as _datum  # noqa: E402


def test_a_session_expires_after_the_timeout_without_heartbeats():
    now = [0.0]
    sessions = Sessions(timeout_s=30, clock=lambda: now[0])
    alive, silent = sessions.open(), sessions.open()
    now[0] = 25.0
    assert sessions.heartbeat(alive) and sessions.expired() == []
    now[0] = 31.0
    assert sessions.expired() == [silent]  # 31 s since its opening; `alive` beat 6 s ago
    assert silent not in sessions and silent in sessions.expired_ids and alive in sessions
    assert not sessions.heartbeat(silent) and not sessions.finish(silent)
    now[0] = 1000.0
    assert sessions.finish(alive) and sessions.expired() == []
    never = Sessions(timeout_s=0, clock=lambda: now[0])
    kept = never.open()
    now[0] = 1e9
    assert never.expired() == [] and kept in never


@pytest.mark.parametrize("bad", ["-1", "nan"])
def test_a_negative_or_nan_timeout_is_refused(bad, tiny_qwen2, capsys):
    from hybridflow.cli import main

    assert main(["serve", "--model", f"tiny={tiny_qwen2}", "--session-timeout-s", bad]) == 2
    assert f"--session-timeout-s={float(bad)} must be >= 0" in capsys.readouterr().err


def _heartbeat(url: str, session_id: str) -> int:
    request = urllib.request.Request(f"{url}/api/v1/session_heartbeat", method="POST",
                                     data=json.dumps({"session_id": session_id}).encode(),
                                     headers={"X-API-Key": API_KEY, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_vanished_clients_session_expires_and_its_models_are_released(tiny_qwen2, tmp_path):
    """The server's clock is the test's: the SDK's first heartbeat (10 s in) never comes within the test, so the
    session expires once the test moves the clock past the timeout, with the SDK client as a vanished one."""
    server, stop = start_server(tiny_qwen2, tmp_path / "checkpoints", session_timeout_s=0.4)
    try:
        now = [0.0]
        server.service.sessions.clock = lambda: now[0]
        client = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
        trainer = client.create_lora_training_client(base_model="tiny", rank=2).result()
        datum = _datum(TOKENS, weights=[1.0] * (len(TOKENS) - 1))
        trainer.forward_backward([datum], "cross_entropy").result()
        session = client.holder.get_session_id()
        assert _heartbeat(server.url, session) == 200
        kept = server.client.create_lora_training_client(base_model="tiny", rank=2).result()

        now[0] = 0.3  # the server's own client stays alive: it beats on the test's clock
        assert _heartbeat(server.url, server.client.holder.get_session_id()) == 200
        now[0] = 0.6  # 0.6 s since `session`'s last beat, 0.3 s since the other's
        deadline = time.monotonic() + 30
        while session in server.service.sessions and time.monotonic() < deadline:
            time.sleep(0.05)
        assert session not in server.service.sessions and session in server.service.sessions.expired_ids
        with pytest.raises(tinker.RequestFailedError, match="expired: its client sent no heartbeat"):
            trainer.forward_backward([datum], "cross_entropy").result()
        assert not any(m.startswith(f"{session}:") for m in server.service.models)
        assert kept.model_id in server.service.models  # the live session's client stays
        assert _heartbeat(server.url, session) == 410  # the SDK stops its heartbeat loop on this answer
        assert _heartbeat(server.url, "session-never-opened") == 410
        client.close("success").result(30)  # a client that comes back and closes: the expired session finishes quietly
    finally:
        stop()

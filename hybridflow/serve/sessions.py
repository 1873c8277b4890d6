"""The service's sessions and whether their clients are still there.

The SDK's `ServiceClient` opens a session, sends `session_heartbeat` every 10 s while it lives, and finishes the
session when it closes. A client that vanishes without closing (killed, its machine gone) sends neither, and its
training clients would hold their weights and optimizer state until the server stops. `Sessions` records each open
session's last heartbeat; `expired()` ends those silent for longer than `timeout_s` (0: never) and remembers them,
so the service can release their training clients and name the reason when a late request arrives. A heartbeat
for a session that is no longer open answers False: the server then says 410, on which the SDK stops its loop.
"""

from __future__ import annotations

import time
import uuid
from typing import Callable


class Sessions:
    """Open sessions by id with their last heartbeat (`clock()` seconds), and the ids that expired."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s, self.clock = timeout_s, clock
        self.last_seen: dict[str, float] = {}
        self.expired_ids: set[str] = set()

    def __contains__(self, session_id: object) -> bool:
        return session_id in self.last_seen

    def open(self) -> str:
        session_id = f"session-{uuid.uuid4()}"
        self.last_seen[session_id] = self.clock()
        return session_id

    def heartbeat(self, session_id: str) -> bool:
        """Record that `session_id`'s client is alive; False when the session is not open (finished or expired)."""
        if session_id not in self.last_seen:
            return False
        self.last_seen[session_id] = self.clock()
        return True

    def finish(self, session_id: str) -> bool:
        """Close `session_id`; False when it was not open (an expired session counts as finished already)."""
        return self.last_seen.pop(session_id, None) is not None

    def expired(self) -> list[str]:
        """Close and return the open sessions whose last heartbeat is older than `timeout_s`."""
        if self.timeout_s == 0:
            return []
        now = self.clock()
        gone = [s for s, seen in self.last_seen.items() if now - seen > self.timeout_s]
        for session_id in gone:
            del self.last_seen[session_id]
            self.expired_ids.add(session_id)
        return gone

"""The dispatcher across processes: kill -9 mid-transmit, restarts, two daemons on one queue (SPEC 6, 7).

Each daemon is ``python -m agent run`` with a real config, stopped by its
PID; the upstream is a real DevServer on its own loop thread. Waiting is by
polling the database or the server's records with a deadline.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from agent.app.devserver import Answer, default_answer
from agent.core.protocol import Transmit
from tests.agenttest import (
    Daemon,
    DevServerThread,
    MllpClient,
    ack_code,
    db_rows,
    free_port,
    hl7_message,
    toml_config,
    wait_for,
)

pytestmark = pytest.mark.slow

#: Long enough that only the provably-dead rule can explain a fast takeover.
LONG_TTL = 60


def config(tmp_path: Path, server: DevServerThread, port: int, *, lease_ttl: float | None = None,
           **channel: Any) -> str:
    text = toml_config(tmp_path / "data", [{"name": "adt", "listen": f"127.0.0.1:{port}", **channel}],
                       server_url=server.url)
    if lease_ttl is not None:
        assert "lease_ttl = 6\n" in text
        text = text.replace("lease_ttl = 6\n", f"lease_ttl = {lease_ttl}\n")
    return text


def db(tmp_path: Path) -> Path:
    return tmp_path / "data" / "queue.db"


def row(tmp_path: Path, control_id: str) -> dict[str, Any] | None:
    found = db_rows(db(tmp_path), "SELECT id, state, attempts, error_code FROM messages "
                                  "WHERE control_id = ? AND state <> 'nacked'", (control_id,))
    if not found:
        return None
    return dict(zip(("id", "state", "attempts", "error_code"), found[0], strict=True))


def state(tmp_path: Path, control_id: str) -> str | None:
    r = row(tmp_path, control_id)
    return None if r is None else str(r["state"])


def lease_pid(tmp_path: Path) -> int | None:
    """PID of the live lease holder, or None when the lease is free or expired."""
    found = db_rows(db(tmp_path), "SELECT holder_pid, expires_at FROM lease WHERE name = 'dispatch'")
    if not found or found[0][0] is None or (found[0][1] or 0) <= time.time():
        return None
    return int(found[0][0])


class HoldFirst:
    """decide: never answer the first transmit of ``control_id``; answer everything else normally."""

    def __init__(self, control_id: str) -> None:
        self.control_id = control_id
        self.held = False

    async def __call__(self, t: Transmit) -> Answer | None:
        if t.control_id == self.control_id and not self.held:
            self.held = True
            return None
        return default_answer(t)


class TestKillNine:
    def _crash_with_inflight(self, tmp_path: Path, server: DevServerThread, daemons: list[Daemon],
                             **channel: Any) -> tuple[str, int]:
        """Start a daemon, queue K1, wait until it is inflight and unanswered, SIGKILL. Returns (id, port)."""
        port = free_port()
        text = config(tmp_path, server, port, lease_ttl=LONG_TTL, **channel)
        first = Daemon(tmp_path, text, name="first").start()
        daemons.append(first)
        first.wait_started()
        with MllpClient(port) as client:
            assert ack_code(client.exchange(hl7_message("K1"))) == "AA"
        wait_for(lambda: state(tmp_path, "K1") == "inflight", 10, what="K1 inflight")
        wait_for(lambda: len(server.server.received) == 1, 5, what="K1 at the server")
        first.kill()
        r = row(tmp_path, "K1")
        assert r is not None and (r["state"], r["attempts"]) == ("inflight", 1)
        return str(r["id"]), port

    def _restart(self, tmp_path: Path, server: DevServerThread, daemons: list[Daemon], port: int,
                 **channel: Any) -> Daemon:
        text = config(tmp_path, server, port, lease_ttl=LONG_TTL, **channel)
        second = Daemon(tmp_path, text, name="second").start()
        daemons.append(second)
        return second

    def test_restart_resends_inflight_with_the_same_id_to_a_replaying_server(
        self, tmp_path: Path, daemons: list[Daemon], servers: list[DevServerThread]
    ) -> None:
        """After kill -9 the restarted daemon takes the lease at once and resends K1 as attempt 2; processed once."""
        server = DevServerThread(decide=HoldFirst("K1")).start()
        servers.append(server)
        message_id, port = self._crash_with_inflight(tmp_path, server, daemons)
        restarted_at = time.monotonic()
        second = self._restart(tmp_path, server, daemons, port)
        wait_for(lambda: state(tmp_path, "K1") == "processed", 8, what="K1 processed after restart")
        assert time.monotonic() - restarted_at < 8 < LONG_TTL  # provably dead holder, not the TTL
        assert lease_pid(tmp_path) == second.pid
        r = row(tmp_path, "K1")
        assert r is not None and r["attempts"] == 2
        k1 = [t for t in server.server.received if t.control_id == "K1"]
        assert [(t.id, t.attempt) for t in k1] == [(message_id, 1), (message_id, 2)]
        with MllpClient(port) as client:
            assert ack_code(client.exchange(hl7_message("K2"))) == "AA"
        wait_for(lambda: state(tmp_path, "K2") == "processed", 8, what="K2 processed")
        assert second.stop() == 0

    def test_restart_against_a_non_replaying_server_fails_the_ambiguous_row(
        self, tmp_path: Path, daemons: list[Daemon], servers: list[DevServerThread]
    ) -> None:
        """A non-replaying server cannot dedupe: the inflight row goes to failed for review, the channel goes on."""
        server = DevServerThread(replay=False, decide=HoldFirst("K1")).start()
        servers.append(server)
        _message_id, port = self._crash_with_inflight(tmp_path, server, daemons)
        second = self._restart(tmp_path, server, daemons, port)
        wait_for(lambda: state(tmp_path, "K1") == "failed", 8, what="K1 failed")
        r = row(tmp_path, "K1")
        assert r is not None and r["error_code"] == "ambiguous"
        assert [t.attempt for t in server.server.received if t.control_id == "K1"] == [1]
        with MllpClient(port) as client:
            assert ack_code(client.exchange(hl7_message("K2"))) == "AA"
        wait_for(lambda: state(tmp_path, "K2") == "processed", 8, what="K2 processed")
        assert second.stop() == 0

    def test_guaranteed_delivery_channel_requeues_and_delivers(
        self, tmp_path: Path, daemons: list[Daemon], servers: list[DevServerThread]
    ) -> None:
        """On a guaranteed_delivery channel the ambiguous row is sent again (same id) and processed."""
        server = DevServerThread(replay=False, decide=HoldFirst("K1")).start()
        servers.append(server)
        message_id, port = self._crash_with_inflight(tmp_path, server, daemons, guaranteed_delivery=True)
        second = self._restart(tmp_path, server, daemons, port, guaranteed_delivery=True)
        wait_for(lambda: state(tmp_path, "K1") == "processed", 8, what="K1 processed")
        k1 = [t for t in server.server.received if t.control_id == "K1"]
        assert [(t.id, t.attempt) for t in k1] == [(message_id, 1), (message_id, 2)]
        assert second.stop() == 0


class TestTwoDaemons:
    def test_one_dispatcher_at_a_time_and_takeover_on_sigterm(
        self, tmp_path: Path, daemons: list[Daemon], servers: list[DevServerThread]
    ) -> None:
        """Two daemons on one queue: only the holder talks to the server; after SIGTERM the other delivers the rest."""
        sessions_at_transmit: list[int] = []
        holder: dict[str, Any] = {}

        async def decide(t: Transmit) -> Answer:
            sessions_at_transmit.append(server.server.active_sessions)
            await asyncio.sleep(0.02)  # scripted server latency, so SIGTERM lands mid-stream
            return default_answer(t)

        server = DevServerThread(decide=decide).start()
        servers.append(server)
        port = free_port()
        text = config(tmp_path, server, port)
        a = Daemon(tmp_path, text, name="a").start()
        daemons.append(a)
        a.wait_started()
        wait_for(lambda: lease_pid(tmp_path) == a.pid, 10, what="a holds the lease")
        b = Daemon(tmp_path, text, name="b").start()  # same config: takes a's listeners by handover
        daemons.append(b)
        b.wait_started()
        assert b.has_event("listeners_received_by_handover")

        batch1 = [hl7_message(f"T{i:03d}") for i in range(40)]
        with MllpClient(port) as client:
            for message in batch1:
                client.send(message)
            assert [ack_code(client.read_ack()) for _ in batch1] == ["AA"] * 40
        wait_for(lambda: len(server.server.answered) >= 5, 10, what="a few delivered")
        assert lease_pid(tmp_path) == a.pid
        a.signal(15)
        assert a.wait_exit(20) == 0, a.log_tail(60)
        holder["stopped_at"] = time.monotonic()
        wait_for(lambda: lease_pid(tmp_path) == b.pid, 5, what="b takes the lease")
        # lease_acquire_interval is 0.5 s in the test config; allow process and disk latency.
        assert time.monotonic() - holder["stopped_at"] < 3.0
        batch2 = [hl7_message(f"T{i:03d}") for i in range(40, 60)]
        with MllpClient(port) as client:
            assert [ack_code(client.exchange(m)) for m in batch2] == ["AA"] * 20
        wait_for(lambda: len(server.server.answered) == 60, 20, what="all 60 delivered")
        wait_for(lambda: db_rows(db(tmp_path), "SELECT count(*) FROM messages WHERE state = 'processed'")
                 == [(60,)], 5, what="60 processed rows")
        received = server.server.received
        assert [t.control_id for t in received] == [f"T{i:03d}" for i in range(60)]
        assert [t.seq for t in received] == list(range(1, 61))
        assert server.server.max_concurrent_sessions_seen == 1
        assert set(sessions_at_transmit) == {1}
        assert b.stop() == 0

"""Graceful and forced stops of the daemon (SPEC 7 shutdown order)."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
from agenttest import (
    Daemon,
    MllpClient,
    ack_code,
    db_rows,
    free_port,
    hl7_message,
    toml_config,
    wait_for,
)

from agent.core import mllp

pytestmark = pytest.mark.slow


def _daemon(tmp_path: Path, port: int, **channel: object) -> Daemon:
    return Daemon(tmp_path, toml_config(tmp_path / "data", [{"name": "adt", "listen": f"127.0.0.1:{port}", **channel}]))


class TestGracefulStop:
    def test_frame_being_read_at_sigterm_is_committed_and_acked(self, tmp_path: Path) -> None:
        """A sender halfway through a frame when SIGTERM arrives still gets its AA, then a clean close."""
        port = free_port()
        daemon = _daemon(tmp_path, port).start().wait_started()
        try:
            with MllpClient(port) as client:
                assert ack_code(client.exchange(hl7_message("BEFORE"))) == "AA"
                frame = mllp.encode_frame(hl7_message("HALF"))
                client.send_raw(frame[:40])
                daemon.signal(signal.SIGTERM)
                daemon.wait_event("shutdown_requested", timeout=10)
                client.send_raw(frame[40:])
                ack = client.read_ack(timeout=10)
                assert ack_code(ack) == "AA"
                # Then the agent closes the connection (EOF, no reset).
                client.sock.settimeout(10)
                assert client.sock.recv(100) == b""
            assert daemon.wait_exit(20) == 0
        finally:
            daemon.stop()
        ids = {r[0] for r in db_rows(tmp_path / "data" / "queue.db", "SELECT control_id FROM messages")}
        assert ids == {"BEFORE", "HALF"}

    def test_idle_connections_are_closed_and_the_process_exits_within_budget(self, tmp_path: Path) -> None:
        """Idle sender connections do not hold the old process: it exits 0 well within shutdown_budget."""
        port = free_port()
        daemon = _daemon(tmp_path, port).start().wait_started()
        clients = [MllpClient(port) for _ in range(5)]
        try:
            for i, client in enumerate(clients):
                assert ack_code(client.exchange(hl7_message(f"IDLE{i}"))) == "AA"
            started = time.monotonic()
            daemon.signal(signal.SIGTERM)
            assert daemon.wait_exit(20) == 0
            assert time.monotonic() - started < 10
            for client in clients:
                client.sock.settimeout(5)
                assert client.sock.recv(100) == b""
        finally:
            for client in clients:
                client.close()
            daemon.stop()

    def test_second_signal_exits_fast_and_keeps_every_accepted_message(self, tmp_path: Path) -> None:
        """SIGTERM twice during load: the daemon exits at once, and every message that got AA is in the database."""
        port = free_port()
        # An application-ACK channel with no server holds senders for 30 s:
        # only the second signal can end the process quickly.
        daemon = Daemon(tmp_path, toml_config(
            tmp_path / "data", [{"name": "adt", "listen": f"127.0.0.1:{port}"},
                                {"name": "app", "listen": f"127.0.0.1:{(app_port := free_port())}",
                                 "ack": "application"}],
            server_url=f"ws://127.0.0.1:{free_port()}/agent",
        )).start().wait_started()
        acked: list[str] = []
        stop = threading.Event()

        def sender() -> None:
            try:
                with MllpClient(port) as client:
                    n = 0
                    while not stop.is_set():
                        cid = f"L{n}"
                        if ack_code(client.exchange(hl7_message(cid), timeout=10)) == "AA":
                            acked.append(cid)
                        n += 1
            except (OSError, ConnectionError, TimeoutError):
                pass

        thread = threading.Thread(target=sender)
        holder = MllpClient(app_port)
        try:
            thread.start()
            holder.send(hl7_message("WAITING"))
            wait_for(lambda: len(acked) >= 20, 20, what="load")
            daemon.signal(signal.SIGTERM)
            daemon.wait_event("shutdown_requested", timeout=10)
            started = time.monotonic()
            daemon.signal(signal.SIGTERM)
            assert daemon.wait_exit(20) == 0
            assert time.monotonic() - started < 5, "the second signal did not force a fast exit"
        finally:
            stop.set()
            thread.join(20)
            holder.close()
            daemon.stop()
        stored = {r[0] for r in db_rows(tmp_path / "data" / "queue.db",
                                        "SELECT control_id FROM messages WHERE state = 'queued'")}
        assert set(acked) <= stored
        assert "WAITING" in stored

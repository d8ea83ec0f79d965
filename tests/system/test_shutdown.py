"""Graceful and forced stops of the daemon (SPEC 7 shutdown order)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
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


def _dev_server(port: int) -> subprocess.Popen[bytes]:
    """``hl7-agent dev-server`` in a process of its own, so that SIGSTOP freezes it (and only it)."""
    return subprocess.Popen(
        [sys.executable, "-m", "agent", "dev-server", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("HL7_AGENT_")},
             "HL7_AGENT_DEV_TOKEN": "test-token"})


def _stop_frozen(server: subprocess.Popen[bytes]) -> None:
    os.kill(server.pid, signal.SIGCONT)
    server.terminate()
    server.wait(10)


class TestFrozenUpstream:
    def test_a_frozen_server_is_seen_down_soon_after_its_missed_pong(self, tmp_path: Path) -> None:
        """A server that stops answering (SIGSTOP) keeps its TCP connection up; the keepalive ping
        finds it. The session must then end within moments, not after a 10 s closing handshake,
        or the status page says "connected" about a dead server that long."""
        server_port, port = free_port(), free_port()
        server = _dev_server(server_port)
        config = toml_config(tmp_path / "data", [{"name": "adt", "listen": f"127.0.0.1:{port}"}],
                             server_url=f"ws://127.0.0.1:{server_port}/agent")
        daemon = Daemon(tmp_path, config.replace("response_timeout = 5", "response_timeout = 5\nping_interval = 1"))
        try:
            daemon.start().wait_started()
            daemon.wait_event("upstream_connected", timeout=20)
            os.kill(server.pid, signal.SIGSTOP)
            frozen = time.monotonic()
            daemon.wait_event("upstream_disconnected", timeout=30)
            took = time.monotonic() - frozen
            # A ping within 1 s, its pong due 1 s later, then the 2 s closing handshake (and slack).
            assert took < 7, f"the frozen server was seen down after {took:.1f}s"
        finally:
            daemon.stop()
            _stop_frozen(server)

    def test_a_frozen_server_cannot_hold_the_stop_past_its_budget(self, tmp_path: Path) -> None:
        """The server is stopped (SIGSTOP) with a transmit unanswered, then the daemon gets SIGTERM:
        the closing handshake must not wait for a Close frame that will never come (websockets'
        default is 10 s), so the process exits within shutdown_budget; the row is resent later."""
        server_port, port = free_port(), free_port()
        server = _dev_server(server_port)
        budget = 4
        config = toml_config(tmp_path / "data", [{"name": "adt", "listen": f"127.0.0.1:{port}"}],
                             server_url=f"ws://127.0.0.1:{server_port}/agent")
        config = config.replace("shutdown_budget = 10", f"shutdown_budget = {budget}")
        daemon = Daemon(tmp_path, config)
        try:
            daemon.start().wait_started()
            daemon.wait_event("upstream_connected", timeout=20)
            os.kill(server.pid, signal.SIGSTOP)
            with MllpClient(port) as client:
                assert ack_code(client.exchange(hl7_message("FROZEN"))) == "AA"
            queue_db = tmp_path / "data" / "queue.db"
            wait_for(lambda: db_rows(queue_db, "SELECT state FROM messages") == [("inflight",)], 10,
                     what="the transmit written to the frozen server")
            started = time.monotonic()
            daemon.signal(signal.SIGTERM)
            assert daemon.wait_exit(budget + 15) == 0
            took = time.monotonic() - started
            # The budget, plus the interpreter's exit (a second at most on a loaded CI machine).
            assert took < budget + 1.5, f"stopped after {took:.1f}s with shutdown_budget = {budget}"
            assert db_rows(queue_db, "SELECT state FROM messages") == [("inflight",)]  # resent next time
        finally:
            daemon.stop()
            _stop_frozen(server)

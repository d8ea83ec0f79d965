"""A listening socket that another process switched to blocking mode never stalls the daemon.

O_NONBLOCK is a flag of the open file description, which every process
sharing a listener shares (fcntl(2)): systemd clears it when it passes the
socket to a unit without ``NonBlocking=yes``, and any successor or tool
holding the socket can do the same. Here the test takes the daemon's
listener exactly as a successor does (the handover socket) and clears the
flag itself: a real peer process, not a fake.
"""

from __future__ import annotations

import asyncio
import os
import select
import socket
import time
from pathlib import Path

import pytest
from agenttest import (
    Daemon,
    MllpClient,
    ack_code,
    free_port,
    hl7_message,
    http_get,
    toml_config,
    wait_for,
)

from agent.runtime import handover, sockets

pytestmark = pytest.mark.slow


def test_daemon_serves_on_after_a_peer_made_its_listener_blocking(tmp_path: Path) -> None:
    """After a peer clears O_NONBLOCK on the shared listener, the daemon still ACKs every
    connection, answers its admin endpoint, and says that it repaired the flag."""
    port, admin = free_port(), free_port()
    data = tmp_path / "data"
    daemon = Daemon(tmp_path, toml_config(data, [{"name": "adt", "listen": f"127.0.0.1:{port}"}], admin_port=admin))
    daemon.start().wait_started()
    try:
        handed = asyncio.run(handover.receive_handover(data / "handover.sock"))
        assert handed is not None
        peer_copy = handed["adt"]
        os.set_blocking(peer_copy.fileno(), True)  # what systemd does with NonBlocking=no
        assert os.get_blocking(peer_copy.fileno())
        for n in range(3):
            # Before the fix the daemon's loop blocked in accept4() right after taking the
            # first of these connections, so its ACK never came.
            with MllpClient(port, timeout=10) as client:
                ack = client.exchange(hl7_message(f"BLOCKED-{n}"), timeout=10)
            assert ack_code(ack) == "AA", ack
        status, _ = http_get(f"http://127.0.0.1:{admin}/healthz")
        assert status == 200
        daemon.wait_event("listener_blocking_mode_repaired", timeout=5)
        assert not os.get_blocking(peer_copy.fileno()), "the shared flag was put back"
        peer_copy.close()
        assert daemon.stop() == 0, daemon.log_tail()
    finally:
        daemon.kill()


class TestGuardedListener:
    def test_accept_on_a_blocking_listener_returns_at_once(self) -> None:
        """guard_listener's accept() repairs the flag first, so an empty queue raises
        BlockingIOError instead of waiting for the next connection."""
        with socket.create_server(("127.0.0.1", 0)) as plain:
            listener = sockets.guard_listener(plain)
            assert listener is plain and isinstance(listener, sockets.ListeningSocket)
            os.set_blocking(listener.fileno(), True)
            started = time.monotonic()
            with pytest.raises(BlockingIOError):
                listener.accept()
            assert time.monotonic() - started < 1.0
            assert not os.get_blocking(listener.fileno())

    def test_a_blocking_accept_is_bounded(self) -> None:
        """Should the flag be cleared between the check and accept4(), SO_RCVTIMEO still
        ends the wait within ACCEPT_STALL_BOUND_S (Linux applies it to accept, socket(7))."""
        with socket.create_server(("127.0.0.1", 0)) as plain:
            listener = sockets.guard_listener(plain)
            os.set_blocking(listener.fileno(), True)
            started = time.monotonic()
            with pytest.raises(BlockingIOError):
                socket.socket.accept(listener)  # the raw call, as if the check had just passed
            waited = time.monotonic() - started
            assert sockets.ACCEPT_STALL_BOUND_S / 2 <= waited < 1.0, waited

    def test_accepted_connections_are_plain_sockets(self) -> None:
        """Only the listener is guarded; what it accepts is an ordinary socket."""
        with socket.create_server(("127.0.0.1", 0)) as plain:
            listener = sockets.guard_listener(plain)
            with socket.create_connection(listener.getsockname()) as client:
                wait_for(lambda: _readable(listener), 5, what="a queued connection")
                conn, _ = listener.accept()
                with conn:
                    assert type(conn) is socket.socket
                    client.sendall(b"x")
                    assert conn.recv(1) == b"x"


def _readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])

"""sd_notify datagrams as systemd receives them (a real AF_UNIX datagram socket)."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from agent.runtime.sdnotify import Notifier


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket standing in for systemd's notify socket."""
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5.0)
    try:
        yield sock, str(path)
    finally:
        sock.close()


def _lines(sock: socket.socket) -> list[str]:
    return sock.recv(4096).decode("utf-8").splitlines()


class TestFromEnviron:
    def test_no_notify_socket_is_a_noop(self) -> None:
        """Without NOTIFY_SOCKET the notifier is disabled and its calls do nothing."""
        n = Notifier.from_environ({})
        assert not n.enabled
        n.ready("up")
        n.status("x")
        n.watchdog()
        n.stopping()
        assert n.watchdog_interval() is None

    def test_relative_socket_path_is_ignored(self) -> None:
        """A NOTIFY_SOCKET that is neither absolute nor abstract disables notification."""
        with capture_logs() as logs:
            n = Notifier.from_environ({"NOTIFY_SOCKET": "relative/sock"})
        assert not n.enabled
        assert logs[0]["event"] == "notify_socket_unsupported"

    def test_watchdog_interval_is_half_the_timeout(self) -> None:
        """WATCHDOG_USEC=30s gives a 15 s ping period."""
        n = Notifier.from_environ({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "30000000"})
        assert n.watchdog_interval() == 15.0

    def test_watchdog_for_another_pid_is_ignored(self) -> None:
        """A WATCHDOG_PID that is not ours means the watchdog is not for this process."""
        env = {"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}
        assert Notifier.from_environ(env).watchdog_interval() is None

    def test_watchdog_for_our_pid_is_used(self) -> None:
        """A WATCHDOG_PID equal to ours enables the watchdog."""
        env = {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}
        assert Notifier.from_environ(env).watchdog_interval() == 1.0

    def test_bad_watchdog_usec_is_ignored(self) -> None:
        """A non-numeric or zero WATCHDOG_USEC disables the watchdog."""
        assert Notifier.from_environ({"WATCHDOG_USEC": "soon"}).watchdog_interval() is None
        assert Notifier.from_environ({"WATCHDOG_USEC": "0"}).watchdog_interval() is None


class TestDatagrams:
    def test_ready_sends_ready_mainpid_and_status(
        self, receiver: tuple[socket.socket, str]
    ) -> None:
        """ready() sends READY=1, MAINPID and a one-line STATUS in one datagram."""
        sock, path = receiver
        n = Notifier.from_environ({"NOTIFY_SOCKET": path})
        assert n.enabled
        n.ready("listening on\n2 channels")
        assert _lines(sock) == [
            "READY=1",
            f"MAINPID={os.getpid()}",
            "STATUS=listening on 2 channels",
        ]
        n.close()

    def test_status_watchdog_stopping(self, receiver: tuple[socket.socket, str]) -> None:
        """status(), watchdog() and stopping() each send their key."""
        sock, path = receiver
        n = Notifier.from_environ({"NOTIFY_SOCKET": path})
        n.status("draining")
        assert _lines(sock) == ["STATUS=draining"]
        n.watchdog()
        assert _lines(sock) == ["WATCHDOG=1"]
        n.stopping()
        assert _lines(sock) == ["STOPPING=1"]
        n.close()

    def test_abstract_namespace_socket(self) -> None:
        """A NOTIFY_SOCKET starting with '@' addresses the abstract namespace."""
        name = f"hl7-agent-test-{uuid.uuid4().hex}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind("\0" + name)
        sock.settimeout(5.0)
        try:
            n = Notifier.from_environ({"NOTIFY_SOCKET": "@" + name})
            n.watchdog()
            assert _lines(sock) == ["WATCHDOG=1"]
            n.close()
        finally:
            sock.close()

    def test_send_failure_never_raises_and_logs_once(self, tmp_path: Path) -> None:
        """A notify socket that is gone is logged once and never raises."""
        n = Notifier.from_environ({"NOTIFY_SOCKET": str(tmp_path / "missing.sock")})
        with capture_logs() as logs:
            n.ready()
            n.watchdog()
            n.status("still fine")
        assert [e["event"] for e in logs] == ["sd_notify_failed"]
        n.close()


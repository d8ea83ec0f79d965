"""sd_notify datagrams as systemd receives them (a real AF_UNIX datagram socket)."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from agent.runtime.sdnotify import Notifier, watchdog_pinger


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
        """status(), watchdog(), stopping(), reloading() and extend_timeout() each send their key."""
        sock, path = receiver
        n = Notifier.from_environ({"NOTIFY_SOCKET": path})
        n.status("draining")
        assert _lines(sock) == ["STATUS=draining"]
        n.watchdog()
        assert _lines(sock) == ["WATCHDOG=1"]
        n.stopping()
        assert _lines(sock) == ["STOPPING=1"]
        n.reloading()
        assert _lines(sock) == ["RELOADING=1"]
        n.extend_timeout(5_000_000)
        assert _lines(sock) == ["EXTEND_TIMEOUT_USEC=5000000"]
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


class TestWatchdogPinger:
    def test_returns_at_once_without_watchdog(self) -> None:
        """Without WATCHDOG_USEC the pinger task ends immediately."""
        asyncio.run(asyncio.wait_for(watchdog_pinger(Notifier.from_environ({})), 5.0))

    def test_pings_from_the_event_loop(self, receiver: tuple[socket.socket, str]) -> None:
        """The pinger sends WATCHDOG=1 repeatedly while the loop runs."""
        sock, path = receiver
        sock.setblocking(False)
        n = Notifier.from_environ({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "20000"})

        async def scenario() -> int:
            loop = asyncio.get_running_loop()
            task = asyncio.create_task(watchdog_pinger(n))
            got = 0
            async with asyncio.timeout(5.0):
                while got < 3:
                    data = await loop.sock_recv(sock, 4096)
                    assert data == b"WATCHDOG=1\n"
                    got += 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return got

        assert asyncio.run(scenario()) == 3
        n.close()

    def test_unhealthy_skips_pings(self, receiver: tuple[socket.socket, str]) -> None:
        """While healthy() is False no WATCHDOG=1 is sent, so systemd would restart us."""
        sock, path = receiver
        sock.setblocking(False)
        n = Notifier.from_environ({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "20000"})
        calls = 0

        def healthy() -> bool:
            nonlocal calls
            calls += 1
            return calls > 3

        async def scenario() -> None:
            loop = asyncio.get_running_loop()
            task = asyncio.create_task(watchdog_pinger(n, healthy))
            async with asyncio.timeout(5.0):
                data = await loop.sock_recv(sock, 4096)
            assert data == b"WATCHDOG=1\n"
            assert calls == 4
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(scenario())
        n.close()

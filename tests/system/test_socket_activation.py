"""The daemon under real systemd socket activation, with a test NOTIFY_SOCKET (SPEC 7, issue: run it like production)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from agenttest import MllpClient, ack_code, free_port, hl7_message, toml_config, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("systemd-socket-activate") is None,
                       reason="systemd-socket-activate is not installed (Debian package systemd)"),
]


class NotifyListener:
    """A datagram socket standing in for systemd's NOTIFY_SOCKET."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.messages: list[str] = []

    def drain(self) -> list[str]:
        while True:
            try:
                data = self.sock.recv(4096)
            except BlockingIOError:
                return self.messages
            self.messages.append(data.decode())

    def lines(self) -> list[str]:
        return [line for msg in self.drain() for line in msg.splitlines()]

    def close(self) -> None:
        self.sock.close()


def test_daemon_serves_inherited_sockets_and_notifies_systemd(tmp_path: Path) -> None:
    """Two channels arrive as named fds; READY=1, STATUS= and WATCHDOG=1 reach NOTIFY_SOCKET; SIGTERM stops cleanly."""
    ports = {"adt": free_port(), "lab": free_port()}
    # The config names other ports on purpose: the inherited sockets must win.
    config = tmp_path / "agent.toml"
    config.write_text(toml_config(
        tmp_path / "data",
        [{"name": "adt", "listen": f"127.0.0.1:{free_port()}"},
         {"name": "lab", "listen": f"127.0.0.1:{free_port()}"}],
    ))
    notify = NotifyListener(tmp_path / "notify.sock")
    log_path = tmp_path / "daemon.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HL7_AGENT_", "LISTEN_", "NOTIFY_", "WATCHDOG_"))}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            ["systemd-socket-activate",
             "-l", f"127.0.0.1:{ports['adt']}", "-l", f"127.0.0.1:{ports['lab']}",
             "--fdname=adt:lab",
             "-E", f"NOTIFY_SOCKET={notify.path}", "-E", "WATCHDOG_USEC=1000000",
             sys.executable, "-m", "agent", "run", "--config", str(config)],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
    try:
        # systemd-socket-activate starts the daemon on the first connection;
        # that connection waits in the inherited accept queue until it is served.
        wait_for(lambda: _listening(ports["adt"]), 10, what="systemd-socket-activate listening")
        for name, port in ports.items():
            with MllpClient(port, timeout=20) as client:
                ack = client.exchange(hl7_message(f"{name}-1"), timeout=20)
                assert ack_code(ack) == "AA", ack
        wait_for(lambda: "READY=1" in notify.lines(), 10, what="READY=1")
        lines = notify.lines()
        assert any(line.startswith("STATUS=") for line in lines), lines
        assert f"MAINPID={proc.pid}" in lines
        # WATCHDOG_USEC=1 s: pings come at least every half second from the event loop.
        seen = lines.count("WATCHDOG=1")
        wait_for(lambda: notify.lines().count("WATCHDOG=1") >= seen + 2, 5, what="WATCHDOG=1 pings")
        log_text = log_path.read_text()
        assert "listeners_inherited_from_systemd" in log_text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, log_path.read_text()[-3000:]
        assert "STOPPING=1" in notify.lines()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        notify.close()


def _listening(port: int) -> bool:
    # A bare connect would start the daemon early; that is fine, and it is
    # also the only portable way to ask. Close at once: nothing is sent.
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False

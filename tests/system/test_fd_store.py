"""Listeners the daemon binds itself outlive a crash in systemd's file descriptor store.

The test plays systemd's part with the same protocol (sd_notify(3),
sd_listen_fds(3)): its datagram socket is the daemon's NOTIFY_SOCKET, it keeps
the fds the daemon sends with ``FDSTORE=1``, and it hands them to the next
process at fds 3.. with LISTEN_FDS / LISTEN_FDNAMES / LISTEN_PID, as systemd
does on a restart. tests/deploy/test_systemd_service.py does the same under a
real systemd.
"""

from __future__ import annotations

import array
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from agenttest import MllpClient, ack_code, free_port, hl7_message, toml_config, wait_for

pytestmark = pytest.mark.slow


class FakeServiceManager:
    """NOTIFY_SOCKET: collects every datagram, and the fds stored with FDSTORE=1 by name."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.lines: list[str] = []
        self.stored: dict[str, socket.socket] = {}

    def drain(self) -> list[str]:
        while True:
            try:
                data, ancdata, _flags, _addr = self.sock.recvmsg(4096, socket.CMSG_SPACE(16 * 4))
            except BlockingIOError:
                return self.lines
            fds = array.array("i")
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
            lines = data.decode().splitlines()
            self.lines += lines
            fields = dict(line.split("=", 1) for line in lines if "=" in line)
            if fields.get("FDSTORE") == "1":
                assert len(fds) == 1, lines
                self.stored[fields["FDNAME"]] = socket.socket(fileno=fds[0])
            else:
                for fd in fds:
                    os.close(fd)
            if fields.get("FDSTOREREMOVE") == "1":
                self.stored.pop(fields["FDNAME"]).close()

    def close(self) -> None:
        for sock in self.stored.values():
            sock.close()
        self.sock.close()


def start_daemon(tmp: Path, config: Path, notify: Path, fds: dict[str, socket.socket] | None = None,
                 log_name: str = "agent.log") -> subprocess.Popen[bytes]:
    """The daemon with NOTIFY_SOCKET; ``fds`` passed at 3.. as systemd passes stored ones."""
    fds = fds or {}
    # Out of the 3.. range first, so the wrapper can place them there.
    high = [fcntl.fcntl(s.fileno(), fcntl.F_DUPFD_CLOEXEC, 20) for s in fds.values()]
    names = ":".join(fds)
    moves = "; ".join(f"os.dup2({fd}, {3 + i})" for i, fd in enumerate(high))
    moves += "".join(f"; os.close({fd})" for fd in high)
    wrapper = (
        "import os, sys\n"
        f"{moves}\n"
        + (f"os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='{len(high)}', LISTEN_FDNAMES='{names}')\n"
           if high else "")
        + "os.execv(sys.executable, [sys.executable, '-m', 'agent', 'run', '--config', sys.argv[1]])\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HL7_AGENT_", "LISTEN_", "WATCHDOG_"))}
    env["NOTIFY_SOCKET"] = str(notify)
    with (tmp / log_name).open("ab") as log:
        proc = subprocess.Popen([sys.executable, "-c", wrapper, str(config)], pass_fds=high,
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp)
    for fd in high:
        os.close(fd)
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_bound_listeners_are_stored_and_come_back_after_a_crash(tmp_path: Path) -> None:
    """The daemon stores each listener it bound (FDSTORE=1, FDNAME=<channel>.stored). After a
    SIGKILL a connection waits in the stored socket instead of being refused; the next process
    serves it, and a stored listener whose channel moved is dropped (FDSTOREREMOVE=1) and the
    new address bound."""
    adt, lab, lab_moved = free_port(), free_port(), free_port()
    data = tmp_path / "data"
    config = tmp_path / "agent.toml"
    config.write_text(toml_config(data, [{"name": "adt", "listen": f"127.0.0.1:{adt}"},
                                         {"name": "lab", "listen": f"127.0.0.1:{lab}"}]))
    manager = FakeServiceManager(tmp_path / "notify.sock")
    first = start_daemon(tmp_path, config, manager.path)
    second: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: "READY=1" in manager.drain(), 20, what="READY=1")
        assert set(manager.stored) == {"adt.stored", "lab.stored"}, manager.lines
        assert manager.stored["adt.stored"].getsockname()[1] == adt
        assert manager.stored["lab.stored"].getsockname()[1] == lab
        assert manager.stored["adt.stored"].getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)

        first.kill()
        first.wait(10)
        # No process runs, but the stored listener still queues the connection.
        waiting = MllpClient(adt, timeout=30)
        waiting.send(hl7_message("STORED-1"))

        config.write_text(toml_config(data, [{"name": "adt", "listen": f"127.0.0.1:{adt}"},
                                             {"name": "lab", "listen": f"127.0.0.1:{lab_moved}"}]))
        before = time.monotonic()
        second = start_daemon(tmp_path, config, manager.path, dict(manager.stored), "second.log")
        with waiting:
            assert ack_code(waiting.read_ack(timeout=30)) == "AA"
        assert time.monotonic() - before < 30
        wait_for(lambda: "FDSTOREREMOVE=1" in manager.drain(), 20, what="FDSTOREREMOVE=1 for the moved channel")
        manager.drain()
        assert "lab.stored" in manager.stored, "the newly bound lab listener is stored again"
        assert manager.stored["lab.stored"].getsockname()[1] == lab_moved
        with MllpClient(lab_moved, timeout=10) as client:
            assert ack_code(client.exchange(hl7_message("MOVED-1"))) == "AA"
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", lab), timeout=5):
            pass
        log = (tmp_path / "second.log").read_text()
        assert '"stored_listener_dropped"' in log and '"listeners_stored_with_systemd"' in log, log
        stop(second)
        assert second.returncode == 0, log
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
        manager.close()

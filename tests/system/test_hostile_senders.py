"""Hostile and broken senders against the daemon as a subprocess: bounded memory, no lock-out.

- A garbage flood (megabytes of 5-byte frames without MSH) on one channel
  must not stall a good sender on another: audit rows stop at the limit, the
  rest is counted, memory stays flat.
- A thousand idle connections cost little memory, the channel still admits
  a real sender (the longest-idle connection is evicted), and a slowloris
  sender is closed after ``frame_timeout``.

Memory is read from /proc/PID/status (VmRSS now, VmHWM the peak). The
figures are printed (``pytest -s``) for docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import math
import re
import resource
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.core import mllp
from tests.agenttest import (
    Daemon,
    MllpClient,
    ack_code,
    db_rows,
    free_port,
    hl7_message,
    http_get,
    toml_config,
    wait_for,
)

pytestmark = pytest.mark.slow

NO_DISK_FLOOR = "[queue]\nmin_free_disk_bytes = 0\n"
MiB = 1024 * 1024


def proc_status_kib(pid: int, key: str) -> int:
    """``VmRSS``/``VmHWM`` of a process, in KiB, from /proc/PID/status."""
    text = Path(f"/proc/{pid}/status").read_text()
    match = re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE)
    assert match is not None, text
    return int(match.group(1))


def metric(admin_port: int, name: str, **labels: str) -> float:
    """One sample from the daemon's /metrics (0 when the series does not exist yet)."""
    status, body = http_get(f"http://127.0.0.1:{admin_port}/metrics")
    assert status == 200
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in body.decode().splitlines():
        if line.startswith(f"{name}{{{wanted}}} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def raise_nofile(need: int) -> Callable[[], None]:
    """A preexec_fn for the daemon: enough file descriptors for ``need`` sockets."""

    def preexec() -> None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < need:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))

    return preexec


@contextlib.contextmanager
def more_fds_here(need: int) -> Iterator[None]:
    """Raise this test process's RLIMIT_NOFILE for its client sockets, restored after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is below the {need} descriptors this test needs")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def wait_listening(daemon: Daemon, port: int) -> None:
    def accepting() -> bool:
        if daemon.proc is not None and daemon.proc.poll() is not None:
            raise AssertionError(f"daemon exited with {daemon.proc.returncode}:\n{daemon.log_tail()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
        except OSError:
            return False

    wait_for(accepting, 20, interval=0.05, what=f"port {port} accepting")


class TestGarbageFlood:
    #: 5-byte frames (VT, two bytes, FS CR) without an MSH: the cheapest junk there is.
    FRAME = mllp.encode_frame(b"xx")
    FLOOD_BYTES = 4 * MiB

    def test_a_flood_of_junk_frames_does_not_stall_another_channel(self, tmp_path: Path,
                                                                    daemons: list[Daemon]) -> None:
        """4 MiB of 5-byte frames without MSH on channel A: B's ACKs keep coming, RSS stays flat, audit rows stop at 100 and the metric counts the rest."""
        port_a, port_b, admin = free_port(), free_port(), free_port()
        channels = [{"name": "a", "listen": f"127.0.0.1:{port_a}"},
                    {"name": "b", "listen": f"127.0.0.1:{port_b}"}]
        daemon = Daemon(tmp_path, toml_config(tmp_path / "data", channels, admin_port=admin,
                                              extra=NO_DISK_FLOOR))
        daemons.append(daemon.start())
        daemon.wait_started()
        wait_listening(daemon, port_b)
        db = tmp_path / "data" / "queue.db"
        frames = self.FLOOD_BYTES // len(self.FRAME)

        with MllpClient(port_b) as good:
            for n in range(20):  # warm up: every code path of a good message has run once
                assert ack_code(good.exchange(hl7_message(f"WARM-{n}"))) == "AA"
            rss_before = proc_status_kib(daemon.pid, "VmRSS")

            def handled() -> float:
                return (metric(admin, "hl7_agent_audit_rows_not_stored_total", channel="a")
                        + db_rows(db, "SELECT count(*) FROM messages WHERE channel = 'a'")[0][0])

            sent, done = threading.Event(), threading.Event()
            errors: list[OSError] = []

            def flood() -> None:
                try:
                    with socket.create_connection(("127.0.0.1", port_a), timeout=60) as sock:
                        per_write = 64 * 1024 // len(self.FRAME)
                        left = frames
                        while left:
                            count = min(left, per_write)
                            sock.sendall(self.FRAME * count)
                            left -= count
                        sent.set()
                        done.wait(100)  # open until the daemon has handled every frame
                except OSError as exc:  # reported by the test thread
                    errors.append(exc)

            flooder = threading.Thread(target=flood, name="flood", daemon=True)
            started = time.monotonic()
            flooder.start()
            latencies: list[float] = []
            n = 0
            next_check = started
            try:
                while time.monotonic() - started < 100:
                    t0 = time.monotonic()
                    ack = good.exchange(hl7_message(f"GOOD-{n}"), timeout=60)
                    latencies.append(time.monotonic() - t0)
                    assert ack_code(ack) == "AA"
                    n += 1
                    if time.monotonic() >= next_check:
                        next_check = time.monotonic() + 0.5
                        if sent.is_set() and handled() >= frames:
                            break
                elapsed = time.monotonic() - started
            finally:
                done.set()
                flooder.join(10)
            assert not errors, errors
            assert sent.is_set() and handled() >= frames, "the flood was not handled in time"
        rss_peak = proc_status_kib(daemon.pid, "VmHWM")
        rows = db_rows(db, "SELECT count(*) FROM messages WHERE channel = 'a'")[0][0]
        counted = metric(admin, "hl7_agent_audit_rows_not_stored_total", channel="a")
        worst = max(latencies)
        print(f"\nflood: {frames} frames ({self.FLOOD_BYTES // MiB} MiB) handled in {elapsed:.1f} s; "
              f"B: {len(latencies)} messages, worst ACK {worst * 1000:.0f} ms, "
              f"median {sorted(latencies)[len(latencies) // 2] * 1000:.1f} ms; "
              f"RSS {rss_before / 1024:.1f} MiB before, peak {rss_peak / 1024:.1f} MiB; "
              f"audit rows {rows}, counted {counted:.0f}")
        windows = 1 + math.floor(elapsed / 60)
        assert 100 <= rows <= 100 * windows
        assert rows + counted == frames
        assert worst < 2.0, f"B waited {worst:.1f} s for an ACK"
        assert (rss_peak - rss_before) < 32 * 1024, f"RSS grew by {(rss_peak - rss_before) / 1024:.0f} MiB"
        daemon.wait_event("audit_rows_not_stored", channel="a")  # logged at the latest when A closed
        events = daemon.events()
        assert sum(e.get("event") == "frame_without_msh_dropped" for e in events) == rows
        assert 1 <= sum(e.get("event") == "audit_rows_not_stored" for e in events) <= windows + 1


class TestIdleConnections:
    COUNT = 1000
    FRAME_TIMEOUT = 2.0

    def test_1000_idle_connections_cost_little_and_the_channel_still_admits_and_times_out(
        self, tmp_path: Path, daemons: list[Daemon]
    ) -> None:
        """1,000 connections that send nothing cost < 64 MiB RSS; a real sender still gets in (the longest-idle one is evicted) and gets AA; a slowloris is closed after frame_timeout."""
        port, admin = free_port(), free_port()
        channel = {"name": "adt", "listen": f"127.0.0.1:{port}", "max_connections": self.COUNT,
                   "max_connections_per_source": self.COUNT, "frame_timeout": self.FRAME_TIMEOUT}
        daemon = Daemon(tmp_path, toml_config(tmp_path / "data", [channel], admin_port=admin,
                                              extra=NO_DISK_FLOOR),
                        preexec_fn=raise_nofile(self.COUNT + 256))
        daemons.append(daemon.start())
        daemon.wait_started()
        wait_listening(daemon, port)

        def open_connections() -> float:
            return metric(admin, "hl7_agent_connections_open", channel="adt")

        idle: list[socket.socket] = []
        with more_fds_here(self.COUNT + 256):
            try:
                with MllpClient(port) as warm:
                    for n in range(20):
                        assert ack_code(warm.exchange(hl7_message(f"WARM-{n}"))) == "AA"
                wait_for(lambda: open_connections() == 0, what="warm-up connection closed")
                rss_before = proc_status_kib(daemon.pid, "VmRSS")
                for _ in range(self.COUNT):
                    idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
                wait_for(lambda: open_connections() == self.COUNT, 30, interval=0.2,
                         what=f"{self.COUNT} connections open in the daemon")
                rss_idle = proc_status_kib(daemon.pid, "VmRSS")

                # A real sender: the longest-idle connection (the first) makes room.
                with MllpClient(port) as sender:
                    assert ack_code(sender.exchange(hl7_message("REAL-SENDER"))) == "AA"
                idle[0].settimeout(10)
                assert idle[0].recv(1) == b"", "the longest-idle connection was not closed"
                assert metric(admin, "hl7_agent_connections_evicted_total", channel="adt") == 1
                assert metric(admin, "hl7_agent_connections_refused_total", channel="adt",
                              reason="busy") == 0

                # A slowloris: starts a frame and trickles bytes (it evicts one more idle connection).
                with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:
                    slow.sendall(mllp.START_BLOCK + b"MSH|^~\\&|")
                    started = time.monotonic()
                    closed_after = None
                    while time.monotonic() - started < self.FRAME_TIMEOUT + 10:
                        try:
                            slow.sendall(b"X")
                            slow.settimeout(0.25)
                            if slow.recv(1) == b"":
                                closed_after = time.monotonic() - started
                                break
                        except TimeoutError:
                            continue
                        except OSError:  # reset after the close: also closed
                            closed_after = time.monotonic() - started
                            break
                assert closed_after is not None, "the slowloris was never closed"
                assert self.FRAME_TIMEOUT - 0.2 <= closed_after < self.FRAME_TIMEOUT + 3, closed_after
                daemon.wait_event("connection_frame_timeout", channel="adt")
                rss_peak = proc_status_kib(daemon.pid, "VmHWM")
            finally:
                for sock in idle:
                    sock.close()
        cost = rss_idle - rss_before
        print(f"\n{self.COUNT} idle connections: RSS {rss_before / 1024:.1f} MiB before, "
              f"{rss_idle / 1024:.1f} MiB with them open (+{cost / 1024:.1f} MiB, "
              f"{cost / self.COUNT:.1f} KiB each), peak {rss_peak / 1024:.1f} MiB; "
              f"slowloris closed after {closed_after:.2f} s (frame_timeout {self.FRAME_TIMEOUT:g} s)")
        assert cost < 64 * 1024, f"{self.COUNT} idle connections cost {cost / 1024:.0f} MiB"

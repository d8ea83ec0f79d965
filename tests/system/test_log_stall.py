"""A daemon whose stderr nobody reads keeps answering senders, says what it dropped, and cuts no line.

The log reader is a real pipe that the test does not read — what a stuck
journald stream or a stalled Docker log driver looks like from the daemon —
made 4 KiB with F_SETPIPE_SZ so it fills after a few lines. The daemon runs
as a subprocess with its log queue bound lowered from its default to 200
lines (set before ``main()`` runs, the only change to the real entry point)
so the queue overflows after a few hundred messages instead of thousands.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from agenttest import (
    MllpClient,
    ack_code,
    free_port,
    hl7_message,
    http_get,
    toml_config,
    wait_for,
)
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

#: Each ACK must arrive within this, pipe full or not (a loaded CI machine
#: answers in milliseconds; a blocked loop never answers).
ACK_BOUND = 5.0
QUEUE_LINES = 200
PIPE_BYTES = 4096
#: agent.runtime.logs.EXIT_FLUSH_SECONDS, spelled out so this file also runs against older code.
EXIT_FLUSH_SECONDS = 2.0
ENTRY = (f"import agent.runtime.logs, sys; agent.runtime.logs.QUEUE_LINES = {QUEUE_LINES}; "
         "from agent.app.cli import main; sys.exit(main())")


def status_of(url: str) -> int:
    """The HTTP status, or 0 while nothing listens yet."""
    try:
        return http_get(url)[0]
    except OSError:
        return 0


def dropped_total(admin: int) -> float:
    status, body = http_get(f"http://127.0.0.1:{admin}/metrics")
    assert status == 200
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == "hl7_agent_log_lines_dropped_total":
                return float(sample.value)
    raise AssertionError("hl7_agent_log_lines_dropped_total is not exported")


def entries(raw: bytes) -> list[dict[str, Any]]:
    """The log lines among the complete lines of ``raw``; each must be whole JSON.

    A pipe is a byte stream: a read returns whatever the pipe holds, so bytes
    read while the daemon is still writing usually end inside a line whose rest
    is still in the pipe. That unfinished tail is left for the next look; every
    line ended by a newline is parsed, and a cut one fails the test. Only the
    CLI's own one-line messages (``hl7-agent: ...``) are not JSON.
    """
    text = raw.decode(errors="replace")
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if not line.startswith("hl7-agent: ")]


def whole_stream(raw: bytes) -> list[dict[str, Any]]:
    """A stream read to its end: it must end at a line end (no half line left at exit)."""
    assert raw.endswith(b"\n"), f"the stream ends in half a line: ...{raw[-80:]!r}"
    return entries(raw)


def small_pipe() -> tuple[int, int]:
    """A pipe whose buffer holds PIPE_BYTES: it fills after a dozen log lines."""
    read_fd, write_fd = os.pipe()
    fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    return read_fd, write_fd


def start_daemon(tmp_path: Path, ports: dict[str, int], admin: int, stderr_fd: int) -> subprocess.Popen[bytes]:
    """The daemon with its stderr on ``stderr_fd`` (closed here: the child holds the only copy)."""
    cfg = tmp_path / "agent.toml"
    cfg.write_text(toml_config(
        tmp_path / "data",
        [{"name": name, "listen": f"127.0.0.1:{port}"} for name, port in ports.items()],
        # Debug: a line per message (message_committed), the volume that fills the pipe.
        admin_port=admin, extra="[queue]\nmin_free_disk_bytes = 0\n[logging]\nlevel = \"debug\"\n"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HL7_AGENT_", "JOURNAL_STREAM"))}
    try:
        return subprocess.Popen(
            [sys.executable, "-c", ENTRY, "run", "--config", str(cfg)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr_fd, env=env, cwd=tmp_path,
        )
    finally:
        os.close(stderr_fd)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


class TestStuckLogReader:
    def test_acks_and_healthz_while_nobody_reads_stderr(self, tmp_path: Path) -> None:
        """Pipe full, queue overflowing: two channels still get every ACK in time, /healthz 200; read again, the drop is reported."""
        ports = {"adt": free_port(), "lab": free_port()}
        admin = free_port()
        read_fd, write_fd = small_pipe()
        proc = start_daemon(tmp_path, ports, admin, write_fd)
        received = bytearray()
        reader: threading.Thread | None = None
        clients: dict[str, MllpClient] = {}
        try:
            wait_for(lambda: proc.poll() is None and status_of(f"http://127.0.0.1:{admin}/readyz") == 200,
                     timeout=30, interval=0.1, what="/readyz 200")
            clients = {name: MllpClient(port, timeout=ACK_BOUND) for name, port in ports.items()}
            slowest = 0.0
            sent = 0

            def send_round() -> None:
                nonlocal slowest, sent
                for name, client in clients.items():
                    # Each message twice: the commit and the retransmit's answer from dedupe
                    # (the daemon logs at debug here: message_committed is one line per message).
                    for _copy in range(2):
                        began = time.monotonic()
                        try:
                            ack = client.exchange(hl7_message(f"{name.upper()}-{sent}"))
                        except TimeoutError as exc:
                            raise AssertionError(
                                f"no ACK on {name} within {ACK_BOUND}s after {sent} messages: "
                                "logging blocked the event loop") from exc
                        slowest = max(slowest, time.monotonic() - began)
                        assert ack_code(ack) == "AA"
                sent += 1

            # Fill the pipe, then the daemon's queue, until it starts dropping.
            while True:
                send_round()
                if sent % 20 == 0:
                    assert http_get(f"http://127.0.0.1:{admin}/healthz")[0] == 200
                    if dropped_total(admin) > 0:
                        break
                assert sent < 3000, "the log queue never overflowed"
            # Keep going while it drops: still every ACK, still healthy.
            for _ in range(50):
                send_round()
            assert http_get(f"http://127.0.0.1:{admin}/healthz")[0] == 200
            dropped = dropped_total(admin)
            assert dropped > 0
            print(f"\n{sent * 2} messages, slowest ACK {slowest * 1000:.1f} ms, {dropped:.0f} lines dropped")
            assert slowest < ACK_BOUND

            # Read the pipe again: the backlog comes out, then one line says what was dropped.
            def read() -> None:
                while chunk := os.read(read_fd, 65536):
                    received.extend(chunk)

            reader = threading.Thread(target=read, name="stderr-reader", daemon=True)
            reader.start()
            wait_for(lambda: any(e.get("event") == "log_lines_dropped" for e in entries(bytes(received))),
                     timeout=20, what="the log_lines_dropped line")
            notices = [e for e in entries(bytes(received)) if e.get("event") == "log_lines_dropped"]
            assert notices[0]["level"] == "warning" and notices[0]["lines"] > 0
            # At debug level the /metrics request above logged a line too, while the pipe was full.
            dropped = dropped_total(admin)
            # The stream works again: a new message's line arrives, nothing more dropped.
            assert ack_code(clients["adt"].exchange(hl7_message("AFTER-GAP"))) == "AA"
            assert ack_code(clients["adt"].exchange(hl7_message("AFTER-GAP"))) == "AA"  # its info line
            wait_for(lambda: any(e.get("control_id") == "AFTER-GAP" for e in entries(bytes(received))),
                     timeout=20, what="the line of a message sent after the gap")
            assert dropped_total(admin) == dropped
            for client in clients.values():
                client.close()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
            reader.join(10)
            final = whole_stream(bytes(received))
            assert sum(e["lines"] for e in final if e.get("event") == "log_lines_dropped") == dropped
            assert final[-1]["event"] == "agent_stopped", "queued lines are written out at exit"
        finally:
            for client in clients.values():
                client.close()
            stop(proc)
            if reader is None:
                os.close(read_fd)
            else:
                reader.join(10)
                os.close(read_fd)

    def test_sigterm_exits_in_time_while_nobody_reads_stderr(self, tmp_path: Path) -> None:
        """With the pipe full, SIGTERM still ends the daemon (exit 0) within its budget plus the bounded log flush."""
        port, admin = free_port(), free_port()
        read_fd, write_fd = small_pipe()
        proc = start_daemon(tmp_path, {"adt": port}, admin, write_fd)
        try:
            wait_for(lambda: proc.poll() is None and status_of(f"http://127.0.0.1:{admin}/readyz") == 200,
                     timeout=30, interval=0.1, what="/readyz 200")
            with MllpClient(port, timeout=ACK_BOUND) as client:
                i = 0
                while dropped_total(admin) == 0:
                    assert ack_code(client.exchange(hl7_message(f"FILL-{i}"))) == "AA"
                    # again: answered from dedupe, an info line (message_committed is debug)
                    assert ack_code(client.exchange(hl7_message(f"FILL-{i}"))) == "AA"
                    i += 1
                    assert i < 3000, "the log queue never overflowed"
            began = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            # shutdown_budget is 10 s in toml_config; the exit flush waits at most 2 s more.
            try:
                code = proc.wait(10 + EXIT_FLUSH_SECONDS + 5)
            except subprocess.TimeoutExpired as exc:
                raise AssertionError("SIGTERM did not end a daemon whose stderr is stuck") from exc
            assert code == 0
            print(f"\nexit {time.monotonic() - began:.2f}s after SIGTERM with a stuck log reader")
            # What the stuck reader finds once it reads again: whole lines, none cut by the exit.
            left = bytearray()
            while chunk := os.read(read_fd, 65536):
                left.extend(chunk)
            assert whole_stream(bytes(left)), "the lines written before the pipe filled"
        finally:
            stop(proc)
            os.close(read_fd)


class TestStartupError:
    def test_error_line_comes_last_after_the_log_lines(self, tmp_path: Path) -> None:
        """A start-up failure's one-line error is printed after the queued log lines, agent_stopped included."""
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            read_fd, write_fd = os.pipe()
            proc = start_daemon(tmp_path, {"adt": port}, free_port(), write_fd)
            with os.fdopen(read_fd, "rb") as stderr:
                output = stderr.read()
            assert proc.wait(30) == 1
        text = output.decode(errors="replace").splitlines()
        assert text[-1].startswith("hl7-agent: channels.adt.listen: cannot listen on"), text[-5:]
        events = [e["event"] for e in whole_stream(output)]
        assert events[-1] == "agent_stopped", events

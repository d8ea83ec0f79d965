"""Durable intake with the daemon as a subprocess: storage failure, SIGTERM mid-stream, kill -9 (SPEC 4, 6, 7).

The promise under test: an accept ACK (AA) is sent only for a committed row,
so every control id that got AA is in the database after the process is gone
— however it went. The database is always checked with a fresh sqlite3
connection after the daemon exited, as an operator would.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.core import mllp
from tests.agenttest import (
    Daemon,
    MllpClient,
    ack_code,
    db_rows,
    err3,
    free_port,
    hl7_message,
    msa2,
    toml_config,
    wait_for,
)

pytestmark = pytest.mark.slow

QUIET = '[logging]\nlevel = "warning"\n'
NO_DISK_FLOOR = "[queue]\nmin_free_disk_bytes = 0\n"


def config(data_dir: Path, port: int, *, extra: str = "") -> str:
    return toml_config(data_dir, [{"name": "adt", "listen": f"127.0.0.1:{port}"}],
                       extra=NO_DISK_FLOOR + extra)


def wait_listening(daemon: Daemon, port: int, timeout: float = 20.0) -> None:
    """Poll until the channel port accepts a connection (works at any log level)."""

    def accepting() -> bool:
        if daemon.proc is not None and daemon.proc.poll() is not None:
            raise AssertionError(f"daemon exited with {daemon.proc.returncode}:\n{daemon.log_tail()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
        except OSError:
            return False

    wait_for(accepting, timeout, interval=0.05, what=f"port {port} accepting")


def queued_ids(db_path: Path) -> dict[str, int]:
    return {cid: seq for cid, seq in db_rows(db_path, "SELECT control_id, seq FROM messages WHERE state = 'queued'")}


def limit_file_size(limit: int) -> Callable[[], None]:
    def preexec() -> None:
        # Python ignores SIGXFSZ, so a write past the limit fails with EFBIG
        # and SQLite reports a disk I/O / disk full error.
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return preexec


class TestStorageFailure:
    def test_storage_failure_is_answered_ar_207_and_never_aa(self, tmp_path: Path, daemons: list[Daemon]) -> None:
        """Under RLIMIT_FSIZE, refused messages get AR with ERR-3 207, every AA'd one is in the database, no AR'd one is queued, and the daemon keeps answering."""
        port = free_port()
        limit = 4608 * 1024  # above the WAL between checkpoints (512 pages, ~2 MiB): hundreds of 2 KB messages fit
        daemon = Daemon(tmp_path, config(tmp_path / "data", port, extra=QUIET),
                        preexec_fn=limit_file_size(limit))
        daemons.append(daemon.start())
        wait_listening(daemon, port)
        padding = "X" * 2000
        accepted: list[str] = []
        refused: list[str] = []
        with MllpClient(port) as client:
            for n in range(2000):
                cid = f"FS-{n:05d}"
                ack = client.exchange(hl7_message(cid, pid=f"{padding}{n}"))
                assert msa2(ack) == cid
                if ack_code(ack) == "AA":
                    # An AA may follow an AR: once a checkpoint has caught up,
                    # SQLite restarts the WAL from its start and writes fit again.
                    accepted.append(cid)
                    continue
                assert (ack_code(ack), err3(ack)) == ("AR", "207"), ack
                refused.append(cid)
                if len(refused) >= 20:
                    break
            assert refused, "the file size limit was never reached"
            assert len(accepted) >= 100, len(accepted)
            # The same connection still gets answers (AR while the disk stays full).
            later = client.exchange(hl7_message("FS-LATER"))
            assert msa2(later) == "FS-LATER"
            assert ack_code(later) in ("AA", "AR")
        with MllpClient(port) as fresh:
            assert msa2(fresh.exchange(hl7_message("FS-NEWCONN"))) == "FS-NEWCONN"
        assert daemon.stop() == 0, daemon.log_tail()
        queued = queued_ids(daemon.dir / "data" / "queue.db")
        missing = [cid for cid in accepted if cid not in queued]
        assert missing == [], f"{len(missing)} AA'd messages are not in the database"
        assert [cid for cid in refused if cid in queued] == []
        assert sorted(queued[cid] for cid in accepted) == list(range(1, len(accepted) + 1))


class Sender(threading.Thread):
    """Sends one message after another on one connection until the agent closes it."""

    def __init__(self, port: int, name: str) -> None:
        super().__init__(name=f"sender-{name}", daemon=True)
        self.port = port
        self.prefix = name
        self.accepted: list[str] = []
        self.other: list[tuple[str, str]] = []
        self.error: BaseException | None = None
        self.stop_flag = threading.Event()

    def run(self) -> None:
        try:
            with MllpClient(self.port, timeout=15) as client:
                n = 0
                while not self.stop_flag.is_set():
                    cid = f"{self.prefix}-{n:05d}"
                    n += 1
                    ack = client.exchange(hl7_message(cid))
                    if ack_code(ack) == "AA" and msa2(ack) == cid:
                        self.accepted.append(cid)
                    else:
                        self.other.append((cid, ack_code(ack)))
        except (ConnectionError, OSError, TimeoutError) as exc:
            self.error = exc  # the agent closed or reset the connection: expected on SIGTERM


class PipeliningSender:
    """Writes frames back to back on one thread and reads ACKs on another, like a bulk interface engine.

    On EOF from the agent it stops writing and closes, as such senders do.
    """

    def __init__(self, port: int, prefix: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.prefix = prefix
        self.acks: list[tuple[str, str]] = []  # (MSA-2, MSA-1) in the order they arrived
        self.eof = threading.Event()
        self.threads = [threading.Thread(target=self._write, daemon=True),
                        threading.Thread(target=self._read, daemon=True)]
        for thread in self.threads:
            thread.start()

    def _write(self) -> None:
        n = 0
        with contextlib.suppress(OSError):
            while not self.eof.is_set():
                self.sock.sendall(mllp.encode_frame(hl7_message(f"{self.prefix}-{n:06d}")))
                n += 1

    def _read(self) -> None:
        decoder = mllp.MllpDecoder(1 << 20)
        with contextlib.suppress(OSError):
            while True:
                data = self.sock.recv(65536)
                if not data:
                    break
                self.acks.extend((msa2(e.payload), ack_code(e.payload))
                                 for e in decoder.feed(data) if isinstance(e, mllp.Frame))
        self.eof.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)

    def join(self) -> None:
        for thread in self.threads:
            thread.join(20)
            assert not thread.is_alive()
        self.sock.close()


class TestShutdown:
    def test_sigterm_mid_stream_exits_0_and_keeps_every_aa(self, tmp_path: Path, daemons: list[Daemon]) -> None:
        """SIGTERM while 4 senders stream: exit 0 within the shutdown budget and every AA'd message is in the database."""
        port = free_port()
        daemon = Daemon(tmp_path, config(tmp_path / "data", port))
        daemons.append(daemon.start())
        daemon.wait_started()
        senders = [Sender(port, f"S{i}") for i in range(4)]
        for sender in senders:
            sender.start()
        wait_for(lambda: all(len(s.accepted) >= 25 for s in senders), 20, what="every sender streaming")
        began = time.monotonic()
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit(20) == 0, daemon.log_tail()
        elapsed = time.monotonic() - began
        for sender in senders:
            sender.stop_flag.set()
            sender.join(20)
            assert not sender.is_alive()
        assert elapsed < 10, f"shutdown took {elapsed:.1f}s, budget is 10s"
        assert [s.other for s in senders] == [[], [], [], []]
        queued = queued_ids(daemon.dir / "data" / "queue.db")
        accepted = [cid for s in senders for cid in s.accepted]
        assert [cid for cid in accepted if cid not in queued] == []
        assert sorted(queued.values()) == list(range(1, len(queued) + 1))

    def test_kill_9_right_after_an_aa_keeps_the_row(self, tmp_path: Path, daemons: list[Daemon]) -> None:
        """kill -9 right after AA: the row is in the database, and a restarted daemon replays the same ACK for a retransmit."""
        port = free_port()
        data_dir = tmp_path / "data"
        first = Daemon(tmp_path, config(data_dir, port), name="first")
        daemons.append(first.start())
        first.wait_started()
        messages = [hl7_message(f"K9-{n}", pid=str(n)) for n in range(5)]
        with MllpClient(port) as client:
            acks = [client.exchange(m) for m in messages]
            first.kill()  # SIGKILL the moment the last AA is read
        assert [ack_code(a) for a in acks] == ["AA"] * 5
        db_path = data_dir / "queue.db"
        assert db_rows(db_path, "SELECT control_id, seq, state, body FROM messages ORDER BY seq") == [
            (f"K9-{n}", n + 1, "queued", messages[n]) for n in range(5)]

        second = Daemon(tmp_path, config(data_dir, port), name="second")
        daemons.append(second.start())
        second.wait_started()
        with MllpClient(port) as client:
            assert client.exchange(messages[-1]) == acks[-1]  # dedupe survived the crash
            fresh = client.exchange(hl7_message("K9-after"))
        assert ack_code(fresh) == "AA"
        assert second.stop() == 0
        assert db_rows(db_path, "SELECT control_id, seq FROM messages WHERE state = 'queued' ORDER BY seq") == [
            *[(f"K9-{n}", n + 1) for n in range(5)], ("K9-after", 6)]

    def test_sigterm_with_pipelining_senders_closes_at_a_frame_boundary(self, tmp_path: Path,
                                                                         daemons: list[Daemon]) -> None:
        """Senders that never pause between frames are closed after the frame in progress: quick exit 0, in-order ACKs, every AA stored."""
        port = free_port()
        daemon = Daemon(tmp_path, config(tmp_path / "data", port))
        daemons.append(daemon.start())
        daemon.wait_started()
        senders = [PipeliningSender(port, f"P{i}") for i in range(4)]
        wait_for(lambda: all(len(s.acks) >= 100 for s in senders), 20, what="every sender streaming")
        began = time.monotonic()
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit(20) == 0, daemon.log_tail()
        elapsed = time.monotonic() - began
        for sender in senders:
            sender.join()
        # Budget 10 s: connections still open at two thirds of it are aborted; none may be.
        assert not daemon.has_event("connections_aborted_at_budget")
        assert elapsed < 5, f"shutdown took {elapsed:.1f}s"
        queued = queued_ids(daemon.dir / "data" / "queue.db")
        for sender in senders:
            assert sender.acks == [(f"{sender.prefix}-{n:06d}", "AA") for n in range(len(sender.acks))]
            assert [cid for cid, _ in sender.acks if cid not in queued] == []

    def test_a_sender_stalled_mid_frame_does_not_hold_the_exit(self, tmp_path: Path, daemons: list[Daemon]) -> None:
        """A connection stuck halfway through a frame is cut at the shutdown budget; the daemon still exits 0 in time."""
        port = free_port()
        daemon = Daemon(tmp_path, config(tmp_path / "data", port), env={"HL7_AGENT_AGENT__SHUTDOWN_BUDGET": "3"})
        daemons.append(daemon.start())
        daemon.wait_started()
        with MllpClient(port) as client:
            assert ack_code(client.exchange(hl7_message("STALL-0"))) == "AA"
            client.send_raw(mllp.encode_frame(hl7_message("STALL-1"))[:40])  # half a frame, then nothing
            # The AA came after the commit; message_committed is a debug line now.
            wait_for(lambda: list(queued_ids(daemon.dir / "data" / "queue.db")) == ["STALL-0"], what="first commit")
            began = time.monotonic()
            daemon.signal(signal.SIGTERM)
            assert daemon.wait_exit(10) == 0, daemon.log_tail()
            elapsed = time.monotonic() - began
        assert elapsed < 3.5, f"shutdown took {elapsed:.1f}s with a 3 s budget"
        assert daemon.has_event("connections_aborted_at_budget")
        assert list(queued_ids(daemon.dir / "data" / "queue.db")) == ["STALL-0"]


class TestBrokenLogStream:
    def test_intake_survives_a_dead_log_reader(self, tmp_path: Path) -> None:
        """When the process reading the daemon's stderr dies (EPIPE), messages are still committed and AA'd, and SIGTERM still exits 0."""
        port = free_port()
        cfg = tmp_path / "agent.toml"
        cfg.write_text(config(tmp_path / "data", port))
        env = {k: v for k, v in os.environ.items() if not k.startswith("HL7_AGENT_")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "agent", "run", "--config", str(cfg)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
        )
        try:
            assert proc.stdout is not None
            seen = b""
            deadline = time.monotonic() + 20
            while b"agent_started" not in seen:
                chunk = os.read(proc.stdout.fileno(), 65536)
                assert chunk and time.monotonic() < deadline, seen.decode(errors="replace")
                seen += chunk
            proc.stdout.close()  # like `hl7-agent run 2>&1 | logger` whose logger died
            with MllpClient(port, timeout=5) as client:
                ack = client.exchange(hl7_message("EPIPE-1"))
            assert (ack_code(ack), msa2(ack)) == ("AA", "EPIPE-1")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(15) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)

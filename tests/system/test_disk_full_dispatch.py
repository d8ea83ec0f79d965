"""A full disk never stops the daemon: intake answers AR, dispatch backs off and goes on (SPEC 4, 6)."""

from __future__ import annotations

import resource
import socket
import sqlite3
from pathlib import Path

import pytest
from agenttest import (
    Daemon,
    DevServerThread,
    MllpClient,
    ack_code,
    free_port,
    hl7_message,
    toml_config,
    wait_for,
)

pytestmark = pytest.mark.slow

FILE_SIZE_LIMIT = 3 * 1024 * 1024


def _limit_file_size() -> None:
    # Python ignores SIGXFSZ: a write past the limit fails with EFBIG, a real
    # I/O error for SQLite. Only the soft limit is set, so the test can lift it
    # from outside (prlimit) without privileges: the disk "is freed".
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, resource.RLIM_INFINITY))


def _accepting(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _hold_a_read_snapshot(db_path: Path) -> sqlite3.Connection:
    """An operator's open read transaction: no checkpoint can restart the WAL while it lasts.

    Without it a checkpoint may reset the WAL at any moment and give the writes
    room again, and whether the dispatcher ever meets the full disk is luck.
    """
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=10, isolation_level=None)
    conn.execute("BEGIN")
    conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    return conn


def test_dispatcher_survives_a_full_disk(tmp_path: Path) -> None:
    """With the database unable to grow, the dispatcher's failing writes are logged and retried; the
    process stays up, and once the disk has room every message it accepted is delivered."""
    dev = DevServerThread().start()
    port = free_port()
    data = tmp_path / "data"
    daemon = Daemon(
        tmp_path,
        toml_config(data, [{"name": "adt", "listen": f"127.0.0.1:{port}"}], server_url=dev.url,
                    extra='[queue]\nmin_free_disk_bytes = 0\n[logging]\nlevel = "warning"\n'),
        preexec_fn=_limit_file_size,
    )
    reader = None
    try:
        daemon.start()
        # Logging stays at warning (the log file counts against the same file size
        # limit), so wait for the port rather than for agent_started.
        wait_for(lambda: _accepting(port), 20, what="the channel port")
        reader = _hold_a_read_snapshot(data / "queue.db")
        accepted: list[str] = []
        with MllpClient(port, timeout=15) as client:
            refused = 0
            for n in range(3000):
                control_id = f"DF-{n:05d}"
                code = ack_code(client.exchange(hl7_message(control_id, pid="X" * 2000)))
                assert code in ("AA", "AR"), code
                if code == "AA":
                    accepted.append(control_id)
                refused += code == "AR"
                if refused >= 10:
                    break
        assert refused >= 10, "the file size limit was never reached"
        assert accepted, "nothing was accepted before the disk filled"
        # The dispatcher's writes fail too: its tenure ends (the lease cannot be
        # renewed, or marking a delivery failed), and the next acquire fails.
        # Neither may take the process down.
        wait_for(lambda: daemon.has_event("lease_lost") or daemon.has_event("dispatch_tenure_failed"), 30,
                 what="the dispatch tenure ended by the full disk")
        wait_for(lambda: any(daemon.has_event(e) for e in ("lease_acquire_failed", "task_crashed")), 30,
                 what="the next lease acquire on the full disk")
        assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log_tail()
        assert not daemon.has_event("task_crashed"), daemon.log_tail()

        # The disk is freed: the reader goes and the limit is lifted. Every
        # message the agent answered AA reaches the server; nothing is lost.
        reader.close()
        reader = None
        resource.prlimit(daemon.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        wanted = set(accepted)
        wait_for(lambda: wanted <= {t.control_id for t in list(dev.server.received)}, 60,
                 what="every accepted message delivered after the disk was freed")
        assert daemon.proc.poll() is None, daemon.log_tail()
        assert daemon.stop() == 0, daemon.log_tail()
    finally:
        if reader is not None:
            reader.close()
        daemon.kill()
        dev.stop()

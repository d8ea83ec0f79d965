"""A full disk never stops the daemon: intake answers AR, dispatch backs off and goes on (SPEC 4, 6)."""

from __future__ import annotations

import resource
import socket
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

def _limit_file_size(limit: int) -> None:
    # Python ignores SIGXFSZ: a write past the limit fails with EFBIG, a real I/O error for SQLite.
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def _accepting(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def test_dispatcher_survives_a_full_disk(tmp_path: Path) -> None:
    """With the database unable to grow, the dispatcher's failing writes are logged and retried; the process stays up and stops cleanly."""
    dev = DevServerThread().start()
    port = free_port()
    daemon = Daemon(
        tmp_path,
        toml_config(tmp_path / "data", [{"name": "adt", "listen": f"127.0.0.1:{port}"}], server_url=dev.url,
                    extra='[queue]\nmin_free_disk_bytes = 0\n[logging]\nlevel = "warning"\n'),
        preexec_fn=lambda: _limit_file_size(3 * 1024 * 1024),
    )
    try:
        daemon.start()
        # Logging stays at warning (the log file counts against the same file size
        # limit), so wait for the port rather than for agent_started.
        wait_for(lambda: _accepting(port), 20, what="the channel port")
        with MllpClient(port, timeout=15) as client:
            refused = 0
            for n in range(3000):
                code = ack_code(client.exchange(hl7_message(f"DF-{n:05d}", pid="X" * 2000)))
                assert code in ("AA", "AR"), code
                refused += code == "AR"
                if refused >= 10:
                    break
        assert refused >= 10, "the file size limit was never reached"
        # The lease cannot be renewed on a full disk: the tenure ends, and the
        # next acquire fails too. Neither may take the process down.
        wait_for(lambda: daemon.has_event("lease_lost"), 30, what="the lease lost to the full disk")
        wait_for(lambda: any(daemon.has_event(e) for e in ("lease_acquire_failed", "task_crashed")), 30,
                 what="the next lease acquire on the full disk")
        assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log_tail()
        assert not daemon.has_event("task_crashed"), daemon.log_tail()
        assert daemon.stop() == 0, daemon.log_tail()
    finally:
        daemon.kill()
        dev.stop()

"""The admin endpoint and maintenance of a running daemon: metrics move, readiness follows the database."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from agenttest import (
    Daemon,
    DevServerThread,
    MllpClient,
    ack_code,
    db_rows,
    free_port,
    hl7_message,
    http_get,
    toml_config,
    wait_for,
)
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _health(config: Path, env: dict[str, str] | None = None) -> int:
    return subprocess.run(
        [sys.executable, "-m", "agent", "health", "--config", str(config)],
        capture_output=True, timeout=30, env=env, check=False,
    ).returncode


class TestAdminOfARunningDaemon:
    def test_metrics_move_and_readiness_follows_the_database(self, tmp_path: Path) -> None:
        """/metrics parses and its counters follow real traffic; /readyz is 503 while the database cannot be written."""
        admin = free_port()
        port = free_port()
        daemon = Daemon(tmp_path, toml_config(tmp_path / "data", [{"name": "adt", "listen": f"127.0.0.1:{port}"}],
                                              admin_port=admin, extra="[queue]\nbusy_timeout = 1\n"))
        base = f"http://127.0.0.1:{admin}"
        try:
            daemon.start().wait_started()
            assert http_get(base + "/healthz")[0] == 200
            assert http_get(base + "/readyz")[0] == 200
            assert _health(daemon.config) == 0
            with MllpClient(port) as client:
                for i in range(3):
                    assert ack_code(client.exchange(hl7_message(f"M{i}"))) == "AA"
            status, body = http_get(base + "/metrics")
            assert status == 200
            samples = _samples(body.decode())
            assert samples[("hl7_agent_messages_committed_total", (("channel", "adt"),))] == 3
            assert samples[("hl7_agent_messages_received_total", (("channel", "adt"),))] == 3
            assert samples[("hl7_agent_queue_depth", (("channel", "adt"), ("state", "queued")))] == 3
            assert samples[("hl7_agent_upstream_connected", ())] == 0

            # Another process holds the write lock: the probe write cannot commit.
            blocker = sqlite3.connect(tmp_path / "data" / "queue.db", timeout=5, isolation_level=None)
            try:
                blocker.execute("BEGIN IMMEDIATE")
                status, body = http_get(base + "/readyz", timeout=10)
                assert status == 503, body
                assert b"database" in body
            finally:
                blocker.execute("ROLLBACK")
                blocker.close()
            wait_for(lambda: http_get(base + "/readyz")[0] == 200, 10, what="ready again")
            page_status, page = http_get(base + "/")
            assert page_status == 200 and b"adt" in page
        finally:
            assert daemon.stop() == 0
        assert _health(daemon.config) == 1

    def test_readiness_ignores_an_unreachable_upstream(self, tmp_path: Path) -> None:
        """/readyz and /healthz stay 200 while the server cannot be reached: intake still keeps every message.

        docs/operations.md tells operators that readiness never looks at the
        upstream (the upgrade script waits on /readyz; an agent cut off from the
        server must still count as ready). The upstream's state is in the metrics.
        """
        admin = free_port()
        port = free_port()
        closed = free_port()  # nothing listens there: every connect is refused
        daemon = Daemon(tmp_path, toml_config(tmp_path / "data", [{"name": "adt", "listen": f"127.0.0.1:{port}"}],
                                              admin_port=admin, server_url=f"ws://127.0.0.1:{closed}/agent"))
        base = f"http://127.0.0.1:{admin}"
        try:
            daemon.start().wait_started()
            wait_for(lambda: daemon.has_event("upstream_connect_failed"), 20, what="a refused upstream connect")
            with MllpClient(port) as client:
                assert ack_code(client.exchange(hl7_message("NOUP-1"))) == "AA"
            assert http_get(base + "/readyz")[0] == 200
            assert http_get(base + "/healthz")[0] == 200
            assert _health(daemon.config) == 0
            samples = _samples(http_get(base + "/metrics")[1].decode())
            assert samples[("hl7_agent_upstream_connected", ())] == 0
            assert samples[("hl7_agent_queue_depth", (("channel", "adt"), ("state", "queued")))] == 1
        finally:
            assert daemon.stop() == 0

    def test_health_exits_1_on_a_broken_config(self, tmp_path: Path) -> None:
        """`hl7-agent health` never exits 2, even when the configuration is invalid (Docker reserves 2)."""
        bad = tmp_path / "bad.toml"
        bad.write_text("[agent]\nnot_a_key = 1\n")
        assert _health(bad) == 1


class TestMaintenance:
    def test_retention_purges_processed_rows_in_a_running_daemon(self, tmp_path: Path) -> None:
        """Processed rows older than retention disappear; the retention sweep runs without any operator."""
        dev = DevServerThread().start()
        port = free_port()
        extra = ("[queue]\ndedupe_window = 1\nretention = 1\nretention_interval = 0.5\n"
                 "checkpoint_interval = 0.5\n")
        daemon = Daemon(tmp_path, toml_config(tmp_path / "data", [{"name": "adt", "listen": f"127.0.0.1:{port}"}],
                                              server_url=dev.url, extra=extra))
        db = tmp_path / "data" / "queue.db"
        try:
            daemon.start().wait_started()
            with MllpClient(port) as client:
                for i in range(5):
                    assert ack_code(client.exchange(hl7_message(f"R{i}"))) == "AA"
            wait_for(lambda: db_rows(db, "SELECT count(*) FROM messages WHERE state = 'processed'")[0][0] == 5,
                     15, what="processed")
            wait_for(lambda: db_rows(db, "SELECT count(*) FROM messages")[0][0] == 0, 15, what="purged")
            wait_for(lambda: db_rows(db, "SELECT count(*) FROM dedupe_keys")[0][0] == 0, 15,
                     what="expired dedupe keys purged")
        finally:
            assert daemon.stop() == 0
            dev.stop()

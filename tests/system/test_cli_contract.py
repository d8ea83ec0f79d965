"""Exit codes and one-line errors of the command line (SPEC 2), as a script sees them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from agenttest import free_port, toml_config

from agent.storage import sqlite as db
from agent.storage.store import LeaseHolder, SqliteStore

pytestmark = pytest.mark.slow


def agent(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HL7_AGENT_")}
    return subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True, text=True,
                          timeout=60, check=False, env=env, cwd=cwd)


class TestExitCodes:
    def test_health_never_exits_2_even_for_a_bad_flag(self) -> None:
        """Docker reserves exit 2: `health` with an unknown flag exits 1."""
        assert agent("health", "--bogus").returncode == 1

    def test_health_with_the_admin_endpoint_disabled_exits_1(self, tmp_path: Path) -> None:
        """``[admin] listen = ""`` leaves nothing to probe: exit 1 with a line that says so, never 0 or 2."""
        config = tmp_path / "agent.toml"
        config.write_text(toml_config(tmp_path / "data", [{"name": "adt", "listen": f"127.0.0.1:{free_port()}"}]))
        result = agent("health", "--config", str(config))
        assert result.returncode == 1
        assert "[admin] listen is disabled" in result.stderr

    @pytest.mark.parametrize("command", ["dev-server", "send"])
    def test_out_of_range_port_is_a_usage_error(self, command: str, tmp_path: Path) -> None:
        """--port 99999 is refused as usage (exit 2) with one line, never a traceback."""
        extra = [str(tmp_path / "none.hl7")] if command == "send" else []
        result = agent(command, "--port", "99999", *extra)
        assert result.returncode == 2
        assert "Traceback" not in result.stderr
        assert "not a port number" in result.stderr.strip().splitlines()[-1]

    def test_port_in_use_is_a_runtime_failure(self, tmp_path: Path) -> None:
        """A channel port another process holds: exit 1 with one line naming the channel; config itself is fine."""
        with socket.create_server(("127.0.0.1", 0)) as taken:
            port = taken.getsockname()[1]
            config = tmp_path / "agent.toml"
            config.write_text(toml_config(tmp_path / "data", [{"name": "adt", "listen": f"127.0.0.1:{port}"}]))
            result = agent("run", "--config", str(config))
        assert result.returncode == 1
        errors = [line for line in result.stderr.splitlines() if line.startswith("hl7-agent:")]
        assert errors and "channels.adt.listen" in errors[-1]
        assert '"exit_code": 0' not in result.stderr


class TestStatsLease:
    def test_lease_of_a_provably_dead_holder_is_null(self, tmp_path: Path) -> None:
        """queue stats --json shows lease null when its holder was killed (same host, PID gone), before the TTL."""
        path = tmp_path / "data" / "queue.db"
        config = tmp_path / "agent.toml"
        config.write_text(toml_config(tmp_path / "data", [{"name": "adt", "listen": f"127.0.0.1:{free_port()}"}]))
        conn = db.open_database(path, "test-agent", db.DatabaseOptions(), time.time())
        store = SqliteStore(conn, db.load_queries(), db_path=path)
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait(10)  # a PID that ran on this host and is gone now
        me = LeaseHolder.for_this_process("test-agent")
        dead = LeaseHolder(holder="test-agent@dead", pid=child.pid, boot_id=me.boot_id, pidns=me.pidns,
                           start_ticks=me.start_ticks)
        with store.transaction():
            assert store.try_acquire_lease(dead, 60) is not None
        conn.close()
        result = agent("queue", "stats", "--json", "--config", str(config))
        assert result.returncode == 0, result.stderr
        assert '"lease": null' in result.stdout

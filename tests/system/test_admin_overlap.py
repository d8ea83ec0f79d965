"""Two daemons on one configuration: the survivor gets the admin address, a long overlap is reported.

A second process started with the same admin address cannot bind it while the
first runs. Once the first is gone it binds it (``health``, metrics and the
page work at the usual address again). Both running longer than an upgrade
takes (``2 x shutdown_budget + 10 s``) is a mistake or a stalled upgrade:
each process logs ``second_instance_running`` with what to do; a prompt stop
of the old one, as in an upgrade, logs no such warning.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from agenttest import (
    Daemon,
    DevServerThread,
    MllpClient,
    ack_code,
    free_port,
    hl7_message,
    http_get,
    toml_config,
    wait_for,
)

pytestmark = pytest.mark.slow

#: shutdown_budget of these daemons: the overlap grace is then 2 x 1 + 10 = 12 s.
BUDGET = 1
GRACE = 2 * BUDGET + 10


def _pair(tmp_path: Path, dev: DevServerThread) -> tuple[Daemon, Daemon, int, int]:
    port, admin_port = free_port(), free_port()
    config = toml_config(tmp_path / "data", [{"name": "adt", "listen": f"127.0.0.1:{port}"}],
                         server_url=dev.url, admin_port=admin_port)
    config = config.replace("shutdown_budget = 10", f"shutdown_budget = {BUDGET}")
    return Daemon(tmp_path, config, name="old"), Daemon(tmp_path, config, name="new"), port, admin_port


def _health(daemon: Daemon) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HL7_AGENT_")}
    return subprocess.run([sys.executable, "-m", "agent", "health", "--config", str(daemon.config)],
                          env=env, capture_output=True, timeout=30, check=False).returncode


class TestAdminAddressSurvivor:
    def test_survivor_binds_the_admin_address_once_free(self, tmp_path: Path) -> None:
        """The second process logs the clash, binds the address within seconds of the first
        exiting, and then answers health and metrics there; a prompt stop warns of nothing."""
        dev = DevServerThread().start()
        old, new, port, admin_port = _pair(tmp_path, dev)
        try:
            old.start().wait_started()
            new.start().wait_started()
            assert new.has_event("admin_unavailable"), new.log_tail()
            assert old.stop() == 0, old.log_tail()
            stopped = time.monotonic()
            new.wait_event("admin_address_acquired", timeout=10)
            assert time.monotonic() - stopped < 5, "bound later than the backoff promises"
            assert _health(new) == 0
            status, body = http_get(f"http://127.0.0.1:{admin_port}/metrics")
            assert status == 200 and b"hl7_agent_connections_open" in body
            with MllpClient(port) as client:
                assert ack_code(client.exchange(hl7_message("SURVIVOR"))) == "AA"
            # Past the grace (and a few checks more) no overlap warning: this was an upgrade.
            # Nothing to wait for but time here: the claim is that nothing is logged.
            deadline = stopped + GRACE + 6
            wait_for(lambda: time.monotonic() > deadline, GRACE + 10, interval=0.5,
                     what="the overlap grace to pass")
            assert not new.has_event("second_instance_running"), new.log_tail()
            assert not old.has_event("second_instance_running"), old.log_tail()
        finally:
            old.stop()
            assert new.stop() == 0, new.log_tail()
            dev.stop()

    def test_two_instances_running_long_are_reported_by_both(self, tmp_path: Path) -> None:
        """Both processes running past the grace each log second_instance_running with the fix."""
        dev = DevServerThread().start()
        old, new, _port, _admin_port = _pair(tmp_path, dev)
        try:
            old.start().wait_started()
            new.start().wait_started()
            new.wait_event("second_instance_running", timeout=GRACE + 15)
            old.wait_event("second_instance_running", timeout=15)
            (newer,) = [e for e in new.events() if e.get("event") == "second_instance_running"]
            (older,) = [e for e in old.events() if e.get("event") == "second_instance_running"]
            assert newer["level"] == older["level"] == "warning"
            assert "admin address" in newer["reason"] or "lease" in newer["reason"], newer
            assert "handed to a newer process" in older["reason"], older
            for event in (newer, older):
                assert "stop the old one" in event["hint"] and "admin.listen" in event["hint"]
                assert event["for_s"] >= GRACE
        finally:
            old.stop()
            new.stop()
            dev.stop()

"""Operator commands against the real daemon (SPEC 2, SPEC 6): the agent runs as
``python -m agent run``, the commands as ``python -m agent queue|channel ...``
subprocesses on the same database while it runs, traffic is real MLLP in and a
real dev server (in process, on its own loop thread) out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agent.app.devserver import Answer, default_answer
from agent.core.protocol import Transmit
from tests.agenttest import (
    Daemon,
    DevServerThread,
    MllpClient,
    ack_code,
    db_rows,
    free_port,
    hl7_message,
    toml_config,
    wait_for,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def cli(config: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """One operator command as its own process, as an operator would run it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HL7_AGENT_")}
    return subprocess.run(
        [sys.executable, "-m", "agent", *argv, "--config", str(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
        cwd=REPO,
    )


def stats(config: Path) -> dict[str, Any]:
    proc = cli(config, "queue", "stats", "--json")
    assert proc.returncode == 0, proc.stderr
    data: dict[str, Any] = json.loads(proc.stdout)
    return data


def send_all(port: int, control_ids: list[str]) -> None:
    """Send each message on one connection; every one must be accepted (AA) after commit."""
    with MllpClient(port) as client:
        for cid in control_ids:
            assert ack_code(client.exchange(hl7_message(cid))) == "AA", cid


def stays_false(predicate: Any, seconds: float) -> bool:
    """Poll ``predicate`` for ``seconds``: proving that something does *not* happen needs a window."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return False
        time.sleep(0.05)
    return True


class TestPauseResume:
    def test_pause_holds_across_restart_and_resume_drains_in_order(self, tmp_path: Path) -> None:
        """A paused channel keeps taking (and ACKing) messages across a daemon restart without
        dispatching them; resume delivers them all, in order, and stats counts them."""
        dev = DevServerThread().start()
        port = free_port()
        data_dir = tmp_path / "data"
        text = toml_config(
            data_dir, [{"name": "adt", "listen": f"127.0.0.1:{port}"}], server_url=dev.url
        )
        daemon = Daemon(tmp_path, text)
        second: Daemon | None = None
        try:
            daemon.start().wait_started()
            # Prove the pipeline works before pausing.
            send_all(port, ["WARM0001"])
            wait_for(lambda: dev.received_ids(), 20, what="first delivery")
            wait_for(lambda: stats(daemon.config)["states"]["processed"] == 1, 20, what="processed")

            proc = cli(daemon.config, "channel", "pause", "adt")
            assert proc.returncode == 0 and "paused" in proc.stdout, proc.stderr
            send_all(port, ["PAUSE001", "PAUSE002", "PAUSE003"])
            assert stays_false(lambda: len(dev.server.received) > 1, 2.5)

            daemon.stop()
            second = Daemon(tmp_path, text, name="agent2").start().wait_started()
            send_all(port, ["PAUSE004", "PAUSE005"])
            wait_for(lambda: stats(second.config)["lease"] is not None, 20, what="lease taken")
            assert stays_false(lambda: len(dev.server.received) > 1, 2.5)
            s = stats(second.config)
            assert s["channels"]["adt"]["paused"] is True
            assert s["channels"]["adt"]["queued"] == 5 and s["states"]["processed"] == 1

            proc = cli(second.config, "channel", "resume", "adt")
            assert proc.returncode == 0 and "resumed" in proc.stdout, proc.stderr
            wait_for(lambda: len(dev.server.received) >= 6, 20, what="drain after resume")
            order = [t.control_id for t in dev.server.received]
            assert order == ["WARM0001", *(f"PAUSE00{i}" for i in range(1, 6))]
            wait_for(
                lambda: stats(second.config)["states"]["processed"] == 6, 20, what="all processed"
            )
            s = stats(second.config)
            assert s["channels"]["adt"]["paused"] is False and s["channels"]["adt"]["queued"] == 0
            db_count = db_rows(
                data_dir / "queue.db", "SELECT count(*) FROM messages WHERE state = 'processed'"
            )
            assert db_count == [(6,)]
        finally:
            try:
                if second is not None:
                    second.stop()
            finally:
                try:
                    daemon.stop()
                finally:
                    dev.stop()


class TestRetryFailed:
    def test_failed_row_redriven_is_delivered_with_same_id(self, tmp_path: Path) -> None:
        """With max_attempts = 1 a 503 fails the row; `queue retry ID` re-queues it and the next
        attempt reaches the server with the same id, while `queue list/show` report it."""
        failing = threading.Event()
        failing.set()

        async def decide(t: Transmit) -> Answer:
            if t.control_id == "FAIL0001" and failing.is_set():
                return Answer(503)
            return default_answer(t)

        dev = DevServerThread(decide=decide).start()
        port = free_port()
        data_dir = tmp_path / "data"
        channel = {"name": "adt", "listen": f"127.0.0.1:{port}", "max_attempts": 1}
        daemon = Daemon(tmp_path, toml_config(data_dir, [channel], server_url=dev.url))
        try:
            daemon.start().wait_started()
            send_all(port, ["FAIL0001", "OKAY0002"])
            wait_for(
                lambda: stats(daemon.config)["states"]["processed"] == 1,
                20,
                what="second processed",
            )
            s = stats(daemon.config)
            assert s["states"]["failed"] == 1 and s["channels"]["adt"]["failed"] == 1

            proc = cli(daemon.config, "queue", "list", "--state", "failed", "--json")
            assert proc.returncode == 0, proc.stderr
            (row,) = json.loads(proc.stdout)
            assert row["control_id"] == "FAIL0001" and row["attempts"] == 1
            failed_id = row["id"]

            failing.clear()
            proc = cli(daemon.config, "queue", "retry", failed_id)
            assert proc.returncode == 0 and "queued" in proc.stdout, proc.stderr
            wait_for(
                lambda: stats(daemon.config)["states"]["processed"] == 2,
                20,
                what="re-driven delivery",
            )

            attempts = [t.attempt for t in dev.server.received if t.id == failed_id]
            assert attempts == [1, 2]
            proc = cli(daemon.config, "queue", "show", failed_id, "--json")
            shown = json.loads(proc.stdout)
            assert shown["state"] == "processed" and shown["id"] == failed_id
            assert (
                shown["redrive_base"] == 1
                and shown["attempts"] == 2
                and shown["server_status"] == 200
            )
            # Retrying it again is refused: it is processed now.
            assert cli(daemon.config, "queue", "retry", failed_id).returncode == 1
        finally:
            try:
                daemon.stop()
            finally:
                dev.stop()

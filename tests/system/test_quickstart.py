"""The README quick start, as commands: dev-server, run with the example config, send, queue stats."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from agenttest import REPO_ROOT, free_port, wait_for

pytestmark = pytest.mark.slow

EXAMPLE = REPO_ROOT / "config" / "agent.example.toml"
SAMPLE = REPO_ROOT / "tests" / "data" / "adt_a01_v23_cr.hl7"


def _agent(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent", *args], env=env, capture_output=True, text=True,
                          timeout=60, check=False)


def test_readme_quick_start_delivers_end_to_end(tmp_path: Path) -> None:
    """dev-server + run with config/agent.example.toml + send: the message is ACKed AA and processed upstream."""
    server_port, adt_port, lab_port, admin_port = (free_port() for _ in range(4))
    base = {k: v for k, v in os.environ.items() if not k.startswith("HL7_AGENT_")}
    # Only what must differ on a shared test machine: free ports and a temp data dir.
    # The token stays the example's "change-me", which the dev server is given as in the README.
    env = {
        **base,
        "HL7_AGENT_SERVER__URL": f"ws://127.0.0.1:{server_port}/agent",
        "HL7_AGENT_ADMIN__LISTEN": f"127.0.0.1:{admin_port}",
        "HL7_AGENT_AGENT__DATA_DIR": str(tmp_path / "data"),
        "HL7_AGENT_QUEUE__MIN_FREE_DISK_BYTES": "0",
        "HL7_AGENT_CHANNELS": json.dumps([
            {"name": "adt", "listen": f"127.0.0.1:{adt_port}"},
            {"name": "lab", "listen": f"127.0.0.1:{lab_port}", "encoding": "8859/1"},
        ]),
    }
    received = tmp_path / "received.jsonl"
    with (tmp_path / "dev.log").open("wb") as dev_log, (tmp_path / "agent.log").open("wb") as agent_log:
        dev = subprocess.Popen(
            [sys.executable, "-m", "agent", "dev-server", "--port", str(server_port), "--store", str(received)],
            env={**base, "HL7_AGENT_DEV_TOKEN": "change-me"}, stdout=dev_log, stderr=subprocess.STDOUT,
        )
        agent = subprocess.Popen(
            [sys.executable, "-m", "agent", "run", "--config", str(EXAMPLE)],
            env=env, stdout=agent_log, stderr=subprocess.STDOUT, cwd=tmp_path,
        )
    try:
        wait_for(lambda: _agent("health", "--config", str(EXAMPLE), env=env).returncode == 0, 20,
                 what="the agent's /healthz")
        sent = _agent("send", "--port", str(adt_port), str(SAMPLE), env=base)
        assert sent.returncode == 0, sent.stderr
        assert "MSA|AA|MSG00001" in sent.stdout

        def processed() -> bool:
            result = _agent("queue", "stats", "--json", "--config", str(EXAMPLE), env=env)
            return result.returncode == 0 and json.loads(result.stdout)["states"]["processed"] == 1

        wait_for(processed, 20, what="the message processed upstream")
        wait_for(lambda: received.exists() and received.read_text().strip(), 10, what="the dev server's store")
        line = json.loads(received.read_text().splitlines()[0])
        assert line["control_id"] == "MSG00001"
        assert line["channel"] == "adt"
    finally:
        for proc in (agent, dev):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        assert agent.wait(30) == 0, (tmp_path / "agent.log").read_text()[-3000:]
        assert dev.wait(30) == 0

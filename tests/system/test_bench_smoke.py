"""Every bench in bench/ runs in its smoke mode, and the load generator keeps its promises.

The smoke runs prove the benches work (real daemon, real servers, real
load generator, a few hundred messages); they assert no timing. The load
generator tests check what the figures rest on: serial send, per-code ACK
counts, and a reconnect that resends the unACKed message with the same MSH-10.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agenttest import REPO_ROOT

from agent.core import mllp

pytestmark = pytest.mark.slow

BENCH = REPO_ROOT / "bench"
sys.path.insert(0, str(BENCH))

import e2e  # noqa: E402 - bench/ is not a package
import harness  # noqa: E402


def run_bench(script: str, tmp_path: Path, *args: str, timeout: float = 100) -> dict[str, Any]:
    """Run ``bench/<script> --smoke --json``; SIGTERM on timeout so it stops what it started."""
    out = tmp_path / f"{script}.json"
    proc = subprocess.Popen([sys.executable, str(BENCH / script), "--smoke", "--json", str(out), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
        pytest.fail(f"{script} --smoke did not finish in {timeout}s:\n{output[-3000:]}")
    assert proc.returncode == 0, output[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


class TestBenchSmoke:
    def test_intake_compares_agent_and_baseline_at_16_and_1(self, tmp_path: Path) -> None:
        """bench/intake.py runs A B B A at 16 and 1 connections, every message AA."""
        result = run_bench("intake.py", tmp_path)
        assert [s["connections"] for s in result["summary"]] == [16, 1]
        kinds = [r["kind"] for r in result["runs"]]
        assert kinds == ["baseline", "agent", "agent", "baseline"] * 2
        for run in result["runs"]:
            assert run["ack_codes"] == {"AA": run["sent"]} and run["errors"] == 0
        for s in result["summary"]:
            assert s["ratio"] > 0 and "target_met" in s
        assert all(rate > 0 for rate in result["fsync_per_s"])

    def test_wal_frames_counts_pages_per_commit(self, tmp_path: Path) -> None:
        """bench/wal_frames.py counts the WAL frames of intake and dispatch commits through the store."""
        result = run_bench("wal_frames.py", tmp_path, "--ids", "uuid4")
        assert result["rows_before"] == 2000 and result["ids"] == "uuid4"
        # at least the row, its id index entry and the channel's seq: never below a few pages
        assert 3 < result["intake_1"] < result["intake_16"]
        assert result["dispatch_per_message"] > 3

    def test_intake_ab_compares_two_trees(self, tmp_path: Path) -> None:
        """bench/intake_ab.py runs the old and the new daemon A B B A and prints CPU per message."""
        proc = subprocess.run([sys.executable, str(BENCH / "intake_ab.py"), "--smoke", "--old", str(REPO_ROOT),
                               "--connections", "2"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "new/old:" in proc.stdout and "CPU per message" in proc.stdout

    def test_intake_core_measures_the_loop_s_cpu_per_message(self, tmp_path: Path) -> None:
        """bench/intake_core.py drives the connection shell and core; it checks every message was ACKed."""
        proc = subprocess.run([sys.executable, str(BENCH / "intake_core.py"), "--smoke"],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "CPU per message best" in proc.stdout

    def test_dispatch_cycle_measures_the_writer_per_delivered_message(self, tmp_path: Path) -> None:
        """bench/dispatch_cycle.py drains a real queue file through the writer; it checks every row settled."""
        out = tmp_path / "cycle.json"
        proc = subprocess.run([sys.executable, str(BENCH / "dispatch_cycle.py"), "--smoke", "--json", str(out)],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "µs CPU per delivered message" in proc.stdout
        (run,) = json.loads(out.read_text())["runs"]
        # Four strict channels drained together: one settle of each per commit, never more.
        assert 3.0 <= run["msgs_per_commit"] <= 4.0 and run["statements_per_msg"] > 0

    def test_e2e_checks_every_message_delivered_once_in_order(self, tmp_path: Path) -> None:
        """bench/e2e.py delivers through a local upstream server and verifies the delivery."""
        result = run_bench("e2e.py", tmp_path)
        check = result["check"]
        assert check["ok"] and check["acked"] == 300 and check["delivered_distinct"] == 300
        assert check["missing"] == 0 and check["resends"] == 0
        assert result["cpu_share"]["upstream"] >= 0 and len(result["baseline"]) == 2

    def test_intake_runs_postgresql_beside_sqlite(self, tmp_path: Path) -> None:
        """--backend sqlite postgresql: one daemon per backend at once, A B C C B A, every message AA."""
        result = run_bench("intake.py", tmp_path, "--backend", "sqlite", "postgresql", "--connections", "4",
                           timeout=180)
        kinds = [r["kind"] for r in result["runs"]]
        assert kinds == ["baseline", "agent-sqlite", "agent-postgresql", "agent-postgresql", "agent-sqlite",
                         "baseline"]
        for run in result["runs"]:
            assert run["ack_codes"] == {"AA": run["sent"]} and run["errors"] == 0
        (summary,) = result["summary"]
        assert summary["ratio_sqlite"] > 0 and summary["ratio_postgresql"] > 0

    def test_e2e_delivers_on_both_backends_in_one_run(self, tmp_path: Path) -> None:
        """--backend sqlite postgresql: each backend's daemon delivers everything once, in order."""
        result = run_bench("e2e.py", tmp_path, "--backend", "sqlite", "postgresql", timeout=240)
        assert set(result["backends"]) == {"sqlite", "postgresql"}
        for backend in result["backends"].values():
            check = backend["check"]
            assert check["ok"] and check["acked"] == 300 and check["delivered_distinct"] == 300
            assert check["missing"] == 0 and check["resends"] == 0

    def test_e2e_max_in_flight_fails_clearly_without_the_key(self, tmp_path: Path) -> None:
        """--max-in-flight is passed to the config; an agent without the key is refused with its error."""
        code, _ = harness.check_config(harness.agent_config(
            tmp_path / "data", [{"name": "a", "listen": "127.0.0.1:1", "max_in_flight": 4,
                                 "partition_key": "PID-3.1"}], admin_port=2), tmp_path)
        proc = subprocess.run([sys.executable, str(BENCH / "e2e.py"), "--smoke", "--max-in-flight", "4"],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False)
        if code == 0:
            assert proc.returncode == 0, proc.stderr[-2000:]
        else:
            assert proc.returncode == 2
            assert "max_in_flight" in proc.stderr and "config error" in proc.stderr

    def test_backlog_restarts_and_drains(self, tmp_path: Path) -> None:
        """bench/backlog.py fills 1,000 rows through intake, restarts the daemon and drains it all."""
        result = run_bench("backlog.py", tmp_path)
        large = result["large"]
        assert large["rows"] == 1000 and large["drained"] == 1000
        assert large["readyz_s"] > 0 and large["rss_mib"] > 0
        assert large["claim_us"]["claims"] == 200

    def test_idle_measures_rss_with_connections_open(self, tmp_path: Path) -> None:
        """bench/idle.py opens its connections and reads the daemon's RSS at each step."""
        result = run_bench("idle.py", tmp_path)
        assert result["connections"] == 50
        assert result["rss_idle"] > 0 and result["rss_after_one_message"] > 0

    def test_threads_splits_the_cpu_per_message_by_thread(self, tmp_path: Path) -> None:
        """bench/threads.py gives each connection count's CPU per message, loop and writer apart."""
        result = run_bench("threads.py", tmp_path)
        assert [r["connections"] for r in result["runs"]] == [16, 1]
        for run in result["runs"]:
            cpu = run["cpu_us_per_msg"]
            assert run["messages"] > 0 and cpu["loop"]["us"] > 0 and cpu["writer"]["us"] > 0
            assert cpu["total"]["us"] == pytest.approx(cpu["loop"]["us"] + cpu["writer"]["us"] + cpu["rest"]["us"])

    def test_commit_floor_times_frames_and_fdatasync(self, tmp_path: Path) -> None:
        """bench/commit_floor.py times N frame writes + fdatasync for each N, and leaves no file behind."""
        result = run_bench("commit_floor.py", tmp_path, "--frames", "1", "12", "--workdir", str(tmp_path / "wd"))
        assert [r["frames"] for r in result["rows"]] == [1, 12]
        assert all(0 < r["median_us"] <= r["p90_us"] for r in result["rows"])
        assert list((tmp_path / "wd").iterdir()) == []


class ScriptedMllpServer:
    """An MLLP server on a thread: drops the first connection at message ``drop_at``, answers AE at ``ae_at``."""

    def __init__(self, drop_at: int, ae_at: int) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.drop_at, self.ae_at = drop_at, ae_at
        self.received: list[str] = []
        self.connections = 0
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._session, args=(conn, self.connections == 1), daemon=True).start()

    def _session(self, conn: socket.socket, first: bool) -> None:
        with conn:
            self._exchange(conn, first)

    def _exchange(self, conn: socket.socket, first: bool) -> None:
        decoder = mllp.MllpDecoder(1 << 20)
        while True:
            data = conn.recv(65536)
            if not data:
                return
            for event in decoder.feed(data):
                if not isinstance(event, mllp.Frame):
                    continue
                cid = event.payload.split(b"\r")[0].split(b"|")[9].decode()
                with self.lock:
                    self.received.append(cid)
                    n = len(self.received) - 1
                if first and n == self.drop_at:
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return  # closed without an ACK (RST)
                code = "AE" if n == self.ae_at else "AA"
                ack = f"MSH|^~\\&|B|B|A|A|20260101||ACK|{n}|P|2.5.1\rMSA|{code}|{cid}\r".encode()
                conn.sendall(mllp.encode_frame(ack))

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(); close() alone does not
        self.sock.close()
        self.thread.join(5)
        assert not self.thread.is_alive()


@pytest.fixture
def scripted() -> Iterator[ScriptedMllpServer]:
    server = ScriptedMllpServer(drop_at=2, ae_at=4)
    yield server
    server.close()


class TestLoadgen:
    def test_reconnect_resends_the_unacked_message_with_the_same_control_id(
            self, scripted: ScriptedMllpServer) -> None:
        """--reconnect: after a dropped connection the same MSH-10 is sent again, then the rest."""
        report = harness.run_loadgen([scripted.port], 1, count=6, prefix="t", reconnect=True, timeout=10)
        ids = [f"t.0.{n}" for n in range(6)]
        assert scripted.received == [*ids[:3], ids[2], *ids[3:]]
        assert report["acked"] == 6 and report["reconnects"] == 1 and report["errors"] == 1
        assert report["ack_codes"] == {"AA": 5, "AE": 1} and report["ack_mismatched"] == 0
        assert report["per_connection"] == [{"port": scripted.port, "sent_ids": 6, "acked": 6, "unacked": 0}]

    def test_without_reconnect_a_dropped_connection_ends_it(self, scripted: ScriptedMllpServer) -> None:
        """No --reconnect: the error is counted and the message stays unACKed."""
        report = harness.run_loadgen([scripted.port], 1, count=6, prefix="t", timeout=10)
        assert scripted.received == ["t.0.0", "t.0.1", "t.0.2"]
        assert report["acked"] == 2 and report["unacked"] == 1 and report["errors"] == 1
        assert report["reconnects"] == 0

    def test_template_gets_a_unique_msh10_per_message(self, tmp_path: Path) -> None:
        """A template file (LF line ends) is sent with segment ends \\r and MSH-10 replaced."""
        template = tmp_path / "t.hl7"
        template.write_text("MSH|^~\\&|A|B|C|D|20260101||ADT^A08|ORIG|P|2.3\nPID|1||77^^^MRN\n")
        server = ScriptedMllpServer(drop_at=-1, ae_at=-1)
        try:
            report = harness.run_loadgen([server.port], 2, count=10, prefix="x", template=template)
        finally:
            server.close()
        assert report["acked"] == 10 and sorted(set(server.received)) == sorted(server.received)
        assert all(cid.startswith("x.") for cid in server.received)
        assert report["message_bytes"] == len(b"MSH|^~\\&|A|B|C|D|20260101||ADT^A08|x.0.0|P|2.3\rPID|1||77^^^MRN\r")


def _records(*rows: tuple[str, int, int, str, str]) -> list[tuple[float, str, int, int, str, str, str]]:
    return [(float(i), ch, seq, attempt, cid, mid, "") for i, (ch, seq, attempt, cid, mid) in enumerate(rows)]


#: Two senders: connection 0 (port 1, channel ch0) got 2 ACKs, connection 1 (port 2, ch1) one.
REPORT: dict[str, Any] = {"prefix": "e", "per_connection": [{"port": 1, "acked": 2}, {"port": 2, "acked": 1}]}
PORTS = {1: "ch0", 2: "ch1"}


class TestE2eVerify:
    """The delivery check in bench/e2e.py fails on what it is there to catch."""

    def test_in_order_once_is_ok(self) -> None:
        """Each ACKed message once, seq and MSH-10 order kept per channel: ok."""
        records = _records(("ch0", 1, 1, "e.0.0", "a"), ("ch1", 1, 1, "e.1.0", "c"), ("ch0", 2, 1, "e.0.1", "b"))
        assert e2e.verify(records, REPORT, PORTS, False, True)["ok"]

    def test_missing_duplicate_resend_and_disorder_fail(self) -> None:
        """A missing message, a second id for one MSH-10, a resend or a seq out of order each fail."""
        cases = {
            "missing": _records(("ch0", 1, 1, "e.0.0", "a"), ("ch0", 2, 1, "e.0.1", "b")),
            "duplicates": _records(("ch0", 1, 1, "e.0.0", "a"), ("ch0", 2, 1, "e.0.1", "b"),
                                   ("ch1", 1, 1, "e.1.0", "c"), ("ch1", 2, 1, "e.1.0", "d")),
            "resends": _records(("ch0", 1, 1, "e.0.0", "a"), ("ch0", 1, 2, "e.0.0", "a"),
                                ("ch0", 2, 1, "e.0.1", "b"), ("ch1", 1, 1, "e.1.0", "c")),
            "seq_disorder": _records(("ch0", 2, 1, "e.0.1", "b"), ("ch0", 1, 1, "e.0.0", "a"),
                                     ("ch1", 1, 1, "e.1.0", "c")),
            "wrong_channel": _records(("ch0", 1, 1, "e.0.0", "a"), ("ch0", 2, 1, "e.0.1", "b"),
                                      ("ch0", 3, 1, "e.1.0", "c")),
        }
        for key, records in cases.items():
            result = e2e.verify(records, REPORT, PORTS, False, True)
            assert not result["ok"], key
            assert result[key], (key, result)


def test_smoke_runs_use_the_worktree_agent() -> None:
    """The benches start this checkout's daemon, whatever is installed (PYTHONPATH first)."""
    env = harness._clean_env()
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO_ROOT)

"""Intake throughput and ACK latency, against a baseline measured in the same run.

    python bench/intake.py [--messages 2000] [--connections 1 4 16]

The baseline is what durability costs without group commit: one SQLite
transaction per message, WAL + synchronous=FULL, on the same disk. The agent
must beat it once several senders share commits (group commit), while every
ACK still follows its own row's fsync. Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from agenttest import Daemon, MllpClient, ack_code, free_port, hl7_message, toml_config


def baseline_one_commit_per_message(directory: Path, count: int, body: bytes) -> float:
    """Messages per second with one fsync'd transaction each."""
    conn = sqlite3.connect(directory / "baseline.db", isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("CREATE TABLE m (id INTEGER PRIMARY KEY, body BLOB NOT NULL)")
    started = time.perf_counter()
    for _ in range(count):
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO m (body) VALUES (?)", (body,))
        conn.execute("COMMIT")
    elapsed = time.perf_counter() - started
    conn.close()
    return count / elapsed


def run_agent_load(port: int, connections: int, per_connection: int, tag: str) -> tuple[float, list[float]]:
    latencies: list[float] = []
    lock = threading.Lock()
    failures: list[str] = []

    def sender(index: int) -> None:
        local: list[float] = []
        with MllpClient(port, timeout=30) as client:
            for n in range(per_connection):
                message = hl7_message(f"{tag}-{index}-{n}")
                t0 = time.perf_counter()
                ack = client.exchange(message, timeout=30)
                local.append(time.perf_counter() - t0)
                if ack_code(ack) != "AA":
                    failures.append(ack_code(ack))
        with lock:
            latencies.extend(local)

    threads = [threading.Thread(target=sender, args=(i,)) for i in range(connections)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    if failures:
        raise SystemExit(f"non-AA ACKs during the benchmark: {failures[:5]}")
    return connections * per_connection / elapsed, latencies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=2000, help="messages per scenario")
    parser.add_argument("--connections", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()
    body = hl7_message("BASELINE")
    with tempfile.TemporaryDirectory(prefix="hl7-agent-bench-") as tmp:
        tmp_path = Path(tmp)
        base = baseline_one_commit_per_message(tmp_path, min(args.messages, 1000), body)
        print(f"baseline  one fsync'd commit per message (same disk): {base:8.0f} msg/s")
        port = free_port()
        daemon = Daemon(tmp_path, toml_config(tmp_path / "data", [{"name": "adt", "listen": f"127.0.0.1:{port}"}]))
        try:
            daemon.start().wait_started()
            for conns in args.connections:
                per = max(1, args.messages // conns)
                rate, lat = run_agent_load(port, conns, per, f"c{conns}")
                lat.sort()
                p50 = statistics.median(lat) * 1000
                p99 = lat[int(len(lat) * 0.99) - 1] * 1000
                print(f"agent     {conns:3d} connection(s): {rate:8.0f} msg/s  ACK p50 {p50:6.2f} ms  "
                      f"p99 {p99:6.2f} ms  ({rate / base:4.1f}x baseline)")
        finally:
            daemon.stop()
    print(f"(cpu count {os.cpu_count()}, synchronous=FULL, every ACK after its commit)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Serve the admin endpoint with sample data, for screenshots and for a look.

    python scripts/status_page_demo.py [--listen 127.0.0.1:0]

Prints the status page URL as the first line on stdout, then serves until
SIGTERM/SIGINT. The data is invented (no daemon, no database): three channels,
one paused and one lagging, an upstream that is down, and a few failures — a
page with something on it to judge the layout by.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from typing import Any

import structlog

from agent import __version__
from agent.app.health import format_listen
from agent.runtime.admin import AdminServer, RuntimeView
from agent.runtime.metrics import AgentMetrics


def _sample_stats() -> dict[str, Any]:
    return {
        "states": {
            "queued": 57,
            "claimed": 1,
            "inflight": 1,
            "processed": 18342,
            "rejected": 4,
            "failed": 2,
            "nacked": 9,
        },
        "channels": {
            "adt": {
                "queued": 3,
                "claimed": 1,
                "inflight": 1,
                "oldest_queued_age_s": 4.2,
                "paused": False,
            },
            "lab-results": {
                "queued": 54,
                "claimed": 0,
                "inflight": 0,
                "oldest_queued_age_s": 1392.0,
                "paused": True,
            },
            "orders": {
                "queued": 0,
                "claimed": 0,
                "inflight": 0,
                "oldest_queued_age_s": None,
                "paused": False,
            },
        },
        "lease": {
            "holder": "edge-01:pid 4242",
            "epoch": 7,
            "expires_at": "2025-06-02T09:14:31Z",
        },
        "db": {
            "path": "/var/lib/hl7-agent/queue.db",
            "size_bytes": 48_234_496,
            "wal_bytes": 4_120_576,
        },
    }


def _sample_failures(limit: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = [
        {
            "id": "6f1c2a9e-3b7d-4c52-9a0e-0d3c5b1f7e21",
            "channel": "lab-results",
            "control_id": "LAB20250602-0913",
            "message_type": "ORU^R01",
            "state": "rejected",
            "error_code": "422",
            "error_text": "unknown patient identifier in PID-3",
            "attempts": 1,
            "updated_at": "2025-06-02T09:13:58Z",
        },
        {
            "id": "a0d94e4b-1f0e-4f38-8d52-77c3c1e2b90f",
            "channel": "adt",
            "control_id": "<script>alert(1)</script>",
            "message_type": "ADT^A08",
            "state": "failed",
            "error_code": "503",
            "error_text": "max_attempts (10) reached: server unavailable",
            "attempts": 10,
            "updated_at": "2025-06-02T08:41:12Z",
        },
        {
            "id": "c3b1f8e0-52a4-4d6b-b0a9-1e9f4c7d2a63",
            "channel": "adt",
            "control_id": "ADT000918",
            "message_type": "ADT^A01",
            "state": "failed",
            "error_code": None,
            "error_text": "inflight when the connection dropped; server does not replay",
            "attempts": 2,
            "updated_at": "2025-06-02T07:02:45Z",
        },
    ]
    return rows[:limit]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--listen", default="127.0.0.1:0")
    args = parser.parse_args(argv)
    # stdout carries only the URL (the screenshot script reads it); logs to stderr.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))

    view = RuntimeView(
        agent_id="edge-01",
        version=__version__,
        started_at=time.time() - (3 * 86400 + 5 * 3600 + 17 * 60),
        listeners_up=lambda: True,
        db_writable=lambda: (True, ""),
        upstream_state=lambda: {
            "configured": True,
            "connected": False,
            "url": "wss://hl7-hub.example.org/agent",
            "replay": True,
            "last_error": "connect timed out after 10.0 s (attempt 14, next in 60 s)",
        },
        lease_held=lambda: True,
        stats=_sample_stats,
        recent_failures=_sample_failures,
    )
    metrics = AgentMetrics()
    admin = AdminServer(args.listen, view, metrics)
    admin.start()

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"http://{format_listen(*admin.address)}/", flush=True)
    try:
        stop.wait()
    finally:
        admin.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

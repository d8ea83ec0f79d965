"""What the status page and ``/status.json`` show: the facts, gathered from the daemon at each request.

``RuntimeView`` is the seam: callables the daemon provides, each safe from
any thread (the admin server's). ``collect_view_data`` calls them, one
guarded section at a time — the page must still render when the database is
gone, that is exactly when an operator opens it — and adds what they mean:
``assessment`` (agent.core.status: each channel's state in words and colour)
and ``history`` (agent.runtime.history: the last hour per minute).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from agent.core.acks import server_reason
from agent.core.states import DEPTH
from agent.core.status import assess
from agent.core.timefmt import rfc3339
from agent.runtime.history import MinuteHistory

log = structlog.get_logger(__name__)

#: How many failed/rejected rows the status page and /status.json show.
RECENT_FAILURES = 20


@dataclass
class RuntimeView:
    """What the daemon shows the admin endpoint; every callable is thread-safe."""

    agent_id: str
    version: str
    started_at: float
    listeners_up: Callable[[], bool]
    db_writable: Callable[[], tuple[bool, str]]
    upstream_state: Callable[[], dict[str, Any]]
    lease_held: Callable[[], bool]
    stats: Callable[[], dict[str, Any]]
    recent_failures: Callable[[int], list[dict[str, Any]]]
    #: Seconds since the event loop's last heartbeat; None: no loop to watch.
    loop_age: Callable[[], float] | None = None
    #: The store's per-channel activity (head, last in/out, pause) for these channels, as dicts.
    channel_activity: Callable[[list[str]], list[dict[str, Any]]] | None = None
    #: id -> the server's ACK text, for the recent failures' reasons.
    server_acks: Callable[[list[str]], dict[str, str]] | None = None
    #: Live rows in every channel (the depth history's sample).
    live_depth: Callable[[], int] | None = None
    #: The last hour per minute (in, out, depth): thread-safe itself.
    history: MinuteHistory | None = None
    #: Outbound channels (connect): channel -> connect, state, since, last_error.
    outbound: Callable[[], dict[str, dict[str, Any]]] | None = None


def reason_of(exc: BaseException) -> str:
    """A one-line, body-free description of a failed view call."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:200] if text else type(exc).__name__


def collect_view_data(view: RuntimeView, now: float | None = None) -> dict[str, Any]:
    """The `/status.json` document; a failing section is None plus a reason.

    The page must still render when the database is gone — that is exactly
    when an operator opens it.
    """
    now = time.time() if now is None else now
    errors: dict[str, str] = {}

    def guarded(section: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 — shown on the page, never a 500
            log.warning("admin_view_failed", section=section, error=type(exc).__name__)
            errors[section] = reason_of(exc)
            return None

    data: dict[str, Any] = {
        "agent_id": view.agent_id,
        "version": view.version,
        "started_at": rfc3339(view.started_at, millis=False),
        "generated_at": rfc3339(now, millis=False),
        "uptime_s": max(0.0, round(now - view.started_at, 3)),
        "listeners_up": guarded("listeners", view.listeners_up),
        "upstream": guarded("upstream", view.upstream_state),
        "outbound": guarded("outbound", view.outbound) if view.outbound is not None else {},
        "lease_held": guarded("lease_held", view.lease_held),
        "stats": guarded("stats", view.stats),
        "recent_failures": guarded(
            "recent_failures", lambda: view.recent_failures(RECENT_FAILURES)
        ),
    }
    stats = data["stats"] if isinstance(data["stats"], dict) else None
    failures = data["recent_failures"] if isinstance(data["recent_failures"], list) else None
    activity = None
    read_activity = view.channel_activity
    if stats is not None and read_activity is not None:
        names = sorted(stats.get("channels") or {})
        activity = guarded("activity", lambda: read_activity(names))
    if failures:
        _add_server_reasons(view, failures, guarded)
    if stats is not None and view.history is not None:
        channels = (stats.get("channels") or {}).values()
        view.history.note_depth(sum(int(c.get(s) or 0) for c in channels for s in DEPTH))
    data["activity"] = activity
    data["assessment"] = assess(
        stats=stats,
        activity=activity,
        upstream=data["upstream"] if isinstance(data["upstream"], dict) else None,
        lease_held=data["lease_held"],
        listeners_up=data["listeners_up"],
        now=now,
        outbound=data["outbound"] if isinstance(data["outbound"], dict) else None,
    )
    data["history"] = view.history.series() if view.history is not None else None
    data["errors"] = errors
    return data


def _add_server_reasons(
    view: RuntimeView, failures: list[dict[str, Any]], guarded: Callable[[str, Callable[[], Any]], Any]
) -> None:
    """Each failure's ``server_reason``: the row's own when it has one, else read from the server's ACK."""
    missing = [str(f.get("id")) for f in failures if not f.get("server_reason")]
    acks: dict[str, str] = {}
    read_acks = view.server_acks
    if missing and read_acks is not None:
        acks = guarded("server_acks", lambda: read_acks(missing)) or {}
    for f in failures:
        if not f.get("server_reason"):
            f["server_reason"] = server_reason(acks.get(str(f.get("id"))))

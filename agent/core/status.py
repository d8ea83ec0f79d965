"""What the status page and ``/status.json`` say about each channel and the upstream: pure.

The facts come from the database (depth, the head row, the pause flag — the
same for every process on the file) and from this process (the upstream
session, whether it holds the dispatch lease). This module turns them into a
state in words, a level (the colour) and the details an operator acts on; it
decides, the runtime only gathers facts and the page only draws.

A channel is, first match wins:

- ``paused`` — the operator (or ``on_reject = "pause"``) paused it and nothing
  waits; ``blocked`` when rows wait behind the pause;
- ``blocked`` — rows wait and nothing can move them: no upstream configured, no
  process holds the dispatch lease, or a due head that has not moved for
  ``STALL_S`` (its dispatcher is elsewhere or stuck);
- ``upstream down`` — this process holds the lease and has no session: red
  whatever the queue holds;
- ``retrying`` — the head failed at least one attempt since its last re-drive
  and waits for the next (attempt, last error, next try, rows behind it);
- ``flowing`` — rows wait and go; ``idle`` — nothing waits.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from enum import StrEnum
from typing import Any

from agent.core.states import DEPTH, State
from agent.core.timefmt import human_duration, rfc3339

__all__ = ["STALL_S", "ChannelState", "Level", "UpstreamState", "assess"]

#: A due head (not in backoff, not in flight) that has not moved for this long,
#: with nothing delivered meanwhile, is shown as blocked (seconds).
STALL_S = 120.0


class Level(StrEnum):
    """The colour of a state: green, amber, red, or neutral grey."""

    OK = "ok"
    WARN = "warn"
    BAD = "bad"
    MUTE = "mute"


class ChannelState(StrEnum):
    """A channel's state in words (the page's badge and ``/status.json``'s ``state``)."""

    FLOWING = "flowing"
    IDLE = "idle"
    RETRYING = "retrying"
    BLOCKED = "blocked"
    PAUSED = "paused"
    UPSTREAM_DOWN = "upstream down"


class UpstreamState(StrEnum):
    CONNECTED = "connected"
    DOWN = "down"
    STANDBY = "standby"  # another process holds the lease and talks to the server
    NO_LEASE = "no lease holder"
    NOT_CONFIGURED = "not configured"
    UNKNOWN = "unknown"


_LEVEL_OF: dict[ChannelState, Level] = {
    ChannelState.FLOWING: Level.OK,
    ChannelState.IDLE: Level.OK,
    ChannelState.RETRYING: Level.WARN,
    ChannelState.PAUSED: Level.WARN,
    ChannelState.BLOCKED: Level.BAD,
    ChannelState.UPSTREAM_DOWN: Level.BAD,
}
_RANK = {Level.MUTE: 0, Level.OK: 0, Level.WARN: 1, Level.BAD: 2}

#: The dispatcher's own backoff note at the end of a transient error (the page shows the live one).
_RETRY_NOTE = re.compile(r";\s*retry in [0-9.]+\s*s$")


def _epoch(value: Any) -> float | None:  # noqa: ANN401 - a JSON value
    """Unix seconds from a number or an RFC 3339 string; None when neither."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    try:
        return datetime.fromisoformat(str(value)).timestamp()
    except ValueError:
        return None


def _age(now: float, then: float | None) -> float | None:
    return None if then is None else round(max(0.0, now - then), 3)


def _when(ts: float | None) -> str | None:
    return None if ts is None else rfc3339(ts, millis=False)


def _waiting(n: int) -> str:
    return "nothing waiting" if n == 0 else f"{n} waiting"


def _upstream(upstream: Mapping[str, Any] | None, lease_held: bool | None,
              lease: Mapping[str, Any] | None, now: float) -> dict[str, Any]:
    """The upstream as this process sees it: its state, level and one line of words."""
    holder = lease.get("holder") if isinstance(lease, Mapping) else None
    if upstream is None:
        return {"state": UpstreamState.UNKNOWN, "level": Level.WARN, "text": "unknown",
                "since": None, "for_s": None}
    since = _epoch(upstream.get("since"))
    out: dict[str, Any] = {"since": _when(since), "for_s": _age(now, since)}
    if not upstream.get("configured", upstream.get("url") is not None):
        return {**out, "state": UpstreamState.NOT_CONFIGURED, "level": Level.MUTE,
                "text": "not configured: intake only, messages stay queued"}
    if upstream.get("connected"):
        return {**out, "state": UpstreamState.CONNECTED, "level": Level.OK,
                "text": f"connected for {human_duration(out['for_s'])}"}
    if lease_held:
        return {**out, "state": UpstreamState.DOWN, "level": Level.BAD,
                "text": f"down for {human_duration(out['for_s'])}"}
    if holder:
        return {**out, "state": UpstreamState.STANDBY, "level": Level.MUTE,
                "text": f"not connected here: {holder} holds the dispatch lease and talks to the server"}
    return {**out, "state": UpstreamState.NO_LEASE, "level": Level.WARN,
            "text": "not connected: no process holds the dispatch lease"}


def _channel(name: str, counts: Mapping[str, Any], activity: Mapping[str, Any] | None,
             upstream: UpstreamState, now: float) -> dict[str, Any]:
    """One channel's state, level, words and the facts behind them."""
    act: Mapping[str, Any] = activity or {}
    depth_by = {str(s): int(counts.get(s) or 0) for s in DEPTH}
    depth = sum(depth_by.values())
    head: Mapping[str, Any] | None = act.get("head")
    settled: Mapping[str, Any] | None = act.get("last_settled")
    paused = bool(counts.get("paused") or act.get("paused"))
    last_in = _epoch(act.get("last_received_at"))
    last_out = _epoch(settled.get("settled_at")) if settled else None
    paused_at = _epoch(act.get("paused_at"))
    facts: dict[str, Any] = {
        "name": name,
        "depth": depth,
        **depth_by,
        "oldest_queued_age_s": counts.get("oldest_queued_age_s"),
        "waiting_behind": max(0, depth - 1) if head else 0,
        "head_id": head.get("id") if head else None,
        "head_state": head.get("state") if head else None,
        "attempt": None,
        "next_try_in_s": None,
        "last_error": None,
        "blocked_by": None,
        "last_received_at": _when(last_in),
        "last_received_age_s": _age(now, last_in),
        "last_settled_at": _when(last_out),
        "last_settled_age_s": _age(now, last_out),
        "last_settled_state": settled.get("state") if settled else None,
        "paused": paused,
        "paused_at": _when(paused_at),
        "paused_for_s": _age(now, paused_at),
        "paused_reason": act.get("paused_reason"),
    }
    detail: list[str] = _partition_details(counts.get("blocked_partitions") or (), facts)
    retrying = bool(head and head.get("error_code") is not None
                    and int(head.get("attempts") or 0) > int(head.get("redrive_base") or 0))
    if head and retrying:
        facts["attempt"] = int(head.get("attempts") or 0)
        error = str(head.get("error_text") or head.get("error_code") or "")
        facts["last_error"] = _RETRY_NOTE.sub("", error)
        if head.get("state") == State.QUEUED:
            facts["next_try_in_s"] = round(max(0.0, float(head.get("next_attempt_at") or 0) - now), 1)

    def result(state: ChannelState, text: str) -> dict[str, Any]:
        return {**facts, "state": state, "level": _LEVEL_OF[state], "text": text, "detail": detail}

    def blocked(by: str, why: str) -> dict[str, Any]:
        facts["blocked_by"] = by
        return result(ChannelState.BLOCKED, f"blocked: {why} — {_waiting(depth)}")

    if paused:
        who = facts["paused_reason"] or "unknown"
        since = f" for {human_duration(facts['paused_for_s'])}" if paused_at is not None else ""
        detail.append(f"paused by {who}{since}; `hl7-agent channel resume {name}` resumes it")
        if depth:
            return blocked("pause", "channel paused")
        return result(ChannelState.PAUSED, "paused — intake goes on, nothing is sent")
    if upstream == UpstreamState.NOT_CONFIGURED:
        if depth:
            return blocked("no upstream", "no upstream configured ([server] url)")
        return result(ChannelState.IDLE, "idle — intake only")
    if upstream == UpstreamState.DOWN:
        if depth:
            detail.append("kept in the queue: they go out in order once the server answers again")
        return result(ChannelState.UPSTREAM_DOWN, f"upstream down — {_waiting(depth)}")
    if upstream == UpstreamState.NO_LEASE and depth:
        return blocked("no lease", "no process holds the dispatch lease")
    if facts["blocked_partitions"] and depth:
        # A partitioned channel: blocked keys wait, the other keys go on.
        n = facts["blocked_partitions"]
        paused_only = all(b.get("why") == "paused" for b in counts.get("blocked_partitions") or ())
        return result(ChannelState.PAUSED if paused_only else ChannelState.RETRYING,
                      f"{n} partition{'s' if n != 1 else ''} {'paused' if paused_only else 'blocked'}, "
                      f"the others go on — {_waiting(depth)}")
    if head and retrying:
        attempt = facts["attempt"]
        if facts["next_try_in_s"] is not None:
            text = f"retrying — attempt {attempt} failed, next try in {human_duration(facts['next_try_in_s'])}"
        elif head.get("state") == State.INFLIGHT:
            text = f"retrying — attempt {attempt} sent, the one before failed"
        else:
            text = f"retrying — attempt {attempt} failed, the next one is being sent"
        detail.append(f"last error: {facts['last_error']}")
        if facts["waiting_behind"]:
            detail.append(f"{facts['waiting_behind']} waiting behind it (delivery is in order)")
        detail.append(f"`hl7-agent queue show {head.get('id')}`; if the server will never take it, "
                      f"`hl7-agent queue fail {head.get('id')}` sets it aside")
        return result(ChannelState.RETRYING, text)
    if depth:
        oldest = counts.get("oldest_queued_age_s")
        stalled = (head is not None and head.get("state") != State.INFLIGHT
                   and oldest is not None and float(oldest) >= STALL_S
                   and (last_out is None or now - last_out >= STALL_S))
        if stalled:
            if upstream == UpstreamState.STANDBY:
                detail.append("another process dispatches: see its status page or log")
            return blocked("no progress", f"the head has not moved for {human_duration(oldest)}")
        return result(ChannelState.FLOWING, f"flowing — {_waiting(depth)}")
    return result(ChannelState.IDLE, "idle — nothing waiting")


#: Blocked partitions named one by one on the page; the rest are counted.
PARTITIONS_SHOWN = 5


def _partition_details(blocked: Sequence[Mapping[str, Any]], facts: dict[str, Any]) -> list[str]:
    """A partitioned channel's blocked keys, by hash (the value is patient data): the rest go on."""
    facts["blocked_partitions"] = len(blocked)
    lines = []
    for b in blocked[:PARTITIONS_SHOWN]:
        rows = int(b.get("depth") or 0)
        what = (f"retrying (attempt {b.get('attempts')}, next try in "
                f"{human_duration(float(b.get('next_attempt_in_s') or 0))})"
                if b.get("why") == "retrying" else f"paused ({b.get('paused_reason') or 'on_reject'})")
        head = f", head {b.get('head_id')}" if b.get("head_id") else ""
        lines.append(f"partition {b.get('key_hash')} {what}: {rows} row{'s' if rows != 1 else ''} waiting"
                     f"{head}; the other partitions go on")
    if len(blocked) > PARTITIONS_SHOWN:
        lines.append(f"{len(blocked) - PARTITIONS_SHOWN} more partitions blocked: `hl7-agent queue stats`")
    return lines


def _outbound(info: Mapping[str, Any], now: float) -> tuple[str, bool]:
    """An outbound channel's connection to its sender in words, and whether it stands."""
    where = info.get("connect")
    since = _epoch(info.get("since"))
    for_how_long = f" for {human_duration(_age(now, since))}" if since is not None else ""
    state = info.get("state")
    if state == "connected":
        return f"connected to the sender at {where}{for_how_long}", True
    if state == "stopped":
        return f"not dialling {where}: stopping", True
    error = info.get("last_error")
    why = f" (last error: {error})" if error else ""
    return f"reconnecting to the sender at {where}{for_how_long}{why}", False


def _lease(lease: Mapping[str, Any] | None, lease_held: bool | None, stats_ok: bool) -> dict[str, Any]:
    if not stats_ok:
        return {"level": Level.WARN, "text": "unknown", "holder": None}
    if not isinstance(lease, Mapping) or not lease.get("holder"):
        return {"level": Level.WARN, "text": "no holder: nothing is dispatched", "holder": None}
    holder = lease.get("holder")
    epoch = lease.get("epoch")
    if lease_held:
        return {"level": Level.OK, "text": f"held by this process (epoch {epoch})", "holder": holder}
    return {"level": Level.MUTE, "text": f"held by {holder}, another process (epoch {epoch})",
            "holder": holder}


def assess(
    *,
    stats: Mapping[str, Any] | None,
    activity: Sequence[Mapping[str, Any]] | None,
    upstream: Mapping[str, Any] | None,
    lease_held: bool | None,
    listeners_up: bool | None,
    now: float,
    outbound: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The ``assessment`` section of ``/status.json``: overall, upstream, lease, each channel.

    ``stats`` is the ``queue stats --json`` shape, ``activity`` the store's
    per-channel activity as dicts, ``upstream`` the dispatcher's
    ``upstream_state()`` with ``since``. Any of them may be None (it could not
    be read): what depends on it says unknown rather than guess.
    ``outbound``: per outbound channel (``connect``), its connection to the
    sender (state, since, last error); one that is not connected is a warning.
    """
    lease = stats.get("lease") if stats is not None else None
    up = _upstream(upstream, lease_held, lease, now)
    by_name = {str(a.get("channel")): a for a in activity or ()}
    channels_in: Mapping[str, Any] = (stats or {}).get("channels") or {}
    names = sorted(set(channels_in) | set(by_name))
    channels = [_channel(n, channels_in.get(n) or {}, by_name.get(n), up["state"], now) for n in names]
    problems: list[str] = []
    levels = [up["level"], *(c["level"] for c in channels)]
    if listeners_up is False:
        problems.append("intake not listening")
        levels.append(Level.BAD)
    if up["state"] == UpstreamState.DOWN:
        waiting = sum(c["depth"] for c in channels)
        problems.append(f"upstream {up['text']} — {_waiting(waiting)}")
    for c in channels:
        if c["level"] != Level.OK and c["state"] != ChannelState.UPSTREAM_DOWN:
            problems.append(f"{c['name']} {c['state']}")
    for c in channels:
        info = (outbound or {}).get(c["name"])
        if info is None:
            continue
        text, connected = _outbound(info, now)
        c["outbound"] = {**info, "text": text}
        c["detail"].insert(0, text)
        if not connected:
            problems.append(f"{c['name']} {text}")
            levels.append(Level.WARN)
    if stats is None:
        problems.append("queue unreadable")
        levels.append(Level.BAD)
    level = max(levels, key=lambda lv: _RANK[Level(lv)])
    if problems:
        summary = "; ".join(problems)
    elif channels:
        summary = f"all {len(channels)} channel{'s' if len(channels) != 1 else ''} flowing or idle"
    else:
        summary = "no channels"
    return {
        "level": Level.OK if level == Level.MUTE else level,
        "summary": summary,
        "upstream": up,
        "lease": _lease(lease, lease_held, stats is not None),
        "channels": channels,
    }

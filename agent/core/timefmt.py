"""Times and sizes as people and peers read them: one definition of each format.

RFC 3339 (UTC with a ``Z``) is what logs, JSON output and the upstream
protocol use; the human forms are for tables and the status page. Pure.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

__all__ = ["compact_duration", "human_bytes", "human_duration", "rfc3339", "rfc3339_utc"]


def rfc3339(ts: float, *, millis: bool = True) -> str:
    """RFC 3339 UTC with a ``Z``: ``2026-05-01T08:00:00.123Z`` (``millis=False``: whole seconds)."""
    whole = time.gmtime(ts)
    text = time.strftime("%Y-%m-%dT%H:%M:%S", whole)
    if not millis:
        return text + "Z"
    return text + f".{round((ts - int(ts)) * 1000) % 1000:03d}Z"


def rfc3339_utc(moment: datetime) -> str:
    """An aware instant as RFC 3339 UTC with a ``Z``, milliseconds kept (upstream ``received_at``)."""
    if moment.tzinfo is None:
        raise ValueError("naive datetime: received_at must be an aware UTC instant")
    text = moment.astimezone(UTC).isoformat(timespec="milliseconds")
    return text.removesuffix("+00:00") + "Z"


def human_duration(seconds: float | None) -> str:
    """``192`` → ``3m 12s``: the two largest units; ``None`` → ``—`` (status page)."""
    if seconds is None:
        return "—"
    total = max(0, int(seconds))
    days, rem = divmod(total, 86400)
    hours, rem = divmod(rem, 3600)
    minutes, secs = divmod(rem, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {secs}s"
    return f"{secs}s"


def compact_duration(seconds: float | None) -> str:
    """``192`` → ``3m12s``: the same two units without spaces, for narrow tables; ``None`` → ``-``."""
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def human_bytes(size: float | None, *, missing: str = "—") -> str:
    """``4096`` → ``4.0 KiB`` (binary units); ``None`` → ``missing``."""
    if size is None:
        return missing
    value = float(size)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"

"""Two processes on one queue: the admin address taken over once free, a long overlap reported.

During an upgrade two versions run side by side for seconds. A process whose
admin address was taken binds it as soon as the other lets it go, so the
survivor of an overlap is monitored at the usual address (``health``,
metrics, the page). Two processes still running together long after an
upgrade would have finished are a mistake (a manual ``run`` beside the
service, two containers on one volume) or a stalled upgrade: each says so,
with what to do.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog

from agent.errors import AdminListenInUse, ConfigError, StorageError
from agent.runtime.admin import AdminServer

log = structlog.get_logger(__name__)

#: A taken admin address is tried again after these delays (seconds), the last one repeated.
ADMIN_REBIND_DELAYS = (0.2, 0.5, 1.0, 2.0)
#: How often to look for another process on the same queue (seconds), and to report it again.
OVERLAP_CHECK = 2.0
OVERLAP_REPEAT = 900.0

HINT = ("two processes share this queue: intake is split between them, only one dispatches and "
        "only one serves the admin address. In an upgrade, stop the old one now (systemctl stop "
        "hl7-agent@<old colour>, docker stop OLD); otherwise stop the one started by mistake. "
        "Overlapping versions each need their own admin.listen.")


def overlap_grace(shutdown_budget: float) -> float:
    """How long two processes on one queue are still an upgrade: the new one starting, the old stopping."""
    return 2 * shutdown_budget + 10.0


async def rebind_admin(admin: AdminServer, listen: str, on_bound: Callable[[bool], None]) -> None:
    """Try the taken admin address again with a bounded backoff until it is ours.

    ``on_bound(True)`` once bound; ``on_bound(False)`` when the address is no
    longer taken but cannot be bound (it went away): said once, intake goes on.
    """
    started = time.monotonic()
    for attempt in itertools.count():
        await asyncio.sleep(ADMIN_REBIND_DELAYS[min(attempt, len(ADMIN_REBIND_DELAYS) - 1)])
        try:
            admin.start()
        except AdminListenInUse:
            continue
        except ConfigError as exc:
            log.error("admin_unavailable", error=str(exc))
            on_bound(False)
            return
        on_bound(True)
        log.info("admin_address_acquired", listen=listen, waited_s=round(time.monotonic() - started, 1))
        return


async def watch_overlap(other_instance: Callable[[], Awaitable[str | None]], *, grace: float,
                        stopping: asyncio.Event, data_dir: Path) -> None:
    """Log ``second_instance_running`` once another process has run beside this one past ``grace``.

    ``other_instance`` says why another process is known to run on this
    queue now, or None. Checked every ``OVERLAP_CHECK``; reported once past
    the grace, then every ``OVERLAP_REPEAT`` while it lasts; never while
    this process stops (an upgrade's old process).
    """
    since: float | None = None
    warned_at = float("-inf")
    while True:
        await asyncio.sleep(OVERLAP_CHECK)
        if stopping.is_set():
            return
        try:
            why = await other_instance()
        except StorageError:
            continue  # the maintenance task reports storage trouble
        now = time.monotonic()
        if why is None:
            since = None
            continue
        since = now if since is None else since
        lasted = now - since + OVERLAP_CHECK
        if lasted >= grace and now - warned_at >= OVERLAP_REPEAT:
            warned_at = now
            log.warning("second_instance_running", reason=why, for_s=round(lasted),
                        data_dir=str(data_dir), pid=os.getpid(), hint=HINT)

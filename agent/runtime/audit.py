"""The operator's actions in the daemon's log: one ``operator_action`` line per command.

``hl7-agent queue retry|fail|purge`` and ``channel pause|resume`` run as their
own processes, often as another user, so they cannot write to the daemon's
log. Each writes an ``operator_actions`` entry in the transaction of the
change it makes (agent/app/commands/common.py); every daemon polls for new
entries and logs each one. Taking an entry marks it logged in the same
write transaction, so with two daemons on one database (an upgrade overlap)
each entry is logged once, by whichever of them takes it first; an entry
written while no daemon ran is logged at the next start.

What is logged: the action, who ran it (OS user, process id), when, the
channel, the operator's reason, how many rows changed, the row ids (at most
:data:`IDS_LOGGED`) or counts per channel, and the state and age a purge or
a re-drive by state selected. Never a message body.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import structlog

from agent.core.timefmt import rfc3339
from agent.errors import StorageError
from agent.storage.rows import OperatorAction
from agent.storage.store import SqliteStore
from agent.storage.writer import Reader, Writer

__all__ = ["IDS_LOGGED", "POLL_INTERVAL", "STALE_AFTER", "log_fields", "log_operator_actions"]

log = structlog.get_logger(__name__)

#: How often a daemon looks for new entries.
POLL_INTERVAL = 1.0
#: An entry still ``running`` this long after its last batch belongs to a
#: command that died: it is logged as it stands.
STALE_AFTER = 60.0
#: Row ids in one log line; beyond them ``ids_more`` counts the rest (the
#: database keeps them all).
IDS_LOGGED = 50


def log_fields(entry: OperatorAction) -> dict[str, Any]:
    """The ``operator_action`` line's fields for one entry (pure: tests call it directly)."""
    try:
        detail = json.loads(entry.detail)
    except ValueError:
        detail = {}
    if not isinstance(detail, dict):
        detail = {}
    fields: dict[str, Any] = {
        "action": entry.action,
        "user": entry.os_user,
        "command_pid": entry.pid,
        "at": rfc3339(entry.started_at),
        "channel": entry.channel,
        "rows": entry.rows,
        "status": entry.status,
    }
    if entry.reason:
        fields["reason"] = entry.reason
    ids = detail.get("ids")
    if isinstance(ids, list):
        fields["ids"] = ids[:IDS_LOGGED]
        if len(ids) > IDS_LOGGED:
            fields["ids_more"] = len(ids) - IDS_LOGGED
    for key in ("channels", "state", "older_than", "before"):
        if key in detail:
            fields[key] = detail[key]
    return fields


async def log_operator_actions(writer: Writer, reader: Reader, *, interval: float = POLL_INTERVAL,
                               stale_after: float = STALE_AFTER) -> None:
    """Forever: log the entries operator commands wrote, each once (a cheap read when there are none)."""
    while True:
        try:
            stale_before = time.time() - stale_after
            if await reader.call(SqliteStore.operator_actions_due, stale_before):
                for entry in await writer.call(SqliteStore.take_operator_actions, stale_before):
                    log.info("operator_action", **log_fields(entry))
        except StorageError as exc:
            log.warning("operator_actions_unreadable", error=str(exc))
        await asyncio.sleep(interval)

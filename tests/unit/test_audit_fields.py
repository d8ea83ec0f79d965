"""The daemon's ``operator_action`` line for one audit entry (agent/runtime/audit.py)."""

from __future__ import annotations

import json
import os

from agent.runtime.audit import IDS_LOGGED, log_fields
from agent.storage.rows import OperatorAction


def test_log_fields_shape() -> None:
    """The line's fields from one entry: ids capped, detail keys carried, no unknown keys invented."""
    ids = [f"id-{i}" for i in range(IDS_LOGGED + 5)]
    entry = OperatorAction(id=1, action="fail", os_user="jdoe", pid=os.getpid(), channel="adt", reason="bad",
                           rows=len(ids), detail=json.dumps({"ids": ids, "channels": {"adt": len(ids)}}),
                           status="done", started_at=1_750_000_000.0, updated_at=1_750_000_001.0)
    fields = log_fields(entry)
    assert fields["ids"] == ids[:IDS_LOGGED] and fields["ids_more"] == 5
    assert fields["at"] == "2025-06-15T15:06:40.000Z"
    assert set(fields) == {"action", "user", "command_pid", "at", "channel", "rows", "status", "reason",
                           "ids", "ids_more", "channels"}


def test_a_broken_detail_still_logs() -> None:
    """An entry whose detail is not a JSON object is logged with what is known."""
    entry = OperatorAction(id=2, action="pause", os_user="root", pid=1, channel="lab", reason=None, rows=0,
                           detail="not json", status="done", started_at=0.0, updated_at=0.0)
    assert log_fields(entry)["action"] == "pause" and "ids" not in log_fields(entry)

"""The IntakeItem the connection shell builds per message carries every field the store writes."""

from __future__ import annotations

import dataclasses

import pytest

from agent.core.envelope import read_msh
from agent.core.intake_types import NewMessage
from agent.core.partition import parse_partition_key
from agent.runtime import mllp_connection
from agent.storage.store import IntakeItem

BODY = b"MSH|^~\\&|LAB|NORTH|EHR|CENTRAL|20260101120000||ADT^A01^ADT_A01|C1|P|2.5.1|||AL|NE\rPID|1||MRN7^^^H^MR\r"


def message() -> NewMessage:
    return NewMessage(read_msh(BODY), BODY, "utf-8", BODY.decode(), "commit", b"MSH|ack\r", 1700000000.5)


@pytest.mark.parametrize("partition", [None, "PID-3.1"])
def test_intake_item_carries_the_message_s_fields(partition: str | None) -> None:
    key = parse_partition_key(partition) if partition else None
    item = mllp_connection.intake_item("adt", "10.0.0.1:5000", message(), key)
    assert dataclasses.asdict(item) == {
        "channel": "adt", "remote": "10.0.0.1:5000", "sending_app": "LAB", "sending_facility": "NORTH",
        "control_id": "C1", "message_type": "ADT^A01^ADT_A01", "body": BODY, "encoding": "utf-8",
        "ack_mode": "commit", "accept_ack_type": "AL", "application_ack_type": "NE", "commit_ack": b"MSH|ack\r",
        "received_at": 1700000000.5, "partition_key": "MRN7" if partition else None,
    }


def test_intake_item_is_cheap_to_build() -> None:
    """One is built per message on the event loop: slots, and no frozen ``__init__`` (object.__setattr__ per field)."""
    assert hasattr(IntakeItem, "__slots__")
    assert not IntakeItem.__dataclass_params__.frozen  # type: ignore[attr-defined]

"""The IntakeItem the connection shell builds per message is the store's dataclass, field for field."""

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


def test_the_fast_path_applies_to_the_store_s_intake_item() -> None:
    """Built in one step while IntakeItem is a plain frozen dataclass with these fields (else: its __init__)."""
    assert mllp_connection._FAST_ITEM
    assert tuple(f.name for f in dataclasses.fields(IntakeItem)) == mllp_connection._ITEM_FIELDS


@pytest.mark.parametrize("partition", [None, "PID-3.1"])
def test_intake_item_equals_the_dataclass_built_by_its_init(partition: str | None) -> None:
    key = parse_partition_key(partition) if partition else None
    item = mllp_connection.intake_item("adt", "10.0.0.1:5000", message(), key)
    expected = IntakeItem(
        channel="adt", remote="10.0.0.1:5000", sending_app="LAB", sending_facility="NORTH", control_id="C1",
        message_type="ADT^A01^ADT_A01", body=BODY, encoding="utf-8", ack_mode="commit", accept_ack_type="AL",
        application_ack_type="NE", commit_ack=b"MSH|ack\r", received_at=1700000000.5,
        partition_key="MRN7" if partition else None,
    )
    assert type(item) is IntakeItem
    assert item == expected
    assert dataclasses.asdict(item) == dataclasses.asdict(expected)
    assert hash(item) == hash(expected)
    with pytest.raises(dataclasses.FrozenInstanceError):
        item.control_id = "other"  # type: ignore[misc]

"""The dispatch core on a partitioned channel: transmits name the key, a reject pauses the key."""

from __future__ import annotations

import dataclasses
import json

import pytest

from agent.core.dispatch import GiveUp, Settle, build_transmit, decide_head, on_response
from agent.core.protocol import Transmit, TransmitResponse, parse_client_frame
from agent.core.states import State
from tests.unit.test_dispatch_core import NOW, UP, policy, row


def keyed(key: str | None = "PAT1", **kw: object):  # type: ignore[no-untyped-def]
    return dataclasses.replace(row(**kw), partition_key=key)  # type: ignore[arg-type]


def test_transmit_names_the_partition_on_a_partitioned_channel() -> None:
    t = build_transmit(keyed("PAT1"), policy(partitioned=True, max_in_flight=4), 1)
    assert t.partition == "PAT1"
    assert json.loads(t.to_json())["partition"] == "PAT1"


def test_the_empty_key_is_sent_too() -> None:
    """A message without the fields has the key "" and is sent with it (one partition of its own)."""
    assert json.loads(build_transmit(keyed(""), policy(partitioned=True), 1).to_json())["partition"] == ""


def test_no_partition_field_without_partitioning() -> None:
    """Without partition_key the transmit is as before: no "partition" member at all."""
    t = build_transmit(keyed(None), policy(), 1)
    assert t.partition is None and "partition" not in json.loads(t.to_json())


@pytest.mark.parametrize("status", [400, 422])
def test_reject_with_pause_pauses_the_key_only(status: int) -> None:
    head = keyed("PAT1", state=State.INFLIGHT, attempts=1)
    done = on_response(head, 1, TransmitResponse(head.id, 1, status, None),
                       policy(partitioned=True, on_reject="pause", max_in_flight=4), NOW)
    assert isinstance(done, Settle) and done.pause is not None
    assert (done.pause.channel, done.pause.partition) == ("adt", "PAT1")


def test_give_up_with_pause_pauses_the_key_only() -> None:
    head = keyed("PAT2", state=State.INFLIGHT, attempts=3)
    done = on_response(head, 3, TransmitResponse(head.id, 3, 503, None),
                       policy(partitioned=True, on_reject="pause", max_attempts=3), NOW)
    assert isinstance(done, GiveUp) and done.pause is not None and done.pause.partition == "PAT2"


def test_strict_channel_pause_is_the_channel() -> None:
    head = keyed(None, state=State.INFLIGHT, attempts=1)
    done = on_response(head, 1, TransmitResponse(head.id, 1, 400, None), policy(on_reject="pause"), NOW)
    assert isinstance(done, Settle) and done.pause is not None and done.pause.partition is None


def test_decide_head_waits_while_the_channel_is_full() -> None:
    pol = policy(partitioned=True, max_in_flight=4)
    assert type(decide_head(keyed(), pol, UP, NOW, in_flight=3)).__name__ == "Claim"
    assert type(decide_head(keyed(), pol, UP, NOW, in_flight=4)).__name__ == "Wait"


def test_partition_survives_a_round_trip_through_the_server_parser() -> None:
    """The dev server reads the field back (it checks order per key in the benches)."""
    t = build_transmit(keyed("K\x1fV"), policy(partitioned=True), 2)
    parsed = parse_client_frame(t.to_json())
    assert isinstance(parsed, Transmit) and parsed.partition == "K\x1fV"

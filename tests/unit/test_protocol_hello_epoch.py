"""hello's lease fields: ``epoch`` and ``queue_id`` go out when known, parse strictly, and may be absent (older agents)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agent.core.protocol import Hello, parse_client_frame
from agent.errors import ProtocolError

QUEUE_ID = "6f1c2d3e-4b5a-4c6d-8e7f-9a0b1c2d3e4f"


def hello_frame(**extra: Any) -> str:
    return json.dumps({"type": "hello", "agent_id": "edge-01", "version": "0.2.0", "protocol": 1, **extra})


class TestHelloEpoch:
    def test_epoch_and_queue_id_round_trip(self) -> None:
        """A hello with the lease epoch and the queue id carries both through JSON."""
        hello = Hello("edge-01", "0.2.0", epoch=7, queue_id=QUEUE_ID)
        assert json.loads(hello.to_json()) == {
            "type": "hello", "agent_id": "edge-01", "version": "0.2.0", "protocol": 1,
            "epoch": 7, "queue_id": QUEUE_ID,
        }
        assert parse_client_frame(hello.to_json()) == hello

    def test_a_hello_from_an_older_agent_still_parses(self) -> None:
        """Without epoch and queue_id (the previous version) the hello is accepted, both None."""
        parsed = parse_client_frame(hello_frame())
        assert parsed == Hello("edge-01", "0.2.0")
        assert isinstance(parsed, Hello) and parsed.epoch is None and parsed.queue_id is None

    def test_unknown_fields_are_not_written(self) -> None:
        """A hello without a known epoch sends no epoch key at all (never a null)."""
        assert "epoch" not in json.loads(Hello("edge-01", "0.2.0").to_json())

    @pytest.mark.parametrize(
        ("extra", "needle"),
        [
            ({"epoch": "7"}, "integer"),
            ({"epoch": 7.0}, "integer"),
            ({"epoch": True}, "integer"),
            ({"epoch": None}, "integer"),
            ({"epoch": 0}, ">= 1"),
            ({"epoch": -3}, ">= 1"),
            ({"queue_id": 12}, "string"),
            ({"queue_id": None}, "string"),
            ({"queue_id": "not-a-uuid"}, "UUID"),
        ],
    )
    def test_malformed_lease_fields_are_refused(self, extra: dict[str, Any], needle: str) -> None:
        """When present, epoch is an integer >= 1 and queue_id a UUID string; anything else is a protocol error."""
        with pytest.raises(ProtocolError, match=needle):
            parse_client_frame(hello_frame(**extra))

"""Protocol v1 frames: round trips, strict parsing, status classes, frame sizes (SPEC 5)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.protocol import (
    ErrorMessage,
    Hello,
    Transmit,
    TransmitResponse,
    Welcome,
    classify_status,
    max_frame_bytes,
    parse_client_frame,
    parse_server_frame,
)
from agent.core.session import SessionCore
from agent.core.timefmt import rfc3339_utc
from agent.errors import ProtocolError


def make_transmit(**overrides: Any) -> Transmit:
    fields: dict[str, Any] = {
        "id": "0b1e7c1e-4a59-4d7e-9a53-2b8f0c1d2e3f",
        "channel": "adt",
        "control_id": "MSG0001",
        "message_type": "ADT^A01",
        "seq": 17,
        "attempt": 1,
        "received_at": "2024-05-01T12:30:00.123Z",
        "remote": "10.1.2.3:50122",
        "body": "MSH|^~\\&|LAB|HOSP|EHR|HOSP|20240501123000||ADT^A01|MSG0001|P|2.5\rPID|1||123\r",
        "encoding": "utf-8",
    }
    fields.update(overrides)
    return Transmit(**fields)


def frame(**fields: Any) -> str:
    return json.dumps(fields)


class TestRoundTrip:
    def test_hello_round_trips(self) -> None:
        """A hello serialises with type, agent_id, version and protocol 1 and parses back."""
        hello = Hello(agent_id="edge-01", version="0.1.0")
        assert json.loads(hello.to_json()) == {
            "type": "hello",
            "agent_id": "edge-01",
            "version": "0.1.0",
            "protocol": 1,
        }
        assert parse_client_frame(hello.to_json()) == hello

    def test_welcome_round_trips(self) -> None:
        """A welcome keeps its replay flag through JSON."""
        for replay in (True, False):
            assert parse_server_frame(Welcome(replay).to_json()) == Welcome(replay)

    def test_transmit_round_trips(self) -> None:
        """A transmit keeps every field, including a body with CR and non-ASCII text."""
        t = make_transmit(body="MSH|^~\\&|A\rPID|||Müller^Zoë\r", encoding="8859/1")
        obj = json.loads(t.to_json())
        assert obj["type"] == "transmit"
        assert obj["body"] == t.body
        assert parse_client_frame(t.to_json()) == t

    def test_transmit_response_round_trips(self) -> None:
        """A transmit_response keeps id, attempt, status and ack (also a null ack)."""
        for ack in ("MSH|^~\\&|X\rMSA|AA|MSG0001\r", None):
            r = TransmitResponse(id="x", attempt=3, status=200, ack=ack)
            assert parse_server_frame(r.to_json()) == r

    def test_error_round_trips(self) -> None:
        """An error frame parses from both sides."""
        e = ErrorMessage("bad hello")
        assert parse_server_frame(e.to_json()) == e
        assert parse_client_frame(e.to_json()) == e

    def test_unknown_extra_keys_are_ignored(self) -> None:
        """A newer server may add keys; they are ignored, not an error."""
        text = frame(type="welcome", replay=True, features=["x"], server="v9")
        assert parse_server_frame(text) == Welcome(True)

    def test_missing_ack_reads_as_null(self) -> None:
        """A transmit_response without an ack key reads as ack None ("ack may be null")."""
        text = frame(type="transmit_response", id="x", attempt=1, status=503)
        assert parse_server_frame(text) == TransmitResponse("x", 1, 503, None)


class TestStrictParsing:
    @pytest.mark.parametrize(
        ("text", "needle"),
        [
            ("not json", "not valid JSON"),
            ("[1, 2]", "JSON object"),
            ('{"replay": true}', "'type'"),
            ('{"type": 5}', "'type'"),
            (frame(type="bogus"), "unknown"),
            (frame(type="hello", agent_id="a", version="1", protocol=1), "unexpected"),
            (frame(type="welcome"), "'replay'"),
            (frame(type="welcome", replay="yes"), "boolean"),
            (frame(type="welcome", replay=1), "boolean"),
            (frame(type="transmit_response", attempt=1, status=200), "'id'"),
            (frame(type="transmit_response", id="x", attempt="1", status=200), "integer"),
            (frame(type="transmit_response", id="x", attempt=1, status=True), "integer"),
            (frame(type="transmit_response", id="x", attempt=1, status=200.0), "integer"),
            (frame(type="transmit_response", id="x", attempt=0, status=200), ">= 1"),
            (frame(type="transmit_response", id="x", attempt=1, status=2**63), "out of range"),
            (frame(type="transmit_response", id="x", attempt=2**64, status=200), "out of range"),
            (frame(type="transmit_response", id=7, attempt=1, status=200), "string"),
            (frame(type="transmit_response", id="x", attempt=1, status=200, ack=5), "null"),
            (frame(type="error"), "'message'"),
            ('{"type": "transmit_response", "id": "x", "attempt": 1, "status": NaN}', "NaN"),
        ],
    )
    def test_malformed_server_frames_raise(self, text: str, needle: str) -> None:
        """Each malformed server frame raises ProtocolError naming what is wrong."""
        with pytest.raises(ProtocolError, match=needle):
            parse_server_frame(text)

    def test_binary_frame_raises(self) -> None:
        """Protocol v1 is JSON text frames only; bytes are refused."""
        with pytest.raises(ProtocolError, match="binary"):
            parse_server_frame(b'{"type": "welcome", "replay": true}')

    def test_transmit_from_server_is_unexpected(self) -> None:
        """The server never sends transmit frames; the agent parser refuses one."""
        with pytest.raises(ProtocolError, match="unexpected"):
            parse_server_frame(make_transmit().to_json())

    def test_transmit_missing_field_raises(self) -> None:
        """A transmit without its body is refused by the server-side parser."""
        obj = json.loads(make_transmit().to_json())
        del obj["body"]
        with pytest.raises(ProtocolError, match="'body'"):
            parse_client_frame(json.dumps(obj))

    @pytest.mark.parametrize(
        "stamp", ["2024-05-01T12:30:00+00:00", "yesterday", "2024-13-01T00:00:00Z"]
    )
    def test_transmit_received_at_must_be_utc_z(self, stamp: str) -> None:
        """received_at must be RFC 3339 UTC with a Z suffix."""
        obj = json.loads(make_transmit(received_at=stamp).to_json())
        with pytest.raises(ProtocolError, match="received_at"):
            parse_client_frame(json.dumps(obj))


class TestUnencodableText:
    def test_lone_surrogates_become_replacement_characters(self) -> None:
        """JSON's "\\ud800" decodes to a str UTF-8 cannot hold: every string field is repaired at the edge."""
        text = json.dumps({"type": "transmit_response", "id": "x", "attempt": 1, "status": 200,
                           "ack": "MSA|AA|\ud800 \udfff \U0001f600"})
        msg = parse_server_frame(text)
        assert isinstance(msg, TransmitResponse)
        assert msg.ack == "MSA|AA|\ufffd \ufffd \U0001f600"
        assert msg.ack.encode("utf-8")
        error = parse_server_frame(json.dumps({"type": "error", "message": "no \udbff"}))
        assert isinstance(error, ErrorMessage) and error.message == "no \ufffd"
        sent = parse_client_frame(json.dumps({
            "type": "transmit", "id": "i", "channel": "adt", "control_id": "C\ud800", "message_type": "ADT^A01",
            "seq": 1, "attempt": 1, "received_at": "2026-01-01T00:00:00.000Z", "remote": "r",
            "body": "MSH|\udc80", "encoding": "utf-8"}))
        assert isinstance(sent, Transmit) and (sent.control_id, sent.body) == ("C\ufffd", "MSH|\ufffd")


class TestClassifyStatus:
    @pytest.mark.parametrize("status", [200, 201, 202, 204, 299])
    def test_2xx_is_processed(self, status: int) -> None:
        """Any 2xx settles the row processed."""
        assert classify_status(status) == "processed"

    @pytest.mark.parametrize("status", [400, 401, 404, 409, 422, 499])
    def test_4xx_except_429_is_rejected(self, status: int) -> None:
        """4xx other than 429 is a permanent rejection."""
        assert classify_status(status) == "rejected"

    @pytest.mark.parametrize("status", [429, 500, 502, 503, 599])
    def test_429_and_5xx_are_transient(self, status: int) -> None:
        """429 and 5xx are retried with backoff."""
        assert classify_status(status) == "transient"

    @pytest.mark.parametrize("status", [0, 100, 101, 199, 301, 399, 600, 999])
    def test_meaningless_statuses_are_transient(self, status: int) -> None:
        """Statuses v1 gives no meaning are retried, never dropped nor taken as delivered."""
        assert classify_status(status) == "transient"


class TestSizes:
    def test_max_frame_bytes_formula(self) -> None:
        """The frame limit is 6 x the largest max_message_bytes + 64 KiB."""
        assert max_frame_bytes(1_048_576) == 6 * 1_048_576 + 65_536
        assert max_frame_bytes(0) == 65_536

    def test_transmit_size_is_utf8_length_of_json(self) -> None:
        """The frame size a session checks counts UTF-8 bytes, so non-ASCII text counts 2+ bytes a character."""
        ascii_t = make_transmit(body="MSH|A")
        uni_t = make_transmit(body="MSH|Ä")
        assert transmit_size(ascii_t) == len(ascii_t.to_json())
        assert transmit_size(uni_t) == transmit_size(ascii_t) + 1

    def test_worst_case_body_fits_the_frame_limit(self) -> None:
        """A body of control characters, the worst JSON escaping, still fits the 6x bound."""
        limit = 1000
        t = make_transmit(body="\x01" * limit)
        assert transmit_size(t) <= max_frame_bytes(limit)


def transmit_size(t: Transmit) -> int:
    """The size of the frame a session writes for ``t`` (what its limit is checked against)."""
    return SessionCore[object](max_frame_bytes=1 << 30).prepare(t).size


class TestTimestamps:
    def test_rfc3339_utc_uses_z(self) -> None:
        """received_at is formatted in UTC with a Z suffix and milliseconds."""
        moment = datetime(2024, 5, 1, 14, 30, 0, 123456, tzinfo=timezone(timedelta(hours=2)))
        assert rfc3339_utc(moment) == "2024-05-01T12:30:00.123Z"
        assert rfc3339_utc(datetime(2024, 1, 1, tzinfo=UTC)) == "2024-01-01T00:00:00.000Z"

    def test_rfc3339_utc_refuses_naive(self) -> None:
        """A naive datetime has no defined instant and is refused."""
        with pytest.raises(ValueError, match="naive"):
            rfc3339_utc(datetime(2024, 1, 1))

    def test_formatted_stamp_parses_back(self) -> None:
        """A transmit carrying rfc3339_utc(now) passes the strict parser."""
        t = make_transmit(received_at=rfc3339_utc(datetime.now(UTC)))
        assert parse_client_frame(t.to_json()) == t


class TestTransmitJsonIsTheGenericEncoders:
    """Transmit.to_json is written out for speed: it must stay exactly the generic encoder's output."""

    @staticmethod
    def generic(t: Transmit) -> str:
        fields: dict[str, Any] = {
            "type": "transmit", "id": t.id, "channel": t.channel, "control_id": t.control_id,
            "message_type": t.message_type, "seq": t.seq, "attempt": t.attempt,
            "received_at": t.received_at, "remote": t.remote, "body": t.body, "encoding": t.encoding,
        }
        if t.partition is not None:
            fields["partition"] = t.partition
        return json.dumps(fields, ensure_ascii=False, separators=(",", ":"), allow_nan=False)

    @given(texts=st.lists(st.text(), min_size=8, max_size=8), seq=st.integers(min_value=0, max_value=2**63),
           attempt=st.integers(min_value=1, max_value=10**6), partition=st.none() | st.text())
    def test_byte_for_byte_and_parsed_back(self, texts: list[str], seq: int, attempt: int,
                                           partition: str | None) -> None:
        """Any text (quotes, backslashes, control characters, U+2028, astral planes) and any number."""
        t = Transmit(texts[0], texts[1], texts[2], texts[3], seq, attempt, "2026-01-01T00:00:00Z", texts[4],
                     texts[5], texts[6], partition)
        assert t.to_json() == self.generic(t)
        assert json.loads(t.to_json())["body"] == t.body

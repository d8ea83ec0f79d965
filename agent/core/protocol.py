"""Upstream protocol v1: the JSON frames exchanged with the server (docs/protocol.md).

Pure: plain dataclasses, ``to_json()`` on each, and strict parsers. The asyncio
link (``agent.runtime.upstream``) and the reference server (``agent.app.devserver``) only
pump these through a WebSocket, so every rule about what a frame may contain
lives here and is tested without an event loop.

Parsing is strict about what protocol v1 defines (a missing field, a wrong
type or an unknown ``type`` raises :class:`agent.errors.ProtocolError`) and
lenient about what it does not: unknown extra keys are ignored, so a newer
server can add fields without breaking this agent.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, TypeAlias

from agent.core.states import State
from agent.errors import ProtocolError

PROTOCOL_VERSION = 1

#: Headroom for the JSON envelope around ``body`` (docs/protocol.md#size-limits: "+ 64 KiB").
FRAME_OVERHEAD_BYTES = 64 * 1024
#: Worst case JSON escaping of one body byte: a control character becomes
#: ``\\u00XX`` (RFC 8259 section 7), six bytes (docs/protocol.md#size-limits: "6 x").
ESCAPE_FACTOR = 6

#: Close codes (docs/protocol.md#close-codes). RFC 6455 section 7.1.5: with no
#: Close frame received, the close code is 1006; section 7.4.1: 1009 is
#: "message too big"; section 7.4.2: 4000-4999 are private use, and protocol
#: v1's 4001 says the server has seen a higher lease epoch for this agent and
#: queue, so the session's holder is stale.
ABNORMAL_CLOSURE = 1006
MESSAGE_TOO_BIG = 1009
EPOCH_REFUSED = 4001



class StatusClass(StrEnum):
    """What a transmit_response status means for the row (docs/protocol.md#status-classes)."""

    # Named after the row state each settles in (2xx processed; 4xx except 429
    # rejected for good, never retried), so the two cannot drift apart.
    PROCESSED = State.PROCESSED.value
    REJECTED = State.REJECTED.value
    TRANSIENT = "transient"  # 5xx, 429 and anything v1 gives no meaning: retry with backoff


#: ensure_ascii=False keeps non-ASCII text at its UTF-8 size (2-4 bytes)
#: instead of \uXXXX (6-12 bytes), so the 6x bound of the size limits holds.
#: One encoder for every frame: json.dumps with options builds a new one per call.
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)
#: A JSON string as that encoder writes it (RFC 8259 section 7; the C speedup when present).
_string: Callable[[str], str] = json.encoder.encode_basestring


def _dumps(obj: Mapping[str, Any]) -> str:
    return _ENCODER.encode(obj)


@dataclass(frozen=True, slots=True)
class Hello:
    """agent -> server, first frame after the WebSocket opens (docs/protocol.md#hello).

    ``epoch`` is the dispatch lease epoch this session dispatches under and
    ``queue_id`` the UUID of the queue database: a server that tracks epochs
    per (agent_id, queue_id) refuses a holder whose epoch is below the
    highest it has seen, so a holder that lost its lease while frozen cannot
    get a late frame through. Both are absent in a hello from an agent
    version before them; such a hello still parses (see ``_hello``).
    """

    agent_id: str
    version: str
    protocol: int = PROTOCOL_VERSION
    epoch: int | None = None
    queue_id: str | None = None

    def to_json(self) -> str:
        frame: dict[str, Any] = {
            "type": "hello",
            "agent_id": self.agent_id,
            "version": self.version,
            "protocol": self.protocol,
        }
        if self.epoch is not None:
            frame["epoch"] = self.epoch
        if self.queue_id is not None:
            frame["queue_id"] = self.queue_id
        return _dumps(frame)


@dataclass(frozen=True, slots=True)
class Welcome:
    """server -> agent answer to hello; ``replay`` says 2xx answers are remembered by id."""

    replay: bool

    def to_json(self) -> str:
        return _dumps({"type": "welcome", "replay": self.replay})


@dataclass(frozen=True, slots=True)
class Transmit:
    """agent -> server, one queued message (docs/protocol.md#transmit).

    ``id`` never changes across retries, restarts and upgrades; ``attempt``
    grows with each send so answers can be matched to the send they answer.
    """

    id: str
    channel: str
    control_id: str
    message_type: str
    seq: int
    attempt: int
    received_at: str  # RFC 3339 UTC with "Z", see agent.core.timefmt.rfc3339_utc()
    remote: str
    body: str
    encoding: str
    #: The row's partition key on a partitioned channel (order is kept per key); None: not sent.
    partition: str | None = None

    def to_json(self) -> str:
        """The frame, byte for byte what ``_dumps`` writes for these fields, in this order.

        Written out because one transmit goes out per message: the generic
        encoder walks a dict built for it each time (the dispatcher's largest
        cost per message after the WebSocket write).
        """
        s = _string
        partition = "" if self.partition is None else f',"partition":{s(self.partition)}'
        return (f'{{"type":"transmit","id":{s(self.id)},"channel":{s(self.channel)},'
                f'"control_id":{s(self.control_id)},"message_type":{s(self.message_type)},'
                f'"seq":{int(self.seq)},"attempt":{int(self.attempt)},"received_at":{s(self.received_at)},'
                f'"remote":{s(self.remote)},"body":{s(self.body)},"encoding":{s(self.encoding)}{partition}}}')


@dataclass(frozen=True, slots=True)
class TransmitResponse:
    """server -> agent, the answer to one transmit attempt (docs/protocol.md#transmit_response)."""

    id: str
    attempt: int
    status: int
    ack: str | None = None

    def to_json(self) -> str:
        return _dumps(
            {
                "type": "transmit_response",
                "id": self.id,
                "attempt": self.attempt,
                "status": self.status,
                "ack": self.ack,
            }
        )


@dataclass(frozen=True, slots=True)
class ErrorMessage:
    """Either direction: a human-readable complaint; never fatal by itself (docs/protocol.md#error)."""

    message: str

    def to_json(self) -> str:
        return _dumps({"type": "error", "message": self.message})


ServerMessage: TypeAlias = Welcome | TransmitResponse | ErrorMessage
ClientMessage: TypeAlias = Hello | Transmit | ErrorMessage

# --- strict field readers -------------------------------------------------


def _field(obj: Mapping[str, Any], key: str, kind: str) -> Any:
    if key not in obj:
        raise ProtocolError(f"{kind} frame lacks required field {key!r}")
    return obj[key]


def _text(value: str) -> str:
    """``value`` with any lone surrogate (JSON allows ``"\\ud800"``) replaced by U+FFFD.

    Such a string cannot be encoded as UTF-8: stored or sent on, it would
    raise far from here, and a replaying server would send it again after
    every restart. RFC 8259 section 8.2 leaves these strings' handling open.
    """
    if value.isascii():
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "".join("\ufffd" if "\ud800" <= ch <= "\udfff" else ch for ch in value)
    return value


def _str(obj: Mapping[str, Any], key: str, kind: str) -> str:
    value = _field(obj, key, kind)
    if not isinstance(value, str):
        raise ProtocolError(f"{kind} field {key!r} must be a string, got {type(value).__name__}")
    return _text(value)


#: The largest integer either side accepts: the queue stores them as 64-bit integers.
_INT_MAX = 2**63 - 1


def _int(obj: Mapping[str, Any], key: str, kind: str, *, minimum: int | None = None) -> int:
    value = _field(obj, key, kind)
    # bool is an int subclass in Python; JSON true is not a number.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{kind} field {key!r} must be an integer, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ProtocolError(f"{kind} field {key!r} must be >= {minimum}, got {value}")
    if value > _INT_MAX:
        raise ProtocolError(f"{kind} field {key!r} is out of range (at most {_INT_MAX})")
    return value


def _bool(obj: Mapping[str, Any], key: str, kind: str) -> bool:
    value = _field(obj, key, kind)
    if not isinstance(value, bool):
        raise ProtocolError(f"{kind} field {key!r} must be a boolean, got {type(value).__name__}")
    return value


def _opt_str(obj: Mapping[str, Any], key: str, kind: str) -> str | None:
    # "ack may be null" (docs/protocol.md#the-ack-field): an absent key is read as null too.
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise ProtocolError(f"{kind} field {key!r} must be a string or null")
    return None if value is None else _text(value)


def _timestamp(obj: Mapping[str, Any], key: str, kind: str) -> str:
    value = _str(obj, key, kind)
    if not value.endswith("Z"):
        raise ProtocolError(f"{kind} field {key!r} must be RFC 3339 UTC ending in 'Z'")
    try:
        datetime.fromisoformat(value)
    except ValueError:
        raise ProtocolError(f"{kind} field {key!r} is not an RFC 3339 timestamp") from None
    return value


def _reject_constant(name: str) -> Any:
    raise ProtocolError(f"frame contains {name}, which JSON does not allow")


#: One decoder for every frame (json.loads with options builds a new one per call).
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _load(text: str | bytes) -> tuple[str, dict[str, Any]]:
    if isinstance(text, bytes):
        # Protocol v1 uses text frames only (docs/protocol.md#frames).
        raise ProtocolError("binary frame received; protocol v1 uses JSON text frames")
    try:
        obj = _DECODER.decode(text)
    except json.JSONDecodeError as exc:
        raise ProtocolError(f"frame is not valid JSON: {exc.msg}") from None
    except (ValueError, RecursionError):  # e.g. absurd integer strings or nesting
        raise ProtocolError("frame is not valid JSON") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"frame must be a JSON object, got {type(obj).__name__}")
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("frame lacks a string 'type' field")
    return kind, obj


def _welcome(obj: Mapping[str, Any]) -> Welcome:
    return Welcome(replay=_bool(obj, "replay", "welcome"))


def _transmit_response(obj: Mapping[str, Any]) -> TransmitResponse:
    k = "transmit_response"
    return TransmitResponse(
        id=_str(obj, "id", k),
        attempt=_int(obj, "attempt", k, minimum=1),
        status=_int(obj, "status", k, minimum=0),
        ack=_opt_str(obj, "ack", k),
    )


def _error(obj: Mapping[str, Any]) -> ErrorMessage:
    return ErrorMessage(message=_str(obj, "message", "error"))


def _uuid(obj: Mapping[str, Any], key: str, kind: str) -> str:
    value = _str(obj, key, kind)
    try:
        uuid.UUID(value)
    except ValueError:
        raise ProtocolError(f"{kind} field {key!r} must be a UUID") from None
    return value


def _hello(obj: Mapping[str, Any]) -> Hello:
    """A hello; ``epoch`` and ``queue_id`` are optional, but well-formed when present.

    Optional because an agent of the previous version sends neither, and in
    an upgrade overlap it talks to the same server as its successor until it
    hands over: refusing its hello would cut it off with rows in flight.
    A server cannot fence such a session by epoch; it treats it as older than
    any session that sends one.
    """
    k = "hello"
    return Hello(
        agent_id=_str(obj, "agent_id", k),
        version=_str(obj, "version", k),
        protocol=_int(obj, "protocol", k, minimum=1),
        epoch=_int(obj, "epoch", k, minimum=1) if "epoch" in obj else None,
        queue_id=_uuid(obj, "queue_id", k) if "queue_id" in obj else None,
    )


def _transmit(obj: Mapping[str, Any]) -> Transmit:
    k = "transmit"
    return Transmit(
        id=_str(obj, "id", k),
        channel=_str(obj, "channel", k),
        control_id=_str(obj, "control_id", k),
        message_type=_str(obj, "message_type", k),
        seq=_int(obj, "seq", k, minimum=0),
        attempt=_int(obj, "attempt", k, minimum=1),
        received_at=_timestamp(obj, "received_at", k),
        remote=_str(obj, "remote", k),
        body=_str(obj, "body", k),
        encoding=_str(obj, "encoding", k),
        partition=_str(obj, "partition", k) if "partition" in obj else None,
    )


_SERVER_FRAMES: dict[str, Callable[[Mapping[str, Any]], ServerMessage]] = {
    "welcome": _welcome,
    "transmit_response": _transmit_response,
    "error": _error,
}

_CLIENT_FRAMES: dict[str, Callable[[Mapping[str, Any]], ClientMessage]] = {
    "hello": _hello,
    "transmit": _transmit,
    "error": _error,
}


def parse_server_frame(text: str | bytes) -> ServerMessage:
    """Read one frame the server sent to the agent; raise ProtocolError if v1 does not allow it."""
    kind, obj = _load(text)
    reader = _SERVER_FRAMES.get(kind)
    if reader is None:
        raise ProtocolError(f"unknown or unexpected frame type {kind!r} from server")
    return reader(obj)


def parse_client_frame(text: str | bytes) -> ClientMessage:
    """Read one frame an agent sent to the server (the dev server's side of the protocol)."""
    kind, obj = _load(text)
    reader = _CLIENT_FRAMES.get(kind)
    if reader is None:
        raise ProtocolError(f"unknown or unexpected frame type {kind!r} from agent")
    return reader(obj)


# --- policy helpers -------------------------------------------------------


def classify_status(status: int) -> StatusClass:
    """Map a transmit_response status to what the dispatcher does with the row (docs/protocol.md#status-classes)."""
    if 200 <= status <= 299:
        return StatusClass.PROCESSED
    if status == 429 or 500 <= status <= 599:
        return StatusClass.TRANSIENT
    if 400 <= status <= 499:
        return StatusClass.REJECTED
    # 1xx, 3xx, 0 or >= 600 mean nothing in protocol v1. Rejecting would drop
    # the message for good on what is most likely a server bug, and "processed"
    # would claim a delivery nobody confirmed; retrying is the only choice that
    # never loses a message (max_attempts still bounds it).
    return StatusClass.TRANSIENT


def max_frame_bytes(largest_max_message_bytes: int) -> int:
    """Largest frame either side accepts: 6 x the largest max_message_bytes + 64 KiB (docs/protocol.md#size-limits)."""
    return ESCAPE_FACTOR * largest_max_message_bytes + FRAME_OVERHEAD_BYTES


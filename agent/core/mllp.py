"""Sans-I/O MLLP framer: bytes in, events out (HL7 v2 MLLP release 2 framing).

Like websockets' protocol objects, the decoder never touches a socket: the
intake connection (agent.core.intake) feeds it whatever the socket delivered
and acts on the events it gets back. Keeping it pure lets the tests split input at every byte offset without
an event loop.

Framing is ``<VT> payload <FS><CR>`` (0x0B ... 0x1C 0x0D). The decoder is
deliberately lenient where senders are sloppy and strict where memory is at
stake:

- bytes outside a frame are skipped and reported (``JunkSkipped``);
- a ``VT`` inside a frame means the sender restarted it (e.g. after its own
  timeout): the partial frame is reported as junk and a new frame begins;
- ``FS`` not followed by ``CR`` is payload;
- a frame over ``max_message_bytes`` stops being buffered (only a prefix is
  kept, to read the MSH for the reject ACK) but is still scanned to its end,
  so the stream stays in sync and memory stays bounded whatever the input.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "END_BLOCK",
    "OVERSIZE_PREFIX_BYTES",
    "START_BLOCK",
    "Event",
    "Frame",
    "JunkSkipped",
    "MllpDecoder",
    "OversizeFrame",
    "encode_ack_frame",
    "encode_frame",
    "frame_safe",
]

START_BLOCK = b"\x0b"
END_BLOCK = b"\x1c\x0d"

_FS = 0x1C
_CR = 0x0D

#: An oversize frame keeps at most this many leading bytes: enough for any
#: real MSH segment, which is all the reject ACK needs.
OVERSIZE_PREFIX_BYTES = 64 * 1024


def encode_frame(payload: bytes) -> bytes:
    """Wrap one payload in an MLLP block as is: VT payload FS CR.

    Byte-exact, for re-framing what a sender sent (a 0x1C not followed by CR
    is payload and survives). What the agent itself writes to a sender goes
    through ``encode_ack_frame``.
    """
    return START_BLOCK + payload + END_BLOCK


def frame_safe(payload: bytes) -> bytes:
    """``payload`` without the MLLP block bytes 0x0B and 0x1C.

    Such a payload always frames as exactly one message: a VT inside would
    restart the frame at the receiver, an FS followed by CR end it early and
    leave the rest as junk. ACKs are ASCII-compatible (HL7 table 0211
    encodings only), where neither byte is ever part of a multi-byte
    character, so dropping them damages nothing else.
    """
    if b"\x0b" in payload or b"\x1c" in payload:
        return payload.replace(b"\x0b", b"").replace(b"\x1c", b"")
    return payload


def encode_ack_frame(ack: bytes) -> bytes:
    """One well-formed MLLP frame for an ACK, whatever its bytes (last line of defence).

    ACKs the agent builds never contain the block bytes; an ACK relayed from
    the server's text, or stored by an older version, might. (``frame_safe``
    and ``encode_frame`` in one: one per ACK written.)
    """
    if b"\x0b" in ack or b"\x1c" in ack:
        ack = ack.replace(b"\x0b", b"").replace(b"\x1c", b"")
    return b"\x0b" + ack + b"\x1c\x0d"


# The events are plain slots classes, not frozen: one is made per frame and
# read once; a frozen dataclass's __init__ costs 2.5 times as much.


@dataclass(slots=True)
class Frame:
    """A complete message, payload exactly as received (framing bytes removed)."""

    payload: bytes


@dataclass(slots=True)
class OversizeFrame:
    """A frame that ended but exceeded the limit; only its first bytes were kept.

    ``prefix`` is the first ``min(max_message_bytes, 64 KiB)`` bytes (to read the
    MSH for the reject ACK: docs/acks.md#which-ack-for-which-situation), ``size``
    the full payload length.
    """

    prefix: bytes
    size: int


@dataclass(slots=True)
class JunkSkipped:
    """``count`` bytes outside any complete frame were discarded."""

    count: int


Event = Frame | OversizeFrame | JunkSkipped


class MllpDecoder:
    """Incremental MLLP decoder for one connection.

    Every byte fed is looked at a bounded number of times (``bytes.find`` on the
    new chunk only; the buffered part of a frame is never re-scanned), so a big
    frame arriving in many small reads costs O(n), not O(n^2).
    """

    def __init__(self, max_message_bytes: int) -> None:
        if max_message_bytes < 1:
            raise ValueError("max_message_bytes must be positive")
        self._max = max_message_bytes
        self._prefix_limit = min(max_message_bytes, OVERSIZE_PREFIX_BYTES)
        self._in_frame = False
        # The payload so far of a frame under the limit.
        self._buf = bytearray()
        # Set once the current frame passed the limit: buffering stopped.
        self._oversize = False
        self._prefix = b""
        # Payload length of the current frame (counted even when not buffered).
        self._size = 0
        # The last byte fed was an FS inside a frame: the next byte decides
        # whether it ended the frame (CR) or was payload (a read may split anywhere).
        self._pending_fs = False
        # Junk counted in this feed() call, not yet reported.
        self._junk = 0

    @property
    def mid_frame(self) -> bool:
        """True while a started frame is incomplete (graceful shutdown waits on it)."""
        return self._in_frame

    def unconsumed(self) -> bytes | None:
        """The stream bytes of the frame in progress, re-framed, to hand the stream to another reader.

        ``b""`` between frames; None once the frame in progress went over the
        limit (its bytes were dropped, so the stream cannot be handed on).
        """
        if not self._in_frame:
            return b""
        if self._oversize:
            return None
        return START_BLOCK + bytes(self._buf) + (b"\x1c" if self._pending_fs else b"")

    def buffered_bytes(self) -> int:
        """Bytes held for the current frame (bounded by the limit, or the prefix)."""
        return len(self._buf) + len(self._prefix)

    def feed(self, data: bytes) -> list[Event]:
        """Consume one chunk of the stream; return the events it completed, in order."""
        events: list[Event] = []
        n = len(data)
        pos = 0
        # Cached search results for this chunk; -1 means "none up to the end",
        # which stays true for any later position, so nothing is scanned twice.
        next_vt = -2
        next_end = -2
        while pos < n:
            if not self._in_frame:
                if next_vt == -2 or (0 <= next_vt < pos):
                    next_vt = data.find(START_BLOCK, pos)
                if next_vt < 0:
                    self._junk += n - pos
                    pos = n
                    break
                self._junk += next_vt - pos
                self._flush_junk(events)
                self._start_frame()
                pos = next_vt + 1
                continue

            if self._pending_fs:
                self._pending_fs = False
                if data[pos] == _CR:
                    self._finish_frame(events)
                    pos += 1
                    continue
                # FS not followed by CR is payload.
                self._append(b"\x1c")

            if next_end == -2 or (0 <= next_end < pos):
                next_end = data.find(END_BLOCK, pos)
            stop = next_end if next_end >= 0 else n
            if next_vt == -2 or (0 <= next_vt < pos):
                next_vt = data.find(START_BLOCK, pos)
            if 0 <= next_vt < stop:
                # A new start block before the end: the sender restarted the
                # frame; the partial one (and its VT) is junk. So is every
                # frame restarted again before the end: only the last start
                # block counts, found in one search, so a flood of start
                # blocks costs C's speed, not a Python turn (and an event) each.
                last_vt = data.rfind(START_BLOCK, next_vt, stop)
                self._junk += 1 + self._size + (last_vt - pos)
                self._flush_junk(events)
                self._start_frame()
                pos = last_vt + 1
                continue
            if next_end >= 0:
                self._append(data[pos:next_end])
                self._finish_frame(events)
                pos = next_end + 2
                continue
            # No end in this chunk. A trailing FS may be the first half of the
            # end block: hold it back until the next byte arrives.
            if data[n - 1] == _FS:
                self._append(data[pos : n - 1])
                self._pending_fs = True
            else:
                self._append(data[pos:n])
            pos = n
        self._flush_junk(events)
        return events

    # -- internals -----------------------------------------------------------

    def _start_frame(self) -> None:
        self._in_frame = True
        self._buf = bytearray()
        self._oversize = False
        self._prefix = b""
        self._size = 0
        self._pending_fs = False

    def _append(self, chunk: bytes) -> None:
        if not chunk:
            return
        self._size += len(chunk)
        if self._oversize:
            return
        if self._size <= self._max:
            self._buf += chunk
            return
        # Just crossed the limit: keep the prefix, stop buffering (an oversize
        # frame is discarded without ever being buffered whole).
        need = self._prefix_limit - len(self._buf)
        if need > 0:
            self._buf += chunk[:need]
        self._prefix = bytes(self._buf[: self._prefix_limit])
        self._buf = bytearray()
        self._oversize = True

    def _finish_frame(self, events: list[Event]) -> None:
        if self._oversize:
            events.append(OversizeFrame(prefix=self._prefix, size=self._size))
        else:
            events.append(Frame(payload=bytes(self._buf)))
        self._in_frame = False
        self._buf = bytearray()
        self._prefix = b""
        self._oversize = False
        self._size = 0

    def _flush_junk(self, events: list[Event]) -> None:
        if self._junk:
            events.append(JunkSkipped(count=self._junk))
            self._junk = 0

"""The sans-I/O MLLP framer, fed byte by byte without an event loop (SPEC 4)."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.core.mllp import (
    END_BLOCK,
    OVERSIZE_PREFIX_BYTES,
    START_BLOCK,
    Event,
    Frame,
    JunkSkipped,
    MllpDecoder,
    OversizeFrame,
    encode_ack_frame,
    encode_frame,
    frame_safe,
)

MSG1 = b"MSH|^~\\&|A|B|C|D|20240101||ADT^A01|1|P|2.5\rPID|1||42\r"
# An FS not followed by CR inside the message is payload (SPEC 4).
MSG2_SAFE = b"MSH|^~\\&|A|B|C|D|20240101||ADT^A08|2|P|2.5\rPID|1||4\x1c3\r"


def frames(events: list[Event]) -> list[bytes]:
    """The payloads of the Frame events, in order."""
    return [e.payload for e in events if isinstance(e, Frame)]


def junk(events: list[Event]) -> int:
    """Total bytes reported skipped."""
    return sum(e.count for e in events if isinstance(e, JunkSkipped))


def feed_all(decoder: MllpDecoder, chunks: list[bytes]) -> list[Event]:
    """Feed every chunk and collect all events."""
    out: list[Event] = []
    for chunk in chunks:
        out.extend(decoder.feed(chunk))
    return out


class TestEncode:
    def test_encode_frame_wraps_payload(self) -> None:
        """encode_frame puts VT before and FS CR after the payload."""
        assert encode_frame(b"abc") == b"\x0babc\x1c\x0d"
        assert START_BLOCK == b"\x0b"
        assert END_BLOCK == b"\x1c\x0d"

    def test_round_trip(self) -> None:
        """A framed message decodes back to exactly its payload."""
        decoder = MllpDecoder(1 << 20)
        assert decoder.feed(encode_frame(MSG1)) == [Frame(MSG1)]
        assert not decoder.mid_frame
        assert decoder.buffered_bytes() == 0


class TestAckFrames:
    @pytest.mark.parametrize(
        "ack",
        [b"MSH|^~\\&|A\x1c\rMSA|AA|1\r", b"MSH|\x0bMSA|AA\r", b"\x1c\r\x1c\r", b"MSH|A\x1c", b"\x0b", b""],
    )
    def test_encode_ack_frame_is_always_exactly_one_frame(self, ack: bytes) -> None:
        """Whatever an ACK holds (a relayed server text, a row from an older version), one frame and no junk goes out."""
        wire = encode_ack_frame(ack)
        events = MllpDecoder(1 << 20).feed(wire)
        assert len(events) == 1 and isinstance(events[0], Frame), events
        assert events[0].payload == ack.replace(b"\x0b", b"").replace(b"\x1c", b"")

    def test_frame_safe_keeps_clean_payloads_as_they_are(self) -> None:
        """An ACK without block bytes is written byte for byte (the same object, no copy)."""
        assert frame_safe(MSG1) is MSG1
        assert frame_safe(b"a\x1cb\x0bc") == b"abc"

    def test_encode_frame_stays_byte_exact_for_relaying_sender_frames(self) -> None:
        """encode_frame (re-framing what a sender sent, for a hand-over) keeps an FS that is payload."""
        assert MllpDecoder(1 << 20).feed(encode_frame(MSG2_SAFE)) == [Frame(MSG2_SAFE)]


class TestSplitting:
    STREAM = encode_frame(MSG1) + encode_frame(MSG2_SAFE)

    def test_two_frames_in_one_chunk(self) -> None:
        """Two frames in one read yield two Frame events in order."""
        decoder = MllpDecoder(1 << 20)
        assert decoder.feed(self.STREAM) == [Frame(MSG1), Frame(MSG2_SAFE)]

    def test_split_at_every_offset(self) -> None:
        """Splitting the stream into two chunks at any offset yields the same two frames."""
        for cut in range(len(self.STREAM) + 1):
            decoder = MllpDecoder(1 << 20)
            events = feed_all(decoder, [self.STREAM[:cut], self.STREAM[cut:]])
            assert events == [Frame(MSG1), Frame(MSG2_SAFE)], cut
            assert not decoder.mid_frame

    def test_one_byte_at_a_time(self) -> None:
        """Feeding one byte per call yields the same two frames and no junk."""
        decoder = MllpDecoder(1 << 20)
        chunks = [self.STREAM[i : i + 1] for i in range(len(self.STREAM))]
        assert feed_all(decoder, chunks) == [Frame(MSG1), Frame(MSG2_SAFE)]

    def test_split_between_fs_and_cr(self) -> None:
        """An end block split between 0x1C and 0x0D still ends the frame."""
        decoder = MllpDecoder(1 << 20)
        data = encode_frame(MSG1)
        assert decoder.feed(data[:-1]) == []
        assert decoder.mid_frame
        assert decoder.feed(data[-1:]) == [Frame(MSG1)]
        assert not decoder.mid_frame

    def test_fs_without_cr_is_payload(self) -> None:
        """An FS not followed by CR stays in the payload, also when split after the FS."""
        data = encode_frame(MSG2_SAFE)
        cut = data.index(b"\x1c")
        decoder = MllpDecoder(1 << 20)
        assert feed_all(decoder, [data[: cut + 1], data[cut + 1 :]]) == [Frame(MSG2_SAFE)]

    def test_fs_fs_cr_ends_with_fs_in_payload(self) -> None:
        """FS FS CR: the first FS is payload, the second starts the end block."""
        decoder = MllpDecoder(1 << 20)
        assert feed_all(decoder, [b"\x0babc\x1c", b"\x1c", b"\r"]) == [Frame(b"abc\x1c")]

    def test_empty_frame(self) -> None:
        """VT FS CR is an empty frame (the listener decides what to do with it)."""
        assert MllpDecoder(10).feed(b"\x0b\x1c\r") == [Frame(b"")]

    def test_empty_feed(self) -> None:
        """Feeding b'' changes nothing and yields nothing."""
        decoder = MllpDecoder(10)
        assert decoder.feed(b"") == []
        assert not decoder.mid_frame

    def test_mid_frame_and_buffered(self) -> None:
        """mid_frame and buffered_bytes report a started, incomplete frame."""
        decoder = MllpDecoder(1 << 20)
        assert decoder.feed(b"\x0bMSH|") == []
        assert decoder.mid_frame
        assert decoder.buffered_bytes() == 4


class TestJunk:
    def test_junk_before_between_after(self) -> None:
        """Bytes outside frames are skipped and counted; frames still come out whole."""
        stream = b"xx" + encode_frame(MSG1) + b"\r\n" + encode_frame(MSG1) + b"yyy"
        decoder = MllpDecoder(1 << 20)
        events = decoder.feed(stream)
        assert frames(events) == [MSG1, MSG1]
        assert junk(events) == 7
        assert events[0] == JunkSkipped(2)
        assert events[-1] == JunkSkipped(3)
        assert not decoder.mid_frame

    def test_junk_split_everywhere(self) -> None:
        """Junk between frames is counted exactly whatever the split point."""
        stream = b"ab" + encode_frame(MSG1) + b"\n" + encode_frame(MSG2_SAFE) + b"z"
        for cut in range(len(stream) + 1):
            decoder = MllpDecoder(1 << 20)
            events = feed_all(decoder, [stream[:cut], stream[cut:]])
            assert frames(events) == [MSG1, MSG2_SAFE], cut
            assert junk(events) == 4, cut

    def test_only_junk(self) -> None:
        """A chunk without any start block is all junk and leaves no frame open."""
        decoder = MllpDecoder(10)
        assert decoder.feed(b"GET / HTTP/1.1\r\n") == [JunkSkipped(16)]
        assert not decoder.mid_frame

    def test_vt_restart_drops_partial_frame(self) -> None:
        """A VT inside a frame makes the partial frame junk and starts a new frame."""
        stream = b"\x0bMSH|partial" + encode_frame(MSG1)
        for cut in range(len(stream) + 1):
            decoder = MllpDecoder(1 << 20)
            events = feed_all(decoder, [stream[:cut], stream[cut:]])
            assert frames(events) == [MSG1], cut
            assert junk(events) == len(b"\x0bMSH|partial"), cut

    def test_vt_restart_after_pending_fs(self) -> None:
        """A frame ending in a lone FS then restarted by VT counts the FS as junk too."""
        decoder = MllpDecoder(1 << 20)
        events = feed_all(decoder, [b"\x0bab\x1c", encode_frame(MSG1)])
        assert frames(events) == [MSG1]
        assert junk(events) == 4

    @pytest.mark.parametrize("unit", [b"\x0b", b"\x0bA", b"\x0bMSH|^~\\&|\x1c"])
    def test_a_flood_of_restarts_is_one_event_per_read(self, unit: bytes) -> None:
        """Frames restarted again and again before any end: one junk event per read, not one per start block.

        A Python turn per start block framed a flood of them at 0.4 MB/s, which
        starved every other sender; whatever their number, the count is exact.
        """
        flood = unit * 20_000
        decoder = MllpDecoder(1 << 20)
        events = feed_all(decoder, [flood[:70_001], flood[70_001:], encode_frame(MSG1)])
        assert frames(events) == [MSG1]
        assert junk(events) == len(flood)
        assert len(events) <= 4, len(events)

    def test_double_vt(self) -> None:
        """VT VT payload FS CR yields the payload, one junk byte."""
        events = MllpDecoder(100).feed(b"\x0b\x0babc\x1c\r")
        assert events == [JunkSkipped(1), Frame(b"abc")]


class TestOversize:
    def test_limit_is_inclusive(self) -> None:
        """A payload of exactly max_message_bytes is a normal Frame."""
        assert MllpDecoder(5).feed(encode_frame(b"12345")) == [Frame(b"12345")]

    def test_over_limit_gives_oversize_with_prefix(self) -> None:
        """One byte over the limit gives OversizeFrame with the first limit bytes and the size."""
        events = MllpDecoder(5).feed(encode_frame(b"123456"))
        assert events == [OversizeFrame(prefix=b"12345", size=6)]

    def test_oversize_then_normal_frame(self) -> None:
        """After an oversize frame the stream stays in sync for the next frame, at every split."""
        big = b"MSH|" + b"x" * 100
        stream = encode_frame(big) + encode_frame(b"ok")
        for cut in range(len(stream) + 1):
            decoder = MllpDecoder(50)
            events = feed_all(decoder, [stream[:cut], stream[cut:]])
            assert events == [OversizeFrame(prefix=big[:50], size=len(big)), Frame(b"ok")], cut

    def test_prefix_capped_at_64k(self) -> None:
        """With a large limit, the prefix kept is 64 KiB, not the whole limit."""
        limit = 1 << 20
        payload = b"M" * (limit + 10)
        decoder = MllpDecoder(limit)
        events = decoder.feed(encode_frame(payload))
        assert events == [OversizeFrame(prefix=payload[:OVERSIZE_PREFIX_BYTES], size=len(payload))]

    def test_fs_inside_oversize_counts(self) -> None:
        """A lone FS inside an oversize frame is payload and counted in size."""
        decoder = MllpDecoder(3)
        events = feed_all(decoder, [b"\x0babcd\x1c", b"e\x1c", b"\r"])
        assert events == [OversizeFrame(prefix=b"abc", size=6)]  # abcd FS e

    def test_50_mb_single_frame_bounded_memory(self) -> None:
        """Feeding 50 MB of one frame in 64 KiB reads keeps buffered_bytes small and stays fast."""
        limit = 1 << 20
        decoder = MllpDecoder(limit)
        chunk = b"x" * 65536
        total = 50 * 1024 * 1024
        started = time.monotonic()
        assert decoder.feed(b"\x0bMSH|") == []
        fed = 4
        peak = 0
        while fed < total:
            assert decoder.feed(chunk) == []
            fed += len(chunk)
            peak = max(peak, decoder.buffered_bytes())
            if fed > limit + len(chunk):
                assert decoder.buffered_bytes() <= OVERSIZE_PREFIX_BYTES
        assert peak <= limit
        assert decoder.mid_frame
        events = decoder.feed(END_BLOCK)
        assert len(events) == 1
        event = events[0]
        assert isinstance(event, OversizeFrame)
        assert event.size == fed
        assert event.prefix.startswith(b"MSH|")
        assert len(event.prefix) == OVERSIZE_PREFIX_BYTES
        assert decoder.buffered_bytes() == 0
        assert time.monotonic() - started < 5.0

    def test_big_frame_in_small_chunks_is_linear(self) -> None:
        """A 1 MB frame fed in 100-byte reads decodes quickly (no re-scanning of the buffer)."""
        payload = b"MSH|" + b"y" * (1 << 20)
        data = encode_frame(payload)
        decoder = MllpDecoder(2 << 20)
        started = time.monotonic()
        events: list[Event] = []
        for i in range(0, len(data), 100):
            events.extend(decoder.feed(data[i : i + 100]))
        assert events == [Frame(payload)]
        assert time.monotonic() - started < 5.0

    def test_many_vt_in_one_chunk_is_linear(self) -> None:
        """A chunk of many VT restarts and no end is handled without quadratic re-scans."""
        data = b"\x0ba" * 50_000
        decoder = MllpDecoder(100)
        started = time.monotonic()
        events = decoder.feed(data)
        assert junk(events) == len(data) - 2
        assert decoder.mid_frame
        assert time.monotonic() - started < 5.0

    def test_rejects_nonpositive_limit(self) -> None:
        """A zero limit is a programming error."""
        with pytest.raises(ValueError):
            MllpDecoder(0)


def reference_decode(stream: bytes, limit: int) -> list[tuple[str, bytes, int]]:
    """A byte-at-a-time reference model of the framing rules, for comparison."""
    out: list[tuple[str, bytes, int]] = []
    in_frame = False
    payload = bytearray()
    i = 0
    while i < len(stream):
        byte = stream[i]
        if not in_frame:
            if byte == 0x0B:
                in_frame = True
                payload = bytearray()
        elif byte == 0x0B:
            payload = bytearray()
        elif byte == 0x1C and i + 1 < len(stream) and stream[i + 1] == 0x0D:
            if len(payload) > limit:
                out.append(
                    ("oversize", bytes(payload[: min(limit, OVERSIZE_PREFIX_BYTES)]), len(payload))
                )
            else:
                out.append(("frame", bytes(payload), len(payload)))
            in_frame = False
            i += 1
        else:
            payload.append(byte)
        i += 1
    return out


class TestRandomised:
    def test_matches_reference_under_random_chunking(self) -> None:
        """Random streams of frames, junk, restarts and stray FS decode like the reference model."""
        rng = random.Random(20240115)
        alphabet = [b"a", b"|", b"\r", b"\n", b"\x0b", b"\x1c", b"\x1c\r"]
        weights = [40, 10, 5, 5, 3, 3, 4]
        for _ in range(300):
            stream = b"".join(rng.choices(alphabet, weights, k=rng.randint(0, 80)))
            limit = rng.randint(1, 20)
            expected = reference_decode(stream, limit)
            decoder = MllpDecoder(limit)
            got: list[tuple[str, bytes, int]] = []
            skipped = 0
            pos = 0
            while pos < len(stream):
                step = rng.randint(1, 7)
                for event in decoder.feed(stream[pos : pos + step]):
                    if isinstance(event, Frame):
                        got.append(("frame", event.payload, len(event.payload)))
                    elif isinstance(event, OversizeFrame):
                        got.append(("oversize", event.prefix, event.size))
                    else:
                        skipped += event.count
                pos += step
            assert got == expected, stream
            if not decoder.mid_frame:
                # Every byte is accounted for: framed payloads, framing, junk.
                assert skipped + sum(size + 3 for _, _, size in got) == len(stream), stream


# -- properties (hypothesis) ---------------------------------------------------

PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
# Streams made of what framing is about, plus any byte at all.
STREAM_BYTES = st.lists(
    st.one_of(st.sampled_from([b"a", b"|", b"\r", b"\n", b"\x0b", b"\x1c", b"\x1c\r", b"MSH|"]), st.binary(max_size=4)),
    max_size=60,
).map(b"".join)


class TestFramerProperties:
    @PROPERTY
    @given(STREAM_BYTES, st.integers(1, 24), st.lists(st.integers(1, 9), min_size=1, max_size=20))
    def test_any_stream_any_chunking_decodes_like_the_reference(
        self, stream: bytes, limit: int, steps: list[int]
    ) -> None:
        """However a stream is split into reads, the events are the reference model's and every byte is accounted for."""
        decoder = MllpDecoder(limit)
        got: list[tuple[str, bytes, int]] = []
        skipped = 0
        pos = 0
        index = 0
        while pos < len(stream):
            step = steps[index % len(steps)]
            index += 1
            for event in decoder.feed(stream[pos : pos + step]):
                if isinstance(event, Frame):
                    got.append(("frame", event.payload, len(event.payload)))
                elif isinstance(event, OversizeFrame):
                    got.append(("oversize", event.prefix, event.size))
                else:
                    skipped += event.count
            pos += step
            # Memory stays bounded whatever the input.
            assert decoder.buffered_bytes() <= min(limit, OVERSIZE_PREFIX_BYTES)
        assert got == reference_decode(stream, limit)
        if not decoder.mid_frame:
            assert skipped + sum(size + 3 for _, _, size in got) == len(stream)

    @PROPERTY
    @given(st.binary(max_size=200))
    def test_any_ack_bytes_make_exactly_one_frame(self, ack: bytes) -> None:
        """encode_ack_frame of any bytes decodes as one frame, no junk, nothing left pending."""
        decoder = MllpDecoder(1 << 20)
        events = decoder.feed(encode_ack_frame(ack))
        assert events == [Frame(frame_safe(ack))]
        assert not decoder.mid_frame

    @PROPERTY
    @given(st.binary(max_size=200).filter(lambda p: b"\x0b" not in p and b"\x1c\r" not in p))
    def test_encode_frame_round_trips_every_payload_a_sender_can_send(self, payload: bytes) -> None:
        """A payload that can arrive in a frame (no VT, no FS CR) re-frames byte for byte (hand-over)."""
        assert MllpDecoder(1 << 20).feed(encode_frame(payload)) == [Frame(payload)]

"""Properties of intake over a real socket: raw byte streams through the shell's own reads.

Driven through ``intakefuzz.SocketHarness`` (the real listener on
127.0.0.1, the real Writer thread, SQLite in tmp_path): whatever a stream
holds — frames, junk, restarts, oversize frames, damaged messages — the
connection keeps serving (a good message after it is still accepted), no
exception reaches the last resort, and every ACK reaches the sender as one
clean frame. The per-frame properties run without a loop against the
intake core itself (tests/unit/test_intake_properties.py); these are the
ones only the shell can break (reads split anywhere, pauses, the writes).
Bounded for the default run: no per-example deadline (a loaded 2-core
machine fsyncs slowly); ``HL7_PROPERTY_EXAMPLES`` raises the count.
"""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from intakefuzz import (
    CORPUS,
    MAX_MESSAGE_BYTES,
    SocketHarness,
    check_handled,
    check_streamed,
    expected,
    raw_streams,
)

EXAMPLES = int(os.environ.get("HL7_PROPERTY_EXAMPLES", "150"))
PROPERTY = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)


class TestFrameHandlerOverASocket:
    def test_raw_streams_keep_the_connection_serving(self, tmp_path: Path) -> None:
        """Any byte stream (frames, junk, restarts, oversize) is followed by a good message that is still accepted."""
        with SocketHarness(tmp_path / "data", max_message_bytes=MAX_MESSAGE_BYTES) as harness:

            @PROPERTY
            @given(raw_streams())
            def inner(data: bytes) -> None:
                check_streamed(data, harness.stream(data), MAX_MESSAGE_BYTES)

            inner()

    def test_undamaged_corpus_is_accepted(self, tmp_path: Path) -> None:
        """Each real message sent over the wire is accepted and committed once; an inbound ACK is recorded."""
        with SocketHarness(tmp_path / "data", max_message_bytes=MAX_MESSAGE_BYTES) as harness:
            for payload in CORPUS:
                handled = harness.handle(payload)
                check_handled(payload, handled)
                want = expected(payload)
                if want.acceptable and not want.waivable:
                    assert handled.accepted and handled.stored == 1, payload

"""Properties of the whole frame handler, on arbitrary bytes and on damaged real messages, without a loop.

Driven through ``intakefuzz.CoreHarness``: the intake core with the real
store on SQLite in tmp_path, every action applied at once — no event loop,
no socket, no thread. For every frame: no exception reaches the last
resort, a malformed frame is never accepted (AA/CA only with the row
committed), a readable MSH is always answered (except an inbound ACK and
where MSH-15 waives it), a frame with no MSH never is, every frame that is
not accepted leaves one audit row, and every ACK is written as one clean
frame. A few hundred examples per property by default
(``HL7_PROPERTY_EXAMPLES`` raises the count); the same properties over a
real socket are in tests/integration/test_frame_handler_properties.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from intakefuzz import (
    CORPUS,
    MAX_MESSAGE_BYTES,
    CoreHarness,
    Handled,
    check_handled,
    check_streamed,
    expected,
    payloads,
    raw_streams,
)

EXAMPLES = int(os.environ.get("HL7_PROPERTY_EXAMPLES", "400"))
PROPERTY = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)
def check(payload: bytes, handled: Handled, *, label: bool = True) -> None:
    """Every property of one handled frame payload (``label``: record the outcome in hypothesis' statistics)."""
    check_handled(payload, handled)
    if label:
        event(f"answer {handled.codes or 'none'}, {'stored' if handled.stored else 'audited'}")


def run_property(tmp_path: Path, strategy: st.SearchStrategy[bytes],
                 prop: Callable[[CoreHarness, bytes], None]) -> None:
    """One harness for every example of a property (a fixture would be per test, not per example)."""
    with CoreHarness(tmp_path / "data", max_message_bytes=MAX_MESSAGE_BYTES) as harness:

        @PROPERTY
        @given(strategy)
        def inner(data: bytes) -> None:
            prop(harness, data)

        inner()


class TestIntakeCoreProperties:
    def test_arbitrary_and_mutated_frames(self, tmp_path: Path) -> None:
        """Arbitrary bytes and damaged real messages: never an exception, never a wrong or missing answer."""
        run_property(tmp_path, payloads(), lambda h, payload: check(payload, h.handle(payload)))

    def test_undamaged_corpus_is_accepted(self, tmp_path: Path) -> None:
        """The oracle itself is sound: each real message is accepted and committed, an inbound ACK recorded."""
        with CoreHarness(tmp_path / "data", max_message_bytes=MAX_MESSAGE_BYTES) as harness:
            for payload in CORPUS:
                handled = harness.handle(payload)
                check(payload, handled, label=False)
                want = expected(payload)
                assert want.acceptable != want.is_ack
                if want.acceptable and not want.waivable:
                    assert handled.accepted and handled.stored == 1, payload

    def test_raw_streams_keep_the_connection_serving(self, tmp_path: Path) -> None:
        """Any byte stream (frames, junk, restarts, oversize) is followed by a good message that is still accepted."""

        def prop(harness: CoreHarness, data: bytes) -> None:
            check_streamed(data, harness.stream(data), MAX_MESSAGE_BYTES)

        run_property(tmp_path, raw_streams(), prop)

"""Hostile input for intake, and the harnesses that drive the whole frame handler.

Used by the property tests (tests/unit/test_intake_properties.py,
tests/integration/test_frame_handler_properties.py) and by the long fuzz run
(bench/fuzz_intake.py). Three parts:

- ``mutate`` / ``mutated_message``: real messages (tests/data/*.hl7 and the
  tests/agenttest.py samples) damaged the ways senders and attackers damage
  them: MLLP block bytes and NULs inside fields, odd separators, MSH-18 naming
  Python transforms, MSH-15/16 values, truncation, wide encodings.
- ``CoreHarness``: the intake core (``agent.core.intake.IntakeConnection``)
  with the real store on SQLite in a temporary folder, driven without an
  event loop, a socket or a thread: each action is applied at once (a commit
  is a real transaction). ``handle`` gives the core one frame payload as the
  framer would — any bytes, even ones no sender can frame — and decodes the
  ACK frames it asks to write; ``stream`` gives it raw stream bytes and
  reads every ACK until a sentinel's.
- ``SocketHarness``: the same over the real shell — a ``ChannelListener`` on
  127.0.0.1, the real Writer thread, a client socket — for what only the
  shell does (reads, pauses, the timing of writes).

Everything the properties need comes out of ``Handled``/``Streamed``.
"""

from __future__ import annotations

import asyncio
import random
import socket
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

from agenttest import SAMPLE_ADT, hl7_message, until
from hypothesis import strategies as st
from structlog.testing import capture_logs

from agent.app.config import ChannelSettings
from agent.core import charsets, envelope, mllp
from agent.core.acks import read_ack_code
from agent.core.batch import is_batch, split_batch
from agent.core.intake import IntakeConnection
from agent.core.intake_actions import Commit, Send
from agent.core.intake_types import Audit, Log, RecordOutcome
from agent.errors import EnvelopeError, StorageError, UnsupportedCharset
from agent.runtime.mllp_connection import audit_item, intake_item
from agent.runtime.mllp_server import ChannelListener, IntakeContext, channel_policy
from agent.runtime.relay import AckRelay
from agent.storage import sqlite as db
from agent.storage.store import SqliteStore
from agent.storage.writer import Writer

DATA_DIR = Path(__file__).resolve().parent / "data"

# -- the corpus ----------------------------------------------------------------


def corpus() -> list[bytes]:
    """Real messages: the tests/data samples and the agenttest ones, in their modes."""
    # Batch samples have batch properties of their own (tests/integration/test_batches.py).
    messages = [path.read_bytes() for path in sorted(DATA_DIR.glob("*.hl7")) if not path.name.startswith("batch_")]
    messages.append(SAMPLE_ADT.format(cid="SAMPLE-1", pid="777").encode())
    for msh15, msh16 in (("", ""), ("AL", "AL"), ("NE", "AL"), ("ER", "NE"), ("SU", "ER"), ("AL", "")):
        messages.append(hl7_message(f"C-{msh15 or 'x'}-{msh16 or 'x'}", msh15=msh15, msh16=msh16))
    messages.append(hl7_message("V23", version="2.3"))
    messages.append(hl7_message("V27", version="2.7"))
    ack = b"MSH|^~\\&|EHR|CENTRAL|LAB|NORTH|20260101||ACK^A01^ACK|A-1|P|2.5.1\rMSA|AA|X-1\r"
    messages.append(ack)
    return messages


CORPUS = corpus()

#: Bytes that break things: the MLLP block bytes, segment ends, NUL, delimiters, high bytes.
NASTY_BYTES = b"\x00\x0b\x1c\r\n|^~\\&#\xff\xfe\xef\xbb\xbf\x80\x7f \t"

#: Values for MSH-18: table 0211 names, Python transforms and other codecs, junk.
CHARSET_VALUES = (
    "", "8859/1", "UNICODE UTF-8", "ASCII", "ISO IR87", "SJIS", "GB 18030-2000", "BIG-5", "KS X 1001",
    "UNICODE UTF-16", "UNICODE", "utf-16", "utf-32-le", "latin-1", "utf8", "idna", "punycode", "rot13",
    "base64", "zlib", "uu", "hex", "bz2", "quopri", "raw_unicode_escape", "unicode_escape", "utf-7",
    "cp500", "cp1252", "mbcs", "undefined", "a\x00b", "\x00", "UTF\x1c8", "8859/1\x0b", "x" * 300,
    "..", "encodings.idna", "8859/1~idna", "idna~8859/1",
)
ACK_TYPES = ("", "AL", "NE", "ER", "SU", "al", "XX", "A\x1c")
#: Values for other MSH fields: each a way a header goes wrong.
FIELD_VALUES = (
    "", "ACK", "ACK^A01", "ADT^A01^ADT_A01", "^^^", "2.5.1\x1c", "2.1", "2.9", "P", "T^A", "X" * 200,
    "\x1c", "\x0b", "\x00", "\\X1C\\", "\\", "&", "~", "\xff\xfe", "MSH|", "\x1c\x1c",
)


def _msh_bounds(message: bytes) -> tuple[int, int]:
    end = len(message)
    for stop in (b"\r", b"\n"):
        found = message.find(stop)
        if 0 <= found < end:
            end = found
    return 0, end


def _set_msh_field(message: bytes, number: int, value: bytes) -> bytes:
    """MSH-``number`` replaced by ``value`` (fields padded), on raw bytes with the message's own separator."""
    start, end = _msh_bounds(message)
    msh = message[start:end]
    if len(msh) < 4 or not msh.startswith(b"MSH"):
        return message
    sep = msh[3:4]
    fields = msh.split(sep)
    if number < 2:
        return message
    while len(fields) < number:
        fields.append(b"")
    fields[number - 1] = value
    return message[:start] + sep.join(fields) + message[end:]


def mutate(rng: random.Random, message: bytes, steps: int) -> bytes:
    """``message`` damaged by ``steps`` random operations (deterministic for a given ``rng``)."""
    data = bytearray(message)
    for _ in range(steps):
        op = rng.randrange(14)
        pos = rng.randint(0, len(data))
        if op == 0:
            data[pos:pos] = bytes([rng.choice(NASTY_BYTES)])
        elif op == 1 and data:
            data[min(pos, len(data) - 1)] = rng.randrange(256)
        elif op == 2 and data:
            del data[pos : pos + rng.randint(1, 8)]
        elif op == 3:
            data[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 6)))
        elif op == 4:
            data = bytearray(_set_msh_field(bytes(data), 18, rng.choice(CHARSET_VALUES).encode("latin-1")))
        elif op == 5:
            data = bytearray(_set_msh_field(bytes(data), rng.choice((15, 16)), rng.choice(ACK_TYPES).encode("latin-1")))
        elif op == 6:
            number = rng.choice((2, 3, 4, 5, 6, 9, 10, 11, 12, 13))
            data = bytearray(_set_msh_field(bytes(data), number, rng.choice(FIELD_VALUES).encode("latin-1")))
        elif op == 7:
            data = bytearray(bytes(data).replace(b"\r", rng.choice((b"\n", b"\r\n", b"\r\r", b"\x1c"))))
        elif op == 8:
            data = data[: rng.randint(0, len(data))]
        elif op == 9:
            data[0:0] = rng.choice((b"\xef\xbb\xbf", b"\r\n", b"  ", b"\x00", b"\x1c", b"\x0b"))
        elif op == 10 and len(data) > 3:
            # another field separator, kept consistent or not
            sep = rng.choice(b"|#!\x00\x1c\x0b a^")
            old = data[3]
            data = bytearray(bytes(data).replace(bytes([old]), bytes([sep]))) if rng.random() < 0.7 else data
            data[3] = sep
        elif op == 11:
            segment = bytes(data).split(b"\r")
            data = bytearray(b"\r".join(segment + segment[1:2] * rng.randint(1, 3)))
        elif op == 12:
            codec = rng.choice(("utf-16", "utf-16-le", "utf-32", "utf-8"))
            data = bytearray(bytes(data).decode("latin-1").encode(codec))
        else:
            data[pos:pos] = rng.choice((b"\x1c", b"\x1c\x1c", b"\x1c\n", b"\x00", "\u00e9".encode(), b"\xe9"))
    return bytes(data)


# -- hypothesis strategies (the property tests share them) ---------------------------

#: The frame limit the property tests and the fuzz run configure.
MAX_MESSAGE_BYTES = 4096


def mutated_messages() -> st.SearchStrategy[bytes]:
    """A real message from the corpus, damaged by 0-6 random operations."""
    return st.builds(
        lambda seed, index, steps: mutate(random.Random(seed), CORPUS[index % len(CORPUS)], steps),
        st.integers(0, 2**32 - 1), st.integers(0, len(CORPUS) - 1), st.integers(0, 6),
    )


def payloads() -> st.SearchStrategy[bytes]:
    nasty = st.binary(max_size=300).map(lambda b: bytes(NASTY_BYTES[x % len(NASTY_BYTES)] for x in b))
    msh_prefixed = st.binary(max_size=300).map(lambda b: b"MSH" + b)
    return st.one_of(mutated_messages(), st.binary(max_size=600), nasty, msh_prefixed)


def raw_streams() -> st.SearchStrategy[bytes]:
    """Frames, junk, restarts and oversize frames, in any order."""
    pieces = st.one_of(
        mutated_messages().map(mllp.encode_frame),
        st.binary(max_size=200),
        st.sampled_from([b"\x0b", b"\x1c", b"\x1c\r", b"\r", b"\x0b\x1c\r"]),
        st.integers(MAX_MESSAGE_BYTES - 8, MAX_MESSAGE_BYTES + 64).map(
            lambda n: mllp.encode_frame(b"MSH|^~\\&|A|B|C|D|||ADT^A01|BIG|P|2.5|" + b"x" * n)),
    )
    return st.lists(pieces, max_size=6).map(b"".join)


# -- the oracle: what the contract says the handler must do with one payload ---


@dataclass(frozen=True)
class Expected:
    """What a frame payload is, read independently of the handler's own path."""

    has_msh: bool  # the MSH can be read at all: an ACK is owed (unless waived or an ACK)
    is_ack: bool  # an inbound ACK: never answered
    waivable: bool  # MSH-15 is NE/ER/SU: the commit ACK may rightly be absent
    acceptable: bool  # MSH, separators, required fields, charset and bytes all good


def expected(payload: bytes, channel_encoding: str = "utf-8") -> Expected:
    wide = charsets.sniff_wide_encoding(payload)
    if wide is not None:
        try:
            envelope.read_msh(payload)
        except envelope.NoMshSegment:
            # UTF-16/32: its MSH can be read, so it is answered (a reject) unless MSH-15 waives it.
            env = envelope.read_wide_msh(payload, wide)
            waivable = env is not None and env.accept_ack_type.strip().upper() in ("NE", "ER", "SU")
            return Expected(True, False, waivable, False)
        except EnvelopeError:
            pass
    try:
        env: envelope.Envelope | None = envelope.read_msh(payload)
    except envelope.NoMshSegment:
        return _expected_msh_not_first(payload)
    except envelope.MalformedMsh as exc:
        partial = exc.partial
        waivable = partial is not None and partial.accept_ack_type.strip().upper() in ("NE", "ER", "SU")
        return Expected(True, partial is not None and partial.is_ack, waivable, False)
    assert env is not None
    waivable = env.accept_ack_type.strip().upper() in ("NE", "ER", "SU")
    try:
        charsets.decode_message(payload, charsets.resolve_codec(env.charset, channel_encoding))
        decodable = True
    except (EnvelopeError, UnsupportedCharset):
        decodable = False
    return Expected(True, env.is_ack, waivable, decodable and not env.is_ack)


def _expected_msh_not_first(payload: bytes) -> Expected:
    """No MSH at the start: the earliest MSH after a segment end is read, as a reject (never acceptable)."""
    starts = [at + 1 for at in (payload.find(b"\rMSH"), payload.find(b"\nMSH")) if at >= 0]
    if not starts:
        return Expected(False, False, False, False)
    try:
        env = envelope.read_msh(payload[min(starts):])
    except envelope.NoMshSegment:
        return Expected(False, False, False, False)
    except envelope.MalformedMsh as exc:
        env = exc.partial
    if env is None:
        return Expected(True, False, False, False)
    return Expected(True, env.is_ack, env.accept_ack_type.strip().upper() in ("NE", "ER", "SU"), False)


def ack_problems(ack: bytes) -> list[str]:
    """What is wrong with one ACK payload as the sender reads it ([] when it is a good ACK).

    An ACK batch (the answer to a frame that is an HL7 batch) is good when each of its ACKs is.
    """
    answer = split_batch(ack)
    if answer is not None:
        if answer.problem is not None:
            return [f"ACK batch malformed: {answer.problem}"]
        if b"\x0b" in ack or b"\x1c" in ack or b"\n" in ack:
            return ["MLLP block byte or LF inside the ACK batch"]
        return [p for member in answer.members for p in ack_problems(member)]
    problems = []
    if b"\x0b" in ack or b"\x1c" in ack:
        problems.append("MLLP block byte inside the ACK")
    if not ack.startswith(b"MSH"):
        problems.append("ACK does not start with MSH")
    if b"\n" in ack:
        problems.append("LF inside the ACK")
    code = read_ack_code(ack)
    if code not in ("AA", "AE", "AR", "CA", "CE", "CR"):
        problems.append(f"MSA-1 {code!r} is no table 0008 code")
    return problems


def check_handled(payload: bytes, handled: Handled) -> None:
    """Every property of one handled frame payload (AssertionError names the broken one)."""
    assert handled.failed == [], f"the handler raised {handled.failed} (last resort used)"
    # Every ACK written is one clean frame the sender reads as such.
    assert handled.wire_junk == 0, "the sender had to skip bytes between ACK frames"
    assert handled.wire_frames == [mllp.frame_safe(a) for a in handled.acks], "ACK frames on the wire differ"
    for ack in handled.wire_frames:
        assert ack_problems(ack) == [], (ack_problems(ack), ack)
    assert len(handled.acks) <= 1, "more than one answer to one frame (commit mode)"
    if is_batch(payload):  # an HL7 batch: one ACK batch at most (its own properties: test_batches.py)
        return
    want = expected(payload)
    if handled.stored:
        # Committed (now, or by an earlier identical frame): only a well-formed
        # frame, answered with an accept if at all, and no audit row.
        assert want.acceptable, "a malformed frame was committed"
        assert handled.stored == 1, "one body, one row (dedupe)"
        assert all(code in ("AA", "CA") for code in handled.codes), "a committed frame got a reject"
        assert handled.audited == 0, "a committed frame also left an audit row"
    else:
        # Never accept what was not committed; keep an audit row of it.
        assert not handled.accepted, "an accept ACK for a frame that is not committed"
        assert handled.audited == 1, "a frame that was not accepted left no audit row"
    if not want.has_msh:
        assert handled.acks == [], "a frame without MSH was answered"
    elif want.is_ack:
        assert handled.acks == [], "an inbound ACK was answered"
    elif not want.waivable:
        assert len(handled.acks) == 1, "a readable MSH got no ACK"


def check_streamed(data: bytes, out: Streamed, limit: int) -> None:
    """Properties of raw stream bytes: the connection still serves, every ACK is one clean frame."""
    assert out.failed == [], f"the handler raised {out.failed} (last resort used)"
    assert out.wire_junk == 0, "the sender had to skip bytes between ACK frames"
    for ack in (*out.frames, out.sentinel_ack):
        assert ack_problems(ack) == [], (ack_problems(ack), ack)
    handled = [e for e in frames_in(data, limit) if isinstance(e, (mllp.Frame, mllp.OversizeFrame))]
    assert len(out.frames) <= len(handled), "more ACKs than frames"


# -- the harnesses -------------------------------------------------------------

_sentinels = count(1)


@dataclass
class Handled:
    """What one frame payload produced."""

    acks: list[bytes]  # the ACK payloads the handler asked to write, one per write
    wire_frames: list[bytes]  # the frames the sender decoded off those writes
    wire_junk: int  # bytes the sender's decoder had to skip (0 for well-formed frames)
    failed: list[str]  # frame_handling_failed error types (the last resort was needed)
    audited: int  # audit (nacked) rows added
    stored: int  # live rows holding exactly these bytes

    @property
    def codes(self) -> list[str | None]:
        return [read_ack_code(a) for a in self.acks]

    @property
    def accepted(self) -> bool:
        return any(code in ("AA", "CA") for code in self.codes)


@dataclass
class Streamed:
    """What a stretch of raw stream bytes produced, up to a sentinel message's ACK."""

    frames: list[bytes]  # ACK frames read before the sentinel's
    sentinel_ack: bytes
    wire_junk: int
    failed: list[str]
    logs: list[dict[str, Any]] = field(default_factory=list)


def _decode(data: bytes) -> tuple[list[bytes], int]:
    """The frames a sender decodes from ``data``, and the bytes it skips."""
    frames, junk = [], 0
    for event in mllp.MllpDecoder(1 << 24).feed(data):
        if isinstance(event, mllp.Frame):
            frames.append(event.payload)
        elif isinstance(event, mllp.JunkSkipped):
            junk += event.count
        else:
            junk += event.size
    return frames, junk


def _first_frame(write: bytes) -> bytes:
    """The ACK payload inside one write (the write itself if it holds no frame: a broken write)."""
    frames, _ = _decode(write)
    return frames[0] if frames else write


class _Rows:
    """Counting rows, read-only, beside the store."""

    def __init__(self, db_path: Path) -> None:
        self.db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=10)

    def nacked(self) -> int:
        return int(self.db.execute("SELECT count(*) FROM messages WHERE state = 'nacked'").fetchone()[0])

    def stored(self, payload: bytes) -> int:
        row = self.db.execute("SELECT count(*) FROM messages WHERE state <> 'nacked' AND body = ?", (payload,)).fetchone()
        return int(row[0])

    def close(self) -> None:
        self.db.close()


class _ManualClock:
    """The core's clock, moved by the harness (the junk pause passes at once)."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return time.time()


class CoreHarness:
    """The intake core and the real store, no loop, socket or thread; see the module docstring."""

    def __init__(self, data_dir: Path, **channel: Any) -> None:
        self.data_dir = data_dir
        self.channel = ChannelSettings(name="fuzz", listen="127.0.0.1:0", **channel)
        self.policy = channel_policy(self.channel, 30.0)
        self.db_path = data_dir / "queue.db"
        self.clock = _ManualClock()

    def __enter__(self) -> CoreHarness:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # No fsync per commit (WAL, NORMAL): these properties are about answers, not power loss
        # (durability has its own tests); the fuzz run gets through far more inputs.
        conn = db.open_database(self.db_path, "harness", db.DatabaseOptions(synchronous="normal"), time.time())
        self.store = SqliteStore(conn, db.load_queries(), db_path=self.db_path)
        self.rows = _Rows(self.db_path)
        self._connect()
        return self

    def __exit__(self, *exc: object) -> None:
        if hasattr(self, "rows"):
            self.rows.close()
        if hasattr(self, "store"):
            self.store.conn.close()

    def _connect(self) -> None:
        """A fresh connection: audit rows are bounded per connection and minute, each example gets its quota."""
        self.conn = IntakeConnection(self.policy, self.clock)

    def handle(self, payload: bytes) -> Handled:
        if not self.conn.audit_quota_left():
            self._connect()  # the bound itself is tested in tests/unit/test_intake_connection.py
        before = self.rows.nacked()
        self.conn._handle(mllp.Frame(payload))  # as the framer hands it over, whatever the bytes
        self.conn.step()
        writes, failed = self._drive()
        wire, junk = _decode(b"".join(writes))
        return Handled(acks=[_first_frame(w) for w in writes], wire_frames=wire,
                       wire_junk=junk, failed=failed, audited=self.rows.nacked() - before,
                       stored=self.rows.stored(payload))

    def stream(self, data: bytes) -> Streamed:
        cid = f"SENTINEL-{next(_sentinels)}"
        self.conn.receive_data(data + mllp.encode_frame(hl7_message(cid)))
        writes, failed = self._drive()
        frames, junk = _decode(b"".join(writes))
        marker = f"\rMSA|AA|{cid}|".encode()
        last = next((n for n, frame in enumerate(frames) if marker in frame), None)
        if last is None:
            raise AssertionError(f"the sentinel {cid} got no AA: {frames[-3:]!r}")
        if not self.conn.audit_quota_left():
            self._connect()
        return Streamed(frames=frames[:last], sentinel_ack=frames[last], wire_junk=junk, failed=failed,
                        logs=self._logs)

    def _drive(self) -> tuple[list[bytes], list[str]]:
        """Apply every action until the core has nothing left to do; the writes and the last-resort uses."""
        conn, store = self.conn, self.store
        writes: list[bytes] = []
        self._logs: list[dict[str, Any]] = []
        while True:
            actions = conn.next_actions()
            if not actions:
                if conn.more_to_do:
                    conn.step()
                    continue
                if conn._resume_at is not None:  # the junk pause: time passes at once here
                    self.clock.now = conn._resume_at
                    conn.tick()
                    continue
                break
            for action in actions:
                if isinstance(action, Send):
                    writes.append(action.frame)
                    conn.written(action, True)
                elif isinstance(action, Commit):
                    try:
                        with store.transaction():
                            results = [store.intake(intake_item("fuzz", "harness", m)) for m in action.items]
                    except StorageError as exc:
                        conn.commit_failed(action.ticket, exc)
                    else:
                        conn.commit_done(action.ticket, results)
                elif isinstance(action, Audit):
                    try:
                        with store.transaction():
                            store.record_audit(audit_item("fuzz", "harness", action.record))
                    except StorageError as exc:
                        conn.audit_done(str(exc))
                    else:
                        conn.audit_done()
                elif isinstance(action, RecordOutcome):
                    with store.transaction():
                        store.set_ack_outcome(action.message_id, action.outcome)
                elif isinstance(action, Log):
                    self._logs.append({"event": action.event, **action.fields})
        failed = [str(e.get("error_type")) for e in self._logs if e["event"] == "frame_handling_failed"]
        return writes, failed


class SocketHarness:
    """The whole shell over a real connection to a real listener; see the module docstring."""

    def __init__(self, data_dir: Path, **channel: Any) -> None:
        self.data_dir = data_dir
        self.channel = ChannelSettings(name="fuzz", listen="127.0.0.1:0", **channel)
        self.loop = asyncio.new_event_loop()
        self.db_path = data_dir / "queue.db"
        self._decoder = mllp.MllpDecoder(1 << 24)
        self._pending: list[bytes] = []
        self._junk = 0

    # -- lifecycle

    def __enter__(self) -> SocketHarness:
        conn = db.open_database(self.db_path, "harness", db.DatabaseOptions(), time.time())
        self.writer = Writer(SqliteStore(conn, db.load_queries(), db_path=self.db_path))
        self.writer.start()
        self.rows = _Rows(self.db_path)
        try:
            self.loop.run_until_complete(self._open())
        except BaseException:
            self.__exit__()
            raise
        return self

    async def _open(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.listener = ChannelListener(self.channel, self.sock, IntakeContext(writer=self.writer, relay=AckRelay(None)))
        await self.listener.start()
        await self._connect()

    async def _connect(self) -> None:
        """A fresh sender connection (also after an example broke the previous one)."""
        known = set(self.listener.connections)
        host, port = self.sock.getsockname()[:2]
        self.client_reader, self.client_writer = await asyncio.open_connection(host, port)
        await until(lambda: set(self.listener.connections) - known, 10, "the harness connection accepted")
        self.conn = next(iter(set(self.listener.connections) - known))
        self._decoder = mllp.MllpDecoder(1 << 24)
        self._pending = []

    def _run(self, coro: Any) -> Any:
        """Run one example; if it fails, start the next one on a new connection (so shrinking works)."""
        async def bounded() -> Any:
            async with asyncio.timeout(15):
                return await coro

        try:
            return self.loop.run_until_complete(bounded())
        except BaseException:
            async def reconnect() -> None:
                self.client_writer.close()
                self.conn.abort()
                await self._connect()

            self.loop.run_until_complete(reconnect())
            raise

    def __exit__(self, *exc: object) -> None:
        async def close() -> None:
            if hasattr(self, "client_writer"):
                self.client_writer.close()
            if hasattr(self, "listener"):
                self.listener.stop_accepting()
                self.listener.abort_connections()
                async with asyncio.timeout(10):
                    await self.listener.wait_connections_closed()

        try:
            self.loop.run_until_complete(close())
        finally:
            self.loop.close()
            if hasattr(self, "rows"):
                self.rows.close()
            if hasattr(self, "writer"):
                self.writer.close()

    # -- one payload, framed on the wire

    def handle(self, payload: bytes) -> Handled:
        """``payload`` as one frame over the socket (so it must frame as one), then a sentinel's."""
        assert [e for e in frames_in(mllp.encode_frame(payload), 1 << 24)] == [mllp.Frame(payload)], payload
        return self._run(self._handle(payload))  # type: ignore[no-any-return]

    async def _handle(self, payload: bytes) -> Handled:
        if not self.conn.core.audit_quota_left():
            self.client_writer.close()
            await self._connect()
        await self.writer.call(lambda _s: None)  # earlier audit rows committed before these are counted
        before = self.rows.nacked()
        cid = f"SENTINEL-{next(_sentinels)}"
        with capture_logs() as logs:
            self.client_writer.write(mllp.encode_frame(payload) + mllp.encode_frame(hl7_message(cid)))
            await self.client_writer.drain()
            marker = f"\rMSA|AA|{cid}|".encode()
            frames, junk = await self._read_until(lambda frame: marker in frame)
        await self.writer.call(lambda _s: None)
        return Handled(
            acks=frames[:-1], wire_frames=frames[:-1], wire_junk=junk,
            failed=[str(e.get("error_type")) for e in logs if e["event"] == "frame_handling_failed"],
            audited=self.rows.nacked() - before, stored=self.rows.stored(payload),
        )

    # -- raw stream bytes through the connection's own reads

    def stream(self, data: bytes) -> Streamed:
        return self._run(self._stream(data))  # type: ignore[no-any-return]

    async def _stream(self, data: bytes) -> Streamed:
        if not self.conn.core.audit_quota_left():
            self.client_writer.close()
            await self._connect()
        cid = f"SENTINEL-{next(_sentinels)}"
        sentinel = hl7_message(cid)
        with capture_logs() as logs:
            self.client_writer.write(data + mllp.encode_frame(sentinel))
            await self.client_writer.drain()
            marker = f"\rMSA|AA|{cid}|".encode()
            frames, junk = await self._read_until(lambda frame: marker in frame)
        return Streamed(
            frames=frames[:-1],
            sentinel_ack=frames[-1],
            wire_junk=junk,
            failed=[str(e.get("error_type")) for e in logs if e["event"] == "frame_handling_failed"],
            logs=logs,
        )

    # -- internals

    async def _read_until(self, last: Any) -> tuple[list[bytes], int]:
        """Frames the sender reads, up to and including the first for which ``last`` is true."""
        frames: list[bytes] = []
        self._junk = 0
        while True:
            while self._pending:
                frame = self._pending.pop(0)
                frames.append(frame)
                if last(frame):
                    return frames, self._junk
            data = await self.client_reader.read(1 << 16)
            if not data:
                raise ConnectionError("the agent closed the harness connection")
            for event in self._decoder.feed(data):
                if isinstance(event, mllp.Frame):
                    self._pending.append(event.payload)
                elif isinstance(event, mllp.JunkSkipped):
                    self._junk += event.count
                else:
                    self._junk += event.size


def frames_in(data: bytes, limit: int) -> Iterator[mllp.Event]:
    """The framer's events for a whole stream (what the handler is given)."""
    yield from mllp.MllpDecoder(limit).feed(data)

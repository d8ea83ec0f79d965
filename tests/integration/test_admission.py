"""Admission and per-connection bounds: idle connections never lock a channel out.

The daemon runs in process on port 0 (real sockets on 127.0.0.0/8, a real
SQLite file); senders are asyncio connections of the test. Several sender
addresses come from binding the client side to 127.0.0.2, 127.0.0.3, ...
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from agenttest import ack_code, db_rows, hl7_message, log_events, msa2, run_async, until
from structlog.testing import capture_logs

from agent.app.config import AdminSettings, AgentSettings, ChannelSettings, QueueSettings, Settings
from agent.app.service import Agent
from agent.core import mllp
from agent.core.intake import AUDIT_ROWS_PER_WINDOW, MAX_PENDING_RELAYS
from agent.runtime.mllp_connection import unread_bytes


def run_agent(tmp_path: Path, scenario: Callable[[Agent, int], Awaitable[None]], **channel: Any) -> None:
    """The daemon in process with one channel ``adt``; ``scenario(agent, port)``; then a clean stop."""

    async def main() -> None:
        settings = Settings(
            agent=AgentSettings(id="admission", data_dir=tmp_path / "data", shutdown_budget=5),
            admin=AdminSettings(listen=None), queue=QueueSettings(min_free_disk_bytes=0),
            channels=[ChannelSettings(name="adt", listen="127.0.0.1:0", **channel)],
        )
        agent = Agent(settings)
        await agent.start()
        try:
            await scenario(agent, agent.listeners[0].sock.getsockname()[1])
        finally:
            agent.stop_requested.set()
            await agent.shutdown()

    run_async(main(), timeout=90)


class Sender:
    """One asyncio MLLP connection of the test, from a chosen loopback address."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = mllp.MllpDecoder(1 << 20)
        self.acks: list[bytes] = []

    @classmethod
    async def open(cls, port: int, source: str = "127.0.0.1") -> Sender:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        return cls(reader, writer)

    async def send(self, data: bytes, *, raw: bool = False) -> None:
        self.writer.write(data if raw else mllp.encode_frame(data))
        await self.writer.drain()

    async def read_ack(self, timeout: float = 10.0) -> bytes:
        async with asyncio.timeout(timeout):
            while not self.acks:
                data = await self.reader.read(65536)
                if not data:
                    raise ConnectionError("closed by the agent")
                self.acks += [e.payload for e in self.decoder.feed(data) if isinstance(e, mllp.Frame)]
        return self.acks.pop(0)

    async def exchange(self, message: bytes) -> bytes:
        await self.send(message)
        return await self.read_ack()

    async def closed_by_agent(self, timeout: float = 10.0) -> bool:
        """True once the agent closed this connection (EOF or reset), False if still open at the deadline."""
        try:
            async with asyncio.timeout(timeout):
                while True:
                    data = await self.reader.read(65536)
                    if not data:
                        return True
                    self.acks += [e.payload for e in self.decoder.feed(data) if isinstance(e, mllp.Frame)]
        except TimeoutError:
            return False
        except ConnectionError:
            return True

    async def still_open(self) -> bool:
        """Nothing from the agent for a moment: neither an EOF nor bytes (a connection it kept)."""
        try:
            async with asyncio.timeout(0.3):
                data = await self.reader.read(1)
        except TimeoutError:
            return True
        except ConnectionError:
            return False
        return bool(data)

    def close(self) -> None:
        self.writer.close()


def listener_connections(agent: Agent) -> int:
    return len(agent.listeners[0].connections)


class TestEviction:
    def test_64_idle_connections_do_not_lock_the_default_channel_out(self, tmp_path: Path) -> None:
        """With the defaults, 64 connections that send nothing no longer shut out a real sender: the oldest idle one is closed for it."""

        async def scenario(agent: Agent, port: int) -> None:
            # max_connections_per_source (16) would evict within one address
            # first: spread the idle ones over 8 addresses, 8 each.
            idle = [await Sender.open(port, f"127.0.0.{2 + n % 8}") for n in range(64)]
            await until(lambda: listener_connections(agent) == 64, what="64 connections open")
            sender = await Sender.open(port, "127.0.1.1")
            try:
                assert ack_code(await sender.exchange(hl7_message("AFTER-IDLE"))) == "AA"
                assert await idle[0].closed_by_agent(), "the longest-idle connection was not closed"
                assert all([await conn.still_open() for conn in idle[1:4]])
                assert listener_connections(agent) == 64
            finally:
                for conn in [*idle, sender]:
                    conn.close()

        with capture_logs() as logs:
            run_agent(tmp_path, scenario)
        evicted = log_events(logs, "connection_evicted")
        assert len(evicted) == 1
        assert evicted[0]["limit"] == "max_connections"
        assert evicted[0]["peer"].startswith("127.0.0.2:")
        assert evicted[0]["for_peer"].startswith("127.0.1.1:")
        assert not log_events(logs, "connection_refused_limit")

    def test_the_longest_idle_connection_goes_not_the_oldest(self, tmp_path: Path) -> None:
        """Idle is measured from the last frame or ACK: a connection that just sent a message stays, the one silent longest goes."""

        async def scenario(agent: Agent, port: int) -> None:
            first, second, third = [await Sender.open(port, f"127.0.0.{n}") for n in (2, 3, 4)]
            await until(lambda: listener_connections(agent) == 3, what="3 connections open")
            assert ack_code(await first.exchange(hl7_message("FIRST-ACTIVE"))) == "AA"
            newcomer = await Sender.open(port, "127.0.0.5")
            try:
                assert ack_code(await newcomer.exchange(hl7_message("NEWCOMER"))) == "AA"
                assert await second.closed_by_agent()
                assert await first.still_open() and await third.still_open()
                assert ack_code(await first.exchange(hl7_message("FIRST-AGAIN"))) == "AA"
            finally:
                for conn in (first, second, third, newcomer):
                    conn.close()

        run_agent(tmp_path, scenario, max_connections=3)

    def test_a_connection_whose_next_frame_has_arrived_is_not_idle(self, tmp_path: Path) -> None:
        """A frame in the kernel's buffer that the loop has not read yet makes its connection busy, not evictable.

        Under a connect flood a sender's frame often waits there while the
        loop admits newcomers; evicting it then cut the sender off with the
        frame in flight. The wait is made certain here by pausing the
        agent's reading of that connection (the loop "has not got to it").
        """

        async def scenario(agent: Agent, port: int) -> None:
            sender = await Sender.open(port)
            await until(lambda: listener_connections(agent) == 1, what="the connection open")
            (conn,) = agent.listeners[0].connections
            assert conn._transport is not None
            conn._transport.pause_reading()
            await sender.send(hl7_message("IN-THE-BUFFER"))
            await until(lambda: unread_bytes(conn._transport.get_extra_info("socket")) > 0,
                        what="the frame in the kernel's buffer")
            newcomer = await Sender.open(port, "127.0.0.2")
            try:
                assert await newcomer.closed_by_agent(), "the newcomer was admitted"
                conn._transport.resume_reading()
                assert ack_code(await sender.read_ack()) == "AA"
            finally:
                sender.close()
                newcomer.close()

        with capture_logs() as logs:
            run_agent(tmp_path, scenario, max_connections=1)
        assert log_events(logs, "connection_evicted") == []
        assert len(log_events(logs, "connection_refused_limit")) == 1

    def test_bytes_outside_frames_do_not_count_as_activity(self, tmp_path: Path) -> None:
        """A connection trickling junk outside any frame is as idle as a silent one: it is the one evicted."""

        async def scenario(agent: Agent, port: int) -> None:
            junk = await Sender.open(port, "127.0.0.2")
            quiet = await Sender.open(port, "127.0.0.3")
            await until(lambda: listener_connections(agent) == 2, what="2 connections open")
            assert ack_code(await quiet.exchange(hl7_message("QUIET"))) == "AA"
            for _ in range(5):
                await junk.send(b"junk\r\n", raw=True)
                await asyncio.sleep(0.02)  # a trickle, not a sync point: the agent sees separate reads
            newcomer = await Sender.open(port, "127.0.0.4")
            try:
                assert ack_code(await newcomer.exchange(hl7_message("NEWCOMER"))) == "AA"
                assert await junk.closed_by_agent()
                assert await quiet.still_open()
            finally:
                for conn in (junk, quiet, newcomer):
                    conn.close()

        run_agent(tmp_path, scenario, max_connections=2)


class TestResetConnections:
    def test_a_reset_connection_holding_an_application_ack_frees_its_place_at_once(self, tmp_path: Path) -> None:
        """A sender that resets while its application ACK is held (original mode, no server) no longer counts
        against max_connections until application_ack_timeout: its place goes to the next sender at once, and
        the held ACK is recorded undelivered (replayed on retransmit)."""

        async def scenario(agent: Agent, port: int) -> None:
            gone = await Sender.open(port)
            await gone.send(hl7_message("HELD-THEN-RESET"))
            await until(lambda: db_rows(tmp_path / "data" / "queue.db",
                                        "SELECT 1 FROM messages WHERE control_id = 'HELD-THEN-RESET'"),
                        what="the held message committed")
            sock = gone.writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
            gone.close()
            await until(lambda: listener_connections(agent) == 0, timeout=5, what="the reset connection gone")
            newcomer = await Sender.open(port)
            try:
                await newcomer.send(hl7_message("NEXT"))
                assert not await newcomer.closed_by_agent(0.5), "the newcomer was refused"
            finally:
                newcomer.close()
            await until(lambda: db_rows(tmp_path / "data" / "queue.db",
                                        "SELECT ack_outcome FROM messages WHERE control_id = 'HELD-THEN-RESET'")
                        == [("undelivered",)], what="the held ACK recorded undelivered")

        run_agent(tmp_path, scenario, ack="application", max_connections=1)


class TestRefusal:
    @pytest.mark.parametrize("one_source", [False, True], ids=["two-sources", "one-source"])
    def test_busy_connections_are_kept_and_the_newcomer_is_refused_logged_once(self, tmp_path: Path,
                                                                               one_source: bool) -> None:
        """Connections in the middle of a frame are never evicted; newcomers are closed at once, logged once per source per minute.

        One source holding the channel's every place is refused for
        max_connections, the limit it met, not for max_connections_per_source
        (16 by default, above the channel's 2).
        """
        newcomer_source = "127.0.0.2" if one_source else "127.0.0.9"

        async def scenario(agent: Agent, port: int) -> None:
            busy = [await Sender.open(port, "127.0.0.2" if one_source else f"127.0.0.{n}") for n in (2, 3)]
            message = [hl7_message(f"BUSY-{n}") for n in range(2)]
            for conn, body in zip(busy, message, strict=True):
                await conn.send(mllp.START_BLOCK + body[:20], raw=True)  # a frame started, not finished
            await until(lambda: all(c.core.mid_frame for c in agent.listeners[0].connections)
                        and listener_connections(agent) == 2, what="2 connections mid-frame")
            for attempt in range(3):
                newcomer = await Sender.open(port, newcomer_source)
                await newcomer.send(hl7_message(f"REFUSED-{attempt}"))
                assert await newcomer.closed_by_agent(5), "a newcomer was admitted past busy connections"
                assert not newcomer.acks
                newcomer.close()
            refused = agent.metrics.registry.get_sample_value(
                "hl7_agent_connections_refused_total", {"channel": "adt", "reason": "busy"})
            assert refused == 3
            for conn, body in zip(busy, message, strict=True):
                await conn.send(body[20:] + mllp.END_BLOCK, raw=True)
                assert msa2(await conn.read_ack()) == body.split(b"|")[9].decode()
                conn.close()

        with capture_logs() as logs:
            run_agent(tmp_path, scenario, max_connections=2)
        refused = log_events(logs, "connection_refused_limit")
        assert len(refused) == 1, refused
        assert refused[0]["limit"] == "max_connections" and refused[0]["value"] == 2
        assert not log_events(logs, "connection_evicted")
        assert not db_rows(tmp_path / "data" / "queue.db",
                           "SELECT 1 FROM messages WHERE control_id LIKE 'REFUSED-%'")

    def test_one_source_cannot_take_the_whole_channel(self, tmp_path: Path) -> None:
        """max_connections_per_source: a source at its limit evicts its own longest-idle connection, never another sender's."""

        async def scenario(agent: Agent, port: int) -> None:
            other = await Sender.open(port, "127.0.0.2")  # idle longest of all
            mine = [await Sender.open(port, "127.0.0.3") for _ in range(2)]
            await until(lambda: listener_connections(agent) == 3, what="3 connections open")
            third = await Sender.open(port, "127.0.0.3")
            try:
                assert ack_code(await third.exchange(hl7_message("THIRD"))) == "AA"
                assert await mine[0].closed_by_agent()
                assert await other.still_open() and await mine[1].still_open()
                # Every connection of the source busy: the next one is refused.
                await mine[1].send(mllp.START_BLOCK + b"MSH|", raw=True)
                await third.send(mllp.START_BLOCK + b"MSH|", raw=True)
                await until(lambda: sum(c.core.mid_frame for c in agent.listeners[0].connections) == 2,
                            what="the source's two connections mid-frame")
                refused = await Sender.open(port, "127.0.0.3")
                assert await refused.closed_by_agent(5)
                refused.close()
                assert await other.still_open()
            finally:
                for conn in (other, *mine, third):
                    conn.close()

        with capture_logs() as logs:
            run_agent(tmp_path, scenario, max_connections=10, max_connections_per_source=2)
        evicted = log_events(logs, "connection_evicted")
        assert [e["limit"] for e in evicted] == ["max_connections_per_source"]
        refused = log_events(logs, "connection_refused_limit")
        assert [(e["limit"], e["value"]) for e in refused] == [("max_connections_per_source", 2)]


class TestTimeouts:
    def test_slowloris_is_closed_after_frame_timeout(self, tmp_path: Path) -> None:
        """A sender that starts a frame and trickles bytes (restarting it too) is closed once frame_timeout has passed since the frame began."""

        async def scenario(agent: Agent, port: int) -> None:
            slow = await Sender.open(port)
            try:
                assert ack_code(await slow.exchange(hl7_message("BEFORE-SLOW"))) == "AA"
                started = time.monotonic()
                await slow.send(mllp.START_BLOCK + b"MSH|^~\\&|", raw=True)
                closed = False
                for n in range(40):
                    try:
                        # a new start block restarts the frame: it must not restart the clock
                        await slow.send(mllp.START_BLOCK if n == 3 else b"X", raw=True)
                    except ConnectionError:
                        closed = True
                        break
                    if await slow.closed_by_agent(0.1):
                        closed = True
                        break
                elapsed = time.monotonic() - started
                assert closed, "the slowloris connection was never closed"
                assert 0.9 <= elapsed < 3.0, elapsed
            finally:
                slow.close()

        with capture_logs() as logs:
            run_agent(tmp_path, scenario, frame_timeout=1)
        timed_out = log_events(logs, "connection_frame_timeout")
        assert len(timed_out) == 1 and timed_out[0]["frame_timeout"] == 1.0

    def test_a_flood_of_start_blocks_is_closed_after_frame_timeout(self, tmp_path: Path) -> None:
        """Start blocks as fast as TCP takes them: every one restarts a frame that never ends, so frame_timeout closes it.

        Framed a Python turn per start block, such a flood outran the framer:
        its bytes always waited, the frame clock stood still, and the
        connection was never closed while other senders' ACKs slowed down.
        """
        stop = threading.Event()

        def flood(port: int) -> float | None:
            """Seconds until the agent cut the connection; None if it never did."""
            started = time.monotonic()
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                while time.monotonic() - started < 20 and not stop.is_set():
                    try:
                        sock.sendall(mllp.START_BLOCK * 65536)
                    except TimeoutError:
                        return None
                    except OSError:
                        return time.monotonic() - started
            return None

        async def scenario(agent: Agent, port: int) -> None:
            flooding = asyncio.ensure_future(asyncio.to_thread(flood, port))
            try:
                good = await Sender.open(port)
                try:
                    for n in range(5):
                        assert ack_code(await good.exchange(hl7_message(f"GOOD-{n}"))) == "AA"
                finally:
                    good.close()
                closed_after = await flooding
            finally:
                stop.set()
            assert closed_after is not None, "the flood of start blocks was never closed"
            assert closed_after < 10, closed_after

        with capture_logs() as logs:
            run_agent(tmp_path, scenario, frame_timeout=1)
        assert [e["frame_timeout"] for e in log_events(logs, "connection_frame_timeout")] == [1.0]

    def test_a_sender_that_never_reads_its_acks_is_cut_off_and_frees_its_place(self, tmp_path: Path) -> None:
        """Pipelined retransmits, no reads: the buffers fill, the agent stops reading and, frame_timeout later, cuts it off.

        Real sockets with small buffers (the client's receive buffer before
        connect, the agent's send buffer set here on its accepted socket) so
        a few hundred ACKs fill them. The one place (max_connections = 1) is
        free again afterwards. The accepted socket has TCP keepalive on.
        """

        async def scenario(agent: Agent, port: int) -> None:
            deaf = socket.socket()
            deaf.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            deaf.connect(("127.0.0.1", port))
            await until(lambda: bool(agent.listeners[0].connections), 5, "the connection admitted")
            (conn,) = agent.listeners[0].connections
            sock = conn._transport.get_extra_info("socket")
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            frame = mllp.encode_frame(hl7_message("DEAF"))

            def flood() -> float:
                """Send until the agent resets the connection; seconds from the first stalled send."""
                deaf.settimeout(0.2)
                stalled = None
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    try:
                        deaf.sendall(frame)
                    except TimeoutError:
                        stalled = stalled or time.monotonic()
                    except OSError:  # reset or broken pipe: cut off
                        return time.monotonic() - (stalled or time.monotonic())
                raise AssertionError("the deaf sender was never cut off")

            try:
                after_stall = await asyncio.to_thread(flood)
            finally:
                deaf.close()
            assert after_stall < 1.0 + 3.0, after_stall
            newcomer = await Sender.open(port)
            try:
                assert ack_code(await newcomer.exchange(hl7_message("NEXT"))) == "AA"
            finally:
                newcomer.close()

        with capture_logs() as logs:
            run_agent(tmp_path, scenario, frame_timeout=1, max_connections=1)
        assert [e["frame_timeout"] for e in log_events(logs, "connection_write_stalled")] == [1.0]

    def test_a_slow_but_steady_frame_within_frame_timeout_is_accepted(self, tmp_path: Path) -> None:
        """frame_timeout bounds a frame, not a read: a frame trickled in pieces within it is committed and ACKed."""

        async def scenario(agent: Agent, port: int) -> None:
            sender = await Sender.open(port)
            try:
                framed = mllp.encode_frame(hl7_message("TRICKLED"))
                for offset in range(0, len(framed), 40):
                    await sender.send(framed[offset:offset + 40], raw=True)
                    await asyncio.sleep(0.05)  # pacing the sender, not synchronising
                assert msa2(await sender.read_ack()) == "TRICKLED"
            finally:
                sender.close()

        run_agent(tmp_path, scenario, frame_timeout=5)

    def test_idle_timeout_ignores_bytes_outside_frames(self, tmp_path: Path) -> None:
        """idle_timeout counts from the last frame or ACK: junk trickled outside frames does not keep a connection open."""

        async def scenario(agent: Agent, port: int) -> None:
            sender = await Sender.open(port)
            try:
                assert ack_code(await sender.exchange(hl7_message("BEFORE-IDLE"))) == "AA"
                started = time.monotonic()
                closed = False
                for _ in range(40):
                    try:
                        await sender.send(b"\r\n", raw=True)
                    except ConnectionError:
                        closed = True
                        break
                    if await sender.closed_by_agent(0.1):
                        closed = True
                        break
                assert closed and time.monotonic() - started < 3.0
            finally:
                sender.close()

        with capture_logs() as logs:
            run_agent(tmp_path, scenario, idle_timeout=1)
        assert len(log_events(logs, "connection_idle_timeout")) == 1


class TestAuditBound:
    def test_junk_beyond_the_limit_is_counted_not_stored_or_logged(self, tmp_path: Path) -> None:
        """Past 100 audit rows per connection per minute, frames without MSH are counted in a metric and one summary line; the sender is still served."""
        frames = AUDIT_ROWS_PER_WINDOW + 150

        async def scenario(agent: Agent, port: int) -> None:
            sender = await Sender.open(port)
            try:
                await sender.send(b"".join(mllp.encode_frame(b"J%d" % n) for n in range(frames)), raw=True)
                assert msa2(await sender.exchange(hl7_message("AFTER-JUNK"))) == "AFTER-JUNK"
                await until(lambda: counter(agent, "hl7_agent_audit_rows_not_stored_total") == 150,
                            what="150 frames counted")
            finally:
                sender.close()

        with capture_logs() as logs:
            run_agent(tmp_path, scenario)
        nacked = db_rows(tmp_path / "data" / "queue.db", "SELECT count(*) FROM messages WHERE state = 'nacked'")
        assert nacked == [(AUDIT_ROWS_PER_WINDOW,)]
        assert len(log_events(logs, "frame_without_msh_dropped")) == AUDIT_ROWS_PER_WINDOW
        summary = log_events(logs, "audit_rows_not_stored")
        assert [e["count"] for e in summary] == [150]

    def test_rejects_over_the_limit_still_get_their_ack(self, tmp_path: Path) -> None:
        """A malformed MSH over the audit limit is answered AE all the same; only its row and log line are spared."""
        frames = AUDIT_ROWS_PER_WINDOW + 20
        bad = b"MSH|^~\\&|LAB|NORTH|EHR|CENTRAL|20260101120000||ADT^A01|BAD%d|P|\r"  # MSH-12 missing

        async def scenario(agent: Agent, port: int) -> None:
            sender = await Sender.open(port)
            try:
                await sender.send(b"".join(mllp.encode_frame(bad % n) for n in range(frames)), raw=True)
                answers = [await sender.read_ack() for _ in range(frames)]
                assert [msa2(a) for a in answers] == [f"BAD{n}" for n in range(frames)]
                assert {ack_code(a) for a in answers} == {"AE"}
            finally:
                sender.close()

        with capture_logs() as logs:
            run_agent(tmp_path, scenario)
        nacked = db_rows(tmp_path / "data" / "queue.db", "SELECT count(*) FROM messages WHERE state = 'nacked'")
        assert nacked == [(AUDIT_ROWS_PER_WINDOW,)]
        assert len(log_events(logs, "message_rejected")) == AUDIT_ROWS_PER_WINDOW


class TestRelayBound:
    def test_application_acks_awaited_per_connection_are_bounded(self, tmp_path: Path) -> None:
        """Enhanced mode with no server answering: past the bound, further application ACKs are recorded undelivered (replayed on retransmit) instead of awaited."""
        extra = 3

        async def scenario(agent: Agent, port: int) -> None:
            sender = await Sender.open(port)
            try:
                for n in range(MAX_PENDING_RELAYS + extra):
                    await sender.send(hl7_message(f"ENH-{n}", msh15="AL", msh16="AL"))
                for _ in range(MAX_PENDING_RELAYS + extra):
                    assert ack_code(await sender.read_ack()) == "CA"
                conn = next(iter(agent.listeners[0].connections))
                await until(lambda: conn.core.relays_awaited == MAX_PENDING_RELAYS, what="relays bounded")
                await until(lambda: len(db_rows(tmp_path / "data" / "queue.db",
                                                "SELECT 1 FROM messages WHERE ack_outcome = 'undelivered'")) == extra,
                            what="overflow recorded undelivered")
            finally:
                sender.close()

        with capture_logs() as logs:
            run_agent(tmp_path, scenario)
        assert len(log_events(logs, "application_acks_not_awaited")) == 1


def counter(agent: Agent, name: str) -> float:
    """A sample of the agent's own /metrics registry (summed over labels)."""
    total = 0.0
    for family in agent.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
    return total

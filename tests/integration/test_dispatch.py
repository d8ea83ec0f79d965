"""The dispatcher end to end, in process: a real Agent, real MLLP sockets, a real DevServer (SPEC 4-6).

Everything runs on one event loop: ``agent.app.service.Agent`` with channels on
127.0.0.1 port 0, a ``DevServer`` on 127.0.0.1 whose ``decide`` hook scripts
the server, and an asyncio MLLP client. Waiting is on events or by polling
the database with a deadline; the only sleeps are scripted server latency.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
from agenttest import run_async as run
from agenttest import until
from structlog.testing import capture_logs

from agent.app.config import Settings
from agent.app.devserver import Answer, DevServer, default_answer
from agent.app.service import Agent
from agent.core import mllp
from agent.core.protocol import Transmit
from agent.storage.store import SqliteStore
from tests.agenttest import ack_code, db_rows, free_port, hl7_message, log_events, msa2

T = TypeVar("T")
TOKEN = "test-token"
ACK_TIMEOUT = 10.0


# -- the pieces --------------------------------------------------------------


class MllpConn:
    """An asyncio MLLP sender: frames out, ACK frames in, on one connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = mllp.MllpDecoder(64 * 1024 * 1024)
        self.pending: list[bytes] = []

    @classmethod
    async def open(cls, port: int) -> MllpConn:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def send(self, message: bytes) -> None:
        self.writer.write(mllp.encode_frame(message))
        await self.writer.drain()

    async def read_ack(self, timeout: float = ACK_TIMEOUT) -> bytes:
        async with asyncio.timeout(timeout):
            while not self.pending:
                data = await self.reader.read(65536)
                if not data:
                    raise ConnectionError("connection closed by the agent")
                self.pending.extend(e.payload for e in self.decoder.feed(data) if isinstance(e, mllp.Frame))
        return self.pending.pop(0)

    async def exchange(self, message: bytes, timeout: float = ACK_TIMEOUT) -> bytes:
        await self.send(message)
        return await self.read_ack(timeout)

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except ConnectionError:
            pass


def settings_for(tmp_path: Path, server_url: str | None, channels: list[dict[str, Any]],
                 **sections: dict[str, Any]) -> Settings:
    """Settings with fast timers: ports 0, no admin, quick retries and lease checks."""
    values: dict[str, Any] = {
        "agent": {"id": "dispatch-test", "data_dir": tmp_path / "data", "shutdown_budget": 5},
        "admin": {"listen": ""},
        "server": {"url": server_url, "token": TOKEN, "response_timeout": 5, "connect_timeout": 2,
                   "application_ack_timeout": 5},
        "queue": {"synchronous": "normal", "min_free_disk_bytes": 0},
        "dispatch": {"lease_ttl": 10, "lease_heartbeat": 3, "lease_acquire_interval": 0.2,
                     "retry_initial": 0.1, "retry_cap": 0.5},
        "channels": [{"listen": "127.0.0.1:0", **c} for c in channels],
    }
    for section, overrides in sections.items():
        values[section] = {**values.get(section, {}), **overrides}
    return Settings(**values)


@asynccontextmanager
async def dev_server(decide: Callable[[Transmit], Awaitable[Answer | None]] | None = None, *,
                     replay: bool = True, port: int = 0) -> AsyncIterator[DevServer]:
    server = DevServer(token=TOKEN, replay=replay, decide=decide)
    await server.start("127.0.0.1", port)
    try:
        yield server
    finally:
        await server.stop()


@asynccontextmanager
async def agent_running(settings: Settings) -> AsyncIterator[Agent]:
    agent = Agent(settings)
    try:
        await agent.start()
        yield agent
    finally:
        await agent.shutdown()


def url(server: DevServer | int) -> str:
    port = server if isinstance(server, int) else server.port
    return f"ws://127.0.0.1:{port}/agent"


def port_of(agent: Agent, channel: str) -> int:
    for listener in agent.listeners:
        if listener.channel.name == channel:
            return int(listener.sock.getsockname()[1])
    raise KeyError(channel)


def rows(agent: Agent, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    return db_rows(agent.settings.db_path, sql, params)


def state_of(agent: Agent, control_id: str) -> str | None:
    found = rows(agent, "SELECT state FROM messages WHERE control_id = ? AND state <> 'nacked'", (control_id,))
    return str(found[0][0]) if found else None


def row_of(agent: Agent, control_id: str) -> dict[str, Any]:
    conn_rows = rows(agent, "SELECT id, state, attempts, error_code, ack_outcome, app_ack, seq, body, channel "
                            "FROM messages WHERE control_id = ? AND state <> 'nacked'", (control_id,))
    assert len(conn_rows) == 1, conn_rows
    keys = ("id", "state", "attempts", "error_code", "ack_outcome", "app_ack", "seq", "body", "channel")
    return dict(zip(keys, conn_rows[0], strict=True))


async def send_all(port: int, messages: list[bytes]) -> list[bytes]:
    """Send ``messages`` pipelined on one connection; return their ACKs in order."""
    conn = await MllpConn.open(port)
    try:
        for message in messages:
            await conn.send(message)
        return [await conn.read_ack() for _ in messages]
    finally:
        await conn.close()


def cid(channel: str, n: int) -> str:
    return f"{channel.upper()}{n:05d}"


def first_attempts(server: DevServer, channel: str) -> list[Transmit]:
    """Each id once, in the order the server first saw it."""
    seen: set[str] = set()
    out = []
    for t in server.received:
        if t.channel == channel and t.id not in seen:
            seen.add(t.id)
            out.append(t)
    return out


class ScriptedServer:
    """A decide hook: per-control-id scripts of answers, else 200; remembers what it saw."""

    def __init__(self, scripts: dict[str, list[Answer | None]] | None = None) -> None:
        self.scripts = {k: list(v) for k, v in (scripts or {}).items()}
        self.calls: dict[str, list[tuple[int, float]]] = defaultdict(list)

    async def __call__(self, t: Transmit) -> Answer | None:
        self.calls[t.control_id].append((t.attempt, time.monotonic()))
        script = self.scripts.get(t.control_id)
        if script:
            return script.pop(0)
        return default_answer(t)


# -- the tests ---------------------------------------------------------------


class TestOrderAndExclusivity:
    def test_three_channels_of_300_each_delivered_once_in_order_one_at_a_time(self, tmp_path: Path) -> None:
        """900 messages on 3 channels reach the server once each, in arrival order, never two in flight per channel."""
        channels = ["adt", "lab", "orm"]
        open_per_channel: dict[str, int] = defaultdict(int)
        overlaps: list[str] = []

        async def decide(t: Transmit) -> Answer:
            open_per_channel[t.channel] += 1
            if open_per_channel[t.channel] > 1:
                overlaps.append(t.id)
            try:
                await asyncio.sleep(0.001)  # scripted server latency: makes an overlap observable
            finally:
                open_per_channel[t.channel] -= 1
            return default_answer(t)

        async def scenario() -> None:
            async with dev_server(decide) as server:
                s = settings_for(tmp_path, url(server), [{"name": c} for c in channels])
                async with agent_running(s) as agent:
                    sent = {c: [hl7_message(cid(c, i), pid=str(i)) for i in range(300)] for c in channels}
                    acks = await asyncio.gather(*(send_all(port_of(agent, c), sent[c]) for c in channels))
                    for c, channel_acks in zip(channels, acks, strict=True):
                        assert [ack_code(a) for a in channel_acks] == ["AA"] * 300
                        assert [msa2(a) for a in channel_acks] == [cid(c, i) for i in range(300)]
                    await until(lambda: len(server.answered) == 900, 40, "900 answers")
                    await until(lambda: rows(agent, "SELECT count(*) FROM messages WHERE state = 'processed'")
                                == [(900,)], 10, "900 processed rows")
                    assert len(server.received) == 900, "a message was sent twice"
                    assert len({t.id for t in server.received}) == 900
                    for c in channels:
                        got = [t for t in server.received if t.channel == c]
                        assert [t.seq for t in got] == list(range(1, 301))
                        assert [t.control_id for t in got] == [cid(c, i) for i in range(300)]
                        assert {t.attempt for t in got} == {1}
                    assert overlaps == []
                    assert server.max_concurrent_sessions_seen == 1

        run(scenario())


class TestOutagesAndRetries:
    def test_server_down_during_intake_then_up_delivers_everything_in_order(self, tmp_path: Path) -> None:
        """Intake ACKs AA while the server is down; once it is up every message arrives in order."""
        port = free_port()

        async def scenario() -> None:
            s = settings_for(tmp_path, url(port), [{"name": "adt"}, {"name": "lab"}])
            async with agent_running(s) as agent:
                for c in ("adt", "lab"):
                    acks = await send_all(port_of(agent, c), [hl7_message(cid(c, i)) for i in range(20)])
                    assert [ack_code(a) for a in acks] == ["AA"] * 20
                # Nothing can be sent: at most each channel's head is claimed (provably unsent).
                assert rows(agent, "SELECT count(*) FROM messages WHERE state IN ('queued', 'claimed')") == [(40,)]
                async with dev_server(port=port) as server:
                    await until(lambda: len(server.answered) == 40, 15, "40 answers")
                    for c in ("adt", "lab"):
                        got = first_attempts(server, c)
                        assert [t.control_id for t in got] == [cid(c, i) for i in range(20)]
                        assert [t.seq for t in got] == list(range(1, 21))
                    await until(lambda: rows(agent, "SELECT count(*) FROM messages WHERE state = 'processed'")
                                == [(40,)], 5, "40 processed")

        run(scenario())

    def test_503_twice_then_200_is_delivered_once_after_backoff(self, tmp_path: Path) -> None:
        """Transient answers are retried with backoff, same id, until attempt 3 succeeds; one processed row."""
        script = ScriptedServer({"R1": [Answer(503), Answer(503)]})

        async def scenario() -> None:
            async with dev_server(script) as server:
                s = settings_for(tmp_path, url(server), [{"name": "adt"}])
                async with agent_running(s) as agent:
                    acks = await send_all(port_of(agent, "adt"), [hl7_message("R1"), hl7_message("R2")])
                    assert [ack_code(a) for a in acks] == ["AA", "AA"]
                    await until(lambda: state_of(agent, "R2") == "processed", 10, "R2 processed")
                    row = row_of(agent, "R1")
                    assert (row["state"], row["attempts"]) == ("processed", 3)
                    assert rows(agent, "SELECT count(*) FROM messages WHERE control_id = 'R1'") == [(1,)]
                    r1 = [t for t in server.received if t.control_id == "R1"]
                    assert [t.attempt for t in r1] == [1, 2, 3]
                    assert len({t.id for t in r1}) == 1
                    times = [at for _attempt, at in script.calls["R1"]]
                    # retry_initial 0.1 s doubling, jitter subtracts at most 20 %.
                    assert times[1] - times[0] >= 0.08 and times[2] - times[1] >= 0.16
                    # FIFO: R2 went only after R1 settled.
                    order = [t.control_id for t in server.received]
                    assert order.index("R2") > max(i for i, c in enumerate(order) if c == "R1")

        run(scenario())

    def test_max_attempts_with_503s_ends_failed_and_the_channel_goes_on(self, tmp_path: Path) -> None:
        """With max_attempts = 2, two transient answers leave the row failed; the next message proceeds."""
        script = ScriptedServer({"F1": [Answer(503)] * 10})

        async def scenario() -> None:
            async with dev_server(script) as server:
                s = settings_for(tmp_path, url(server), [{"name": "adt", "max_attempts": 2}])
                async with agent_running(s) as agent:
                    await send_all(port_of(agent, "adt"), [hl7_message("F1"), hl7_message("F2")])
                    await until(lambda: state_of(agent, "F2") == "processed", 10, "F2 processed")
                    row = row_of(agent, "F1")
                    assert (row["state"], row["attempts"], row["error_code"]) == ("failed", 2, "503")
                    assert [t.attempt for t in server.received if t.control_id == "F1"] == [1, 2]

        run(scenario())

    def test_400_rejects_and_the_next_message_proceeds(self, tmp_path: Path) -> None:
        """on_reject = continue: a 4xx row is rejected for good, never retried, and the channel goes on."""
        script = ScriptedServer({"X1": [Answer(400)]})

        async def scenario() -> None:
            async with dev_server(script) as server:
                s = settings_for(tmp_path, url(server), [{"name": "adt", "on_reject": "continue"}])
                async with agent_running(s) as agent:
                    await send_all(port_of(agent, "adt"), [hl7_message("X1"), hl7_message("X2")])
                    await until(lambda: state_of(agent, "X2") == "processed", 10, "X2 processed")
                    row = row_of(agent, "X1")
                    assert (row["state"], row["attempts"], row["error_code"]) == ("rejected", 1, "400")
                    assert [t.control_id for t in server.received] == ["X1", "X2"]
                    assert rows(agent, "SELECT paused FROM channels WHERE channel = 'adt'") == [(0,)]

        run(scenario())

    def test_400_with_on_reject_pause_holds_the_channel_until_resumed(self, tmp_path: Path) -> None:
        """on_reject = pause: the durable flag is set, later rows stay queued, other channels go on."""
        script = ScriptedServer({"P1": [Answer(400)]})

        async def scenario() -> None:
            async with dev_server(script) as server:
                s = settings_for(tmp_path, url(server), [{"name": "adt", "on_reject": "pause"}, {"name": "lab"}])
                async with agent_running(s) as agent:
                    await send_all(port_of(agent, "adt"), [hl7_message(f"P{i}") for i in (1, 2, 3)])
                    await until(lambda: state_of(agent, "P1") == "rejected", 10, "P1 rejected")
                    assert rows(agent, "SELECT paused FROM channels WHERE channel = 'adt'") == [(1,)]
                    # The dispatcher is alive and looping: another channel still delivers.
                    await send_all(port_of(agent, "lab"), [hl7_message("L1")])
                    await until(lambda: state_of(agent, "L1") == "processed", 10, "L1 processed")
                    assert [state_of(agent, "P2"), state_of(agent, "P3")] == ["queued", "queued"]
                    assert [t.control_id for t in server.received if t.channel == "adt"] == ["P1"]
                    # Operator resumes: the held rows go, in order.
                    assert agent.writer is not None
                    await agent.writer.call(SqliteStore.resume_channel, "adt")
                    agent.dispatcher.wake("adt")
                    await until(lambda: state_of(agent, "P3") == "processed", 10, "P3 processed")
                    assert [t.control_id for t in server.received if t.channel == "adt"] == ["P1", "P2", "P3"]

        run(scenario())

    def test_response_timeout_resends_the_same_id_to_a_replaying_server(self, tmp_path: Path) -> None:
        """An unanswered transmit is resent with the same id as the next attempt, then processed once."""
        script = ScriptedServer({"T1": [None]})

        async def scenario() -> None:
            async with dev_server(script) as server:
                s = settings_for(tmp_path, url(server), [{"name": "adt"}],
                                 server={"response_timeout": 0.5})
                async with agent_running(s) as agent:
                    await send_all(port_of(agent, "adt"), [hl7_message("T1"), hl7_message("T2")])
                    await until(lambda: state_of(agent, "T2") == "processed", 10, "T2 processed")
                    row = row_of(agent, "T1")
                    assert (row["state"], row["attempts"]) == ("processed", 2)
                    t1 = [t for t in server.received if t.control_id == "T1"]
                    assert [t.attempt for t in t1] == [1, 2] and len({t.id for t in t1}) == 1

        run(scenario())

    def test_a_paused_channel_starts_no_new_attempt_of_its_unanswered_head(self, tmp_path: Path) -> None:
        """channel pause holds dispatch: an inflight head whose answer times out is not resent until resumed."""
        answering = False
        attempts: list[int] = []

        async def decide(t: Transmit) -> Answer | None:
            if t.control_id == "N1":
                attempts.append(t.attempt)
            return default_answer(t) if answering or t.control_id != "N1" else None

        async def scenario() -> None:
            nonlocal answering
            async with dev_server(decide) as server:
                s = settings_for(tmp_path, url(server), [{"name": "adt"}], server={"response_timeout": 0.3})
                async with agent_running(s) as agent:
                    assert agent.writer is not None
                    await send_all(port_of(agent, "adt"), [hl7_message("N1"), hl7_message("N2")])
                    await until(lambda: len(attempts) >= 2, 10, "N1 resent after a timeout")
                    await agent.writer.call(SqliteStore.pause_channel, "adt", "test: hold")
                    # The attempt under way when the pause came still times out;
                    # then nothing more may go out. Absence needs a window: ten
                    # response timeouts, where the bug resent ten times.
                    await until(lambda: max(e["attempt"] for e in log_events(logs, "transmit_response_timeout"))
                                >= max(attempts), 10, "every attempt sent so far timed out")
                    held = len(attempts)
                    await asyncio.sleep(3.0)
                    assert len(attempts) == held, attempts
                    assert (row_of(agent, "N1")["state"], state_of(agent, "N2")) == ("inflight", "queued")
                    answering = True
                    await agent.writer.call(SqliteStore.resume_channel, "adt")
                    agent.dispatcher.wake("adt")
                    await until(lambda: state_of(agent, "N2") == "processed", 10, "N2 processed after resume")
                    n1 = row_of(agent, "N1")
                    assert (n1["state"], n1["attempts"]) == ("processed", held + 1)
                    assert len({t.id for t in server.received if t.control_id == "N1"}) == 1

        with capture_logs() as logs:
            run(scenario())

    def test_max_attempts_ends_a_head_the_server_never_answers_failed(self, tmp_path: Path) -> None:
        """Unanswered sends count against max_attempts: the head is set aside, not resent for ever; the channel goes on."""
        script = ScriptedServer({"M1": [None] * 10})

        async def scenario() -> None:
            async with dev_server(script) as server:
                s = settings_for(tmp_path, url(server), [{"name": "adt", "max_attempts": 3}],
                                 server={"response_timeout": 0.3})
                async with agent_running(s) as agent:
                    await send_all(port_of(agent, "adt"), [hl7_message("M1"), hl7_message("M2")])
                    await until(lambda: state_of(agent, "M2") == "processed", 15, "M2 processed")
                    row = row_of(agent, "M1")
                    assert (row["state"], row["attempts"], row["error_code"]) == ("failed", 3, "no_answer")
                    m1 = [t for t in server.received if t.control_id == "M1"]
                    assert [t.attempt for t in m1] == [1, 2, 3] and len({t.id for t in m1}) == 1

        run(scenario())


class TestForwardedText:
    def test_assign_sequence_numbers_sets_msh13_and_keeps_stored_bytes(self, tmp_path: Path) -> None:
        """MSH-13 of the forwarded body is the seq; the stored body is byte-identical to what was received."""

        async def scenario() -> None:
            async with dev_server() as server:
                s = settings_for(tmp_path, url(server), [{"name": "adt", "assign_sequence_numbers": True},
                                                         {"name": "lab"}])
                async with agent_running(s) as agent:
                    sent = [hl7_message(f"S{i}") for i in range(3)]
                    await send_all(port_of(agent, "adt"), sent)
                    await send_all(port_of(agent, "lab"), [hl7_message("U1")])
                    await until(lambda: len(server.answered) == 4, 10, "4 answers")
                    got = [t for t in server.received if t.channel == "adt"]
                    assert [t.body.split("\r")[0].split("|")[12] for t in got] == ["1", "2", "3"]
                    assert [t.seq for t in got] == [1, 2, 3]
                    for i, message in enumerate(sent):
                        assert row_of(agent, f"S{i}")["body"] == message
                        # Only MSH-13 differs from the received text.
                        assert got[i].body.split("\r")[1:] == message.decode().split("\r")[1:]
                    lab = next(t for t in server.received if t.channel == "lab")
                    assert lab.body == hl7_message("U1").decode()

        run(scenario())


class TestMessageTooBig:
    def test_close_1009_rejects_the_largest_inflight_transmit_and_retries_the_others(self, tmp_path: Path) -> None:
        """A server close with 1009 settles the largest transmit in flight as rejected; the smaller one is resent."""
        held: list[str] = []

        async def decide(t: Transmit) -> Answer | None:
            if t.attempt == 1 and t.control_id in ("BIG1", "SMALL1"):
                held.append(t.control_id)
                return None  # keep both in flight until the server closes
            return default_answer(t)

        async def scenario() -> None:
            async with dev_server(decide) as server:
                s = settings_for(tmp_path, url(server), [{"name": "adt"}, {"name": "lab"}])
                async with agent_running(s) as agent:
                    await send_all(port_of(agent, "adt"), [hl7_message("BIG1", pid="9" * 5000),
                                                           hl7_message("BIG2")])
                    await send_all(port_of(agent, "lab"), [hl7_message("SMALL1")])
                    await until(lambda: sorted(held) == ["BIG1", "SMALL1"], 10, "both in flight")
                    await server.close_connections(1009, "message too big")
                    await until(lambda: state_of(agent, "SMALL1") == "processed", 15, "SMALL1 processed")
                    await until(lambda: state_of(agent, "BIG2") == "processed", 10, "BIG2 processed")
                    big = row_of(agent, "BIG1")
                    assert (big["state"], big["error_code"]) == ("rejected", "207")
                    assert [t.attempt for t in server.received if t.control_id == "SMALL1"] == [1, 2]
                    assert [t.attempt for t in server.received if t.control_id == "BIG1"] == [1]

        run(scenario())


def server_ack(control_id: str, text: str = "custom") -> str:
    return (f"MSH|^~\\&|EHR|CENTRAL|LAB|NORTH|20260101120001||ACK^A01^ACK|SRV-{control_id}|P|2.5.1\r"
            f"MSA|AA|{control_id}|{text}\r")


class TestApplicationAck:
    def test_sender_receives_the_servers_ack_bytes(self, tmp_path: Path) -> None:
        """ack = application: the sender's ACK is exactly the server's ACK text, and the outcome is delivered."""

        async def decide(t: Transmit) -> Answer:
            return Answer(200, ack=server_ack(t.control_id))

        async def scenario() -> None:
            async with dev_server(decide) as server:
                s = settings_for(tmp_path, url(server), [{"name": "adt", "ack": "application"}])
                async with agent_running(s) as agent:
                    conn = await MllpConn.open(port_of(agent, "adt"))
                    try:
                        assert await conn.exchange(hl7_message("A1")) == server_ack("A1").encode()
                        assert await conn.exchange(hl7_message("A2")) == server_ack("A2").encode()
                    finally:
                        await conn.close()
                    await until(lambda: row_of(agent, "A2")["ack_outcome"] == "delivered", 5, "A2 delivered")
                    assert row_of(agent, "A1")["ack_outcome"] == "delivered"

        run(scenario())

    def test_retransmit_after_disconnect_gets_the_servers_ack(self, tmp_path: Path) -> None:
        """A sender gone before the answer gets the server's ACK on its identical retransmit; outcome delivered."""

        async def decide(t: Transmit) -> Answer:
            return Answer(200, ack=server_ack(t.control_id), delay=1.0)

        async def scenario() -> None:
            async with dev_server(decide) as server:
                s = settings_for(tmp_path, url(server), [{"name": "adt", "ack": "application"}])
                async with agent_running(s) as agent:
                    conn = await MllpConn.open(port_of(agent, "adt"))
                    await conn.send(hl7_message("D1"))
                    await until(lambda: state_of(agent, "D1") is not None, 5, "D1 committed")
                    await conn.close()
                    await until(lambda: state_of(agent, "D1") == "processed", 10, "D1 processed")
                    retry = await MllpConn.open(port_of(agent, "adt"))
                    try:
                        assert await retry.exchange(hl7_message("D1")) == server_ack("D1").encode()
                    finally:
                        await retry.close()
                    await until(lambda: row_of(agent, "D1")["ack_outcome"] == "delivered", 5, "delivered")
                    assert rows(agent, "SELECT count(*) FROM messages WHERE control_id = 'D1'") == [(1,)]
                    assert len(server.received) == 1

        run(scenario())

    def test_ack_for_a_sender_gone_before_the_answer_is_recorded_undelivered(self, tmp_path: Path) -> None:
        """An application ACK whose sender closed its connection before the answer is recorded undelivered."""

        async def decide(t: Transmit) -> Answer:
            return Answer(200, ack=server_ack(t.control_id), delay=1.0)

        async def scenario() -> None:
            async with dev_server(decide) as server:
                s = settings_for(tmp_path, url(server), [{"name": "adt", "ack": "application"}])
                async with agent_running(s) as agent:
                    conn = await MllpConn.open(port_of(agent, "adt"))
                    await conn.send(hl7_message("G1"))
                    await until(lambda: state_of(agent, "G1") is not None, 5, "G1 committed")
                    await conn.close()
                    await until(lambda: state_of(agent, "G1") == "processed", 10, "G1 processed")
                    await until(lambda: row_of(agent, "G1")["ack_outcome"] != "pending", 5, "outcome recorded")
                    assert row_of(agent, "G1")["ack_outcome"] == "undelivered"

        run(scenario())

    def test_application_ack_timeout_answers_ar_then_retransmit_gets_the_real_ack(self, tmp_path: Path) -> None:
        """No server answer within application_ack_timeout: AR, the row is still delivered, a retransmit gets the ACK."""

        async def decide(t: Transmit) -> Answer:
            return Answer(200, ack=server_ack(t.control_id), delay=2.0)

        async def scenario() -> None:
            async with dev_server(decide) as server:
                s = settings_for(tmp_path, url(server), [{"name": "adt", "ack": "application"}],
                                 server={"application_ack_timeout": 1})
                async with agent_running(s) as agent:
                    conn = await MllpConn.open(port_of(agent, "adt"))
                    try:
                        first = await conn.exchange(hl7_message("W1"))
                        assert ack_code(first) == "AR" and msa2(first) == "W1"
                        assert state_of(agent, "W1") in ("queued", "claimed", "inflight")
                        await until(lambda: state_of(agent, "W1") == "processed", 10, "W1 processed")
                        assert await conn.exchange(hl7_message("W1")) == server_ack("W1").encode()
                    finally:
                        await conn.close()
                    await until(lambda: row_of(agent, "W1")["ack_outcome"] == "delivered", 5, "delivered")
                    assert len(server.received) == 1

        run(scenario())


class TestProvablyUnsent:
    def test_session_closed_before_the_write_is_not_ambiguous(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A row marked inflight whose session closed before its frame was written is resent, not failed."""
        box: dict[str, Any] = {}

        def then_lose_session(original: Callable[..., int | None]) -> Callable[..., int | None]:
            def mark(self: SqliteStore, *args: Any, **kwargs: Any) -> int | None:
                attempt = original(self, *args, **kwargs)
                if attempt is not None:
                    lose_session()
                return attempt

            return mark

        def lose_session() -> None:
            if not box.get("done"):
                # Runs on the writer thread while the loop is free: the server
                # drops the session after inflight is committed, before the write.
                box["done"] = True
                session = box["agent"].dispatcher.link.current()
                asyncio.run_coroutine_threadsafe(box["server"].close_connections(1001, "restart"),
                                                 box["loop"]).result(5)
                deadline = time.monotonic() + 5
                while not session.closed:
                    assert time.monotonic() < deadline, "session did not close"
                    time.sleep(0.005)  # polling another thread's state with a deadline

        # Both ways a row is marked inflight: a head claimed and sent in one statement, or a claimed one.
        for name in ("claim_and_send", "mark_inflight"):
            monkeypatch.setattr(SqliteStore, name, then_lose_session(getattr(SqliteStore, name)))

        async def scenario() -> None:
            async with dev_server(replay=False) as server:
                s = settings_for(tmp_path, url(server), [{"name": "adt"}])
                box.update(server=server, loop=asyncio.get_running_loop())
                async with agent_running(s) as agent:
                    box["agent"] = agent
                    await send_all(port_of(agent, "adt"), [hl7_message("U1")])
                    await until(lambda: state_of(agent, "U1") in ("processed", "failed"), 10, "U1 settled")
                    assert state_of(agent, "U1") == "processed"
                    assert [t.control_id for t in server.received] == ["U1"]
            assert box.get("done"), "the session was never lost after an inflight mark"

        run(scenario())


class TestCommitsPerMessage:
    def test_a_backlog_is_sent_with_few_commits_per_message(self, tmp_path: Path) -> None:
        """Dispatch pays one commit per message while a backlog drains.

        The settle of a row carries the next head's claim and inflight mark
        (three fsyncs per message became one).

        The first transmit is held at the server until 30 rows are queued,
        then the writer's commit count is compared with the rows delivered.
        Idle intake, lease renewals every 3 s and the deferred ACK outcomes
        add a few commits of their own: the bound allows 4.
        """
        n = 30
        gate = asyncio.Event()

        async def decide(t: Transmit) -> Answer:
            await gate.wait()
            return default_answer(t)

        async def scenario() -> None:
            async with dev_server(decide) as server:
                s = settings_for(tmp_path, url(server), [{"name": "adt"}])
                async with agent_running(s) as agent:
                    acks = await send_all(port_of(agent, "adt"), [hl7_message(cid("adt", i)) for i in range(n)])
                    assert [ack_code(a) for a in acks] == ["AA"] * n
                    await until(lambda: len(server.received) == 1, 10, "the first transmit")
                    assert agent.writer is not None
                    before = agent.writer.batches
                    gate.set()
                    await until(lambda: rows(agent, "SELECT count(*) FROM messages WHERE state = 'processed'")
                                == [(n,)], 20, f"{n} processed")
                    commits = agent.writer.batches - before
                    assert [t.control_id for t in first_attempts(server, "adt")] == [cid("adt", i) for i in range(n)]
                    assert commits <= n + 4, commits

        run(scenario())

    def test_the_settles_of_several_channels_share_commits(self, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
        """Four channels draining at once: about one commit per four messages, not one each.

        A settle that arrives while a batch runs joins its COMMIT, and the
        writer holds a commit a moment for settles announced by a quick
        server's transmits. The server answers each channel after its own
        delay (0, 3, 6, 9 ms: the channels' answers never arrive together, as
        under intake load), so without the hold each settle takes a commit of
        its own. The hold is widened (50 ms whatever the batches take, and
        every server counts as quick) so a busy test machine cannot make
        answers miss it; the bound allows half again the ideal count of 20.
        """
        import agent.runtime.channel_worker as channel_worker

        monkeypatch.setattr(channel_worker, "QUICK_ANSWER_SECONDS", 10.0)
        n, names = 20, ["c1", "c2", "c3", "c4"]
        gate = asyncio.Event()

        async def decide(t: Transmit) -> Answer:
            await gate.wait()
            await asyncio.sleep(0.003 * names.index(t.channel))  # the server's answer time, per channel
            return default_answer(t)

        async def scenario() -> None:
            async with dev_server(decide) as server:
                s = settings_for(tmp_path, url(server), [{"name": name} for name in names])
                async with agent_running(s) as agent:
                    assert agent.writer is not None
                    agent.writer.hold = agent.writer.min_hold = 0.05
                    for name in names:
                        acks = await send_all(port_of(agent, name), [hl7_message(cid(name, i)) for i in range(n)])
                        assert [ack_code(a) for a in acks] == ["AA"] * n
                    await until(lambda: len(server.received) == len(names), 10, "each channel's first transmit")
                    before = agent.writer.batches
                    gate.set()
                    await until(lambda: rows(agent, "SELECT count(*) FROM messages WHERE state = 'processed'")
                                == [(n * len(names),)], 30, "every row processed")
                    commits = agent.writer.batches - before
                    for name in names:
                        assert [t.control_id for t in first_attempts(server, name)] == [cid(name, i) for i in range(n)]
                    assert commits <= n * 3 // 2, commits

        run(scenario())

    def test_only_a_strict_channels_transmit_is_announced_to_the_writer(self, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
        """A strict channel's next message waits for this settle: the writer is told it comes.

        A partitioned channel's other keys go on meanwhile, and with many rows
        in flight an announcement would stand nearly always, making every
        commit wait (intake's too): its transmits are not announced.
        """
        import agent.runtime.channel_worker as channel_worker

        monkeypatch.setattr(channel_worker, "QUICK_ANSWER_SECONDS", 10.0)
        gate = asyncio.Event()

        async def decide(t: Transmit) -> Answer:
            await gate.wait()
            return default_answer(t)

        async def scenario() -> None:
            async with dev_server(decide) as server:
                s = settings_for(tmp_path, url(server), [
                    {"name": "strict"}, {"name": "part", "partition_key": "PID-3.1", "max_in_flight": 4}])
                async with agent_running(s) as agent:
                    assert agent.writer is not None
                    writer = agent.writer
                    await send_all(port_of(agent, "part"), [hl7_message(cid("part", i)) for i in range(3)])
                    await until(lambda: len(server.received) == 1, 10, "the partitioned channel's transmit")
                    assert writer._expected == 0
                    await send_all(port_of(agent, "strict"), [hl7_message(cid("strict", 0))])
                    await until(lambda: len(server.received) == 2, 10, "the strict channel's transmit")
                    assert writer._expected == 1
                    gate.set()
                    await until(lambda: rows(agent, "SELECT count(*) FROM messages WHERE state = 'processed'")
                                == [(4,)], 10, "every row processed")
                    assert writer._expected == 0

        run(scenario())

"""Upstream fault injection, end to end in process: each fault is logged, recovered from, and loses nothing.

A real Agent (real SQLite, real MLLP sockets on 127.0.0.1) dispatches to a
real ``websockets`` server written here, which speaks protocol v1 and
misbehaves on cue: it cuts TCP in the middle of a frame, answers garbage, an
unknown id, twice, the wrong attempt, or a frame far over the agent's limit;
the token case uses the DevServer with a rotated token. Faults already
covered elsewhere are not repeated: no answer at all and close 1009
(tests/integration/test_dispatch.py), and their link-level twins
(tests/integration/test_upstream.py).

"Nothing lost" is checked the same way each time: every message that got
its AA ends ``processed``, reached the server under one id, and the server's
first sight of each channel's messages is in seq order.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from agenttest import ack_code, db_rows, hl7_message, until
from agenttest import log_events as events
from agenttest import run_async as run
from structlog.testing import capture_logs
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from agent.app.config import Settings
from agent.app.devserver import DevServer, default_answer
from agent.app.service import Agent
from agent.core import mllp
from agent.core.protocol import Transmit, TransmitResponse, Welcome, parse_client_frame

TOKEN = "fault-token"

#: What the server does to one (control_id, attempt); anything else gets 200 + AA.
Fault = Callable[[ServerConnection, Transmit], Any]


class FaultyServer:
    """Protocol v1 with scripted misbehaviour; records every transmit it read, in order."""

    def __init__(self, faults: dict[tuple[str, int], Fault]) -> None:
        self.faults = faults
        self.received: list[Transmit] = []
        self.sessions = 0

    async def handle(self, ws: ServerConnection) -> None:
        self.sessions += 1
        try:
            await ws.recv()  # hello
            await ws.send(Welcome(True).to_json())
            async for frame in ws:
                t = parse_client_frame(frame)
                assert isinstance(t, Transmit)
                self.received.append(t)
                fault = self.faults.get((t.control_id, t.attempt))
                if fault is not None:
                    await fault(ws, t)
                else:
                    await ws.send(answer(t).to_json())
        except ConnectionClosed:
            pass


def answer(t: Transmit, **changes: Any) -> TransmitResponse:
    a = default_answer(t)
    fields = {"id": t.id, "attempt": t.attempt, "status": a.status, "ack": a.ack, **changes}
    return TransmitResponse(**fields)


def settings_for(tmp_path: Path, url: str, **server: Any) -> Settings:
    return Settings(
        agent={"id": "faults", "data_dir": tmp_path / "data", "shutdown_budget": 5},
        admin={"listen": ""},
        server={"url": url, "token": TOKEN, "response_timeout": 1, "connect_timeout": 2, **server},
        queue={"synchronous": "normal", "min_free_disk_bytes": 0},
        dispatch={"lease_ttl": 10, "lease_heartbeat": 3, "lease_acquire_interval": 0.2,
                  "retry_initial": 0.1, "retry_cap": 0.5},
        channels=[{"name": "adt", "listen": "127.0.0.1:0", "max_message_bytes": 8192}],
    )


@asynccontextmanager
async def faulty(faults: dict[tuple[str, int], Fault]) -> AsyncIterator[tuple[FaultyServer, str]]:
    server = FaultyServer(faults)
    async with serve(server.handle, "127.0.0.1", 0, max_size=1 << 20, compression=None) as ws_server:
        port = ws_server.sockets[0].getsockname()[1]
        yield server, f"ws://127.0.0.1:{port}/agent"


@asynccontextmanager
async def agent_running(settings: Settings) -> AsyncIterator[Agent]:
    agent = Agent(settings)
    try:
        await agent.start()
        yield agent
    finally:
        await agent.shutdown()


async def send(agent: Agent, control_ids: list[str]) -> None:
    """Each message on one connection; each must get its AA (committed) before the next goes."""
    port = agent.listeners[0].sock.getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    decoder = mllp.MllpDecoder(1 << 20)
    try:
        for cid in control_ids:
            writer.write(mllp.encode_frame(hl7_message(cid)))
            acks: list[bytes] = []
            async with asyncio.timeout(10):
                while not acks:
                    acks = [e.payload for e in decoder.feed(await reader.read(65536)) if isinstance(e, mllp.Frame)]
            assert ack_code(acks[0]) == "AA"
    finally:
        writer.close()


def states(agent: Agent) -> dict[str, tuple[str, int]]:
    return {str(c): (str(s), int(a)) for c, s, a in db_rows(
        agent.settings.db_path, "SELECT control_id, state, attempts FROM messages WHERE seq IS NOT NULL")}


async def all_processed(agent: Agent, control_ids: list[str], timeout: float = 20) -> dict[str, tuple[str, int]]:
    await until(lambda: all(states(agent).get(c, ("", 0))[0] == "processed" for c in control_ids),
                timeout, "every message processed")
    return states(agent)


def assert_nothing_lost(received: list[Transmit], control_ids: list[str]) -> None:
    ids: dict[str, set[str]] = {}
    first: list[str] = []
    for t in received:
        if t.control_id not in ids:
            first.append(t.control_id)
        ids.setdefault(t.control_id, set()).add(t.id)
    assert first == control_ids, "first arrivals out of channel order"
    assert all(len(v) == 1 for v in ids.values()), "a message reached the server under two ids"


MESSAGES = ["F1", "F2", "F3"]


async def through_fault(tmp_path: Path, fault: Fault) -> tuple[FaultyServer, list[dict[str, Any]],
                                                                 dict[str, tuple[str, int]]]:
    """MESSAGES through a server that answers F2's first attempt with ``fault``; (server, logs, final states)."""
    async with faulty({("F2", 1): fault}) as (server, url):
        with capture_logs() as logs:
            async with agent_running(settings_for(tmp_path, url)) as agent:
                await send(agent, MESSAGES)
                final = await all_processed(agent, MESSAGES)
    return server, logs, final


class TestBrokenFrames:
    def test_tcp_cut_in_the_middle_of_the_servers_frame(self, tmp_path: Path) -> None:
        """The server writes half a frame and drops TCP: logged as a 1006 loss, the row is resent on a new session and processed."""

        async def half_then_cut(ws: ServerConnection, t: Transmit) -> None:
            payload = answer(t).to_json().encode()
            # RFC 6455 section 5.2: FIN + text opcode, 16-bit length, then only part of the payload.
            header = bytes([0x81, 126]) + len(payload).to_bytes(2, "big")
            ws.transport.write(header + payload[: len(payload) // 2])
            ws.transport.abort()

        async def scenario() -> None:
            server, logs, final = await through_fault(tmp_path, half_then_cut)
            assert final["F2"] == ("processed", 2)
            assert [e["code"] for e in events(logs, "transmit_interrupted")] == [1006]
            assert any(e["code"] == 1006 for e in events(logs, "upstream_disconnected"))
            assert server.sessions == 2
            assert_nothing_lost(server.received, MESSAGES)

        run(scenario())

    def test_garbage_instead_of_an_answer(self, tmp_path: Path) -> None:
        """Invalid JSON where the answer should be: logged as a protocol error, the session lives, the resend is processed."""

        async def garbage(ws: ServerConnection, t: Transmit) -> None:
            await ws.send('{"type": "transmit_response", "id": ')

        async def scenario() -> None:
            server, logs, final = await through_fault(tmp_path, garbage)
            assert final["F2"] == ("processed", 2)
            assert len(events(logs, "upstream_protocol_error")) == 1
            assert [e["attempt"] for e in events(logs, "transmit_response_timeout")] == [1]
            assert server.sessions == 1
            assert_nothing_lost(server.received, MESSAGES)

        run(scenario())

    def test_a_frame_far_over_the_agents_limit(self, tmp_path: Path) -> None:
        """A 256 KiB server frame against a ~112 KiB limit: the agent closes with 1009, blames no transmit, and delivers everything."""

        async def huge(ws: ServerConnection, t: Transmit) -> None:
            await ws.send(json.dumps({"type": "error", "message": "x" * (256 * 1024)}))

        async def scenario() -> None:
            server, logs, final = await through_fault(tmp_path, huge)
            assert final["F2"] == ("processed", 2)  # not rejected: the size was the server's
            assert [e["code"] for e in events(logs, "transmit_interrupted")] == [1009]
            assert server.sessions == 2
            assert_nothing_lost(server.received, MESSAGES)

        run(scenario())


class TestWrongAnswers:
    def test_an_answer_holding_a_lone_surrogate(self, tmp_path: Path) -> None:
        """JSON allows "\\ud800", UTF-8 cannot hold it: the text is repaired, the row processed, the agent lives.

        It used to raise while the settle stored the ACK, which stopped the
        daemon; a replaying server then sent the same answer after every restart.
        """

        async def surrogate(ws: ServerConnection, t: Transmit) -> None:
            ack = default_answer(t).ack or ""
            frame = json.dumps({"type": "transmit_response", "id": t.id, "attempt": t.attempt,
                                "status": 200, "ack": ack + "NTE|1||bad \ud800 char\r"})
            assert "\\ud800" in frame  # ensure_ascii writes the escape itself
            await ws.send(frame)

        async def scenario() -> None:
            async with faulty({("F2", 1): surrogate}) as (server, url), \
                    agent_running(settings_for(tmp_path, url)) as agent:
                await send(agent, MESSAGES)
                final = await all_processed(agent, MESSAGES)
                await send(agent, ["F4"])  # intake still up
                await all_processed(agent, ["F4"])
            assert final["F2"] == ("processed", 1)
            assert_nothing_lost(server.received, [*MESSAGES, "F4"])

        run(scenario())

    def test_a_status_beyond_64_bits(self, tmp_path: Path) -> None:
        """A status the queue cannot store is no status: the frame is dropped, the resend processed."""

        async def huge_status(ws: ServerConnection, t: Transmit) -> None:
            await ws.send(json.dumps({"type": "transmit_response", "id": t.id, "attempt": t.attempt,
                                      "status": 2**63, "ack": None}))

        async def scenario() -> None:
            server, logs, final = await through_fault(tmp_path, huge_status)
            assert final["F2"] == ("processed", 2)
            assert len(events(logs, "upstream_protocol_error")) == 1
            assert_nothing_lost(server.received, MESSAGES)

        run(scenario())

    def test_an_answer_for_an_id_nobody_sent(self, tmp_path: Path) -> None:
        """An answer with an unknown id settles nothing (logged); the real answer then settles the row once."""

        async def unknown_first(ws: ServerConnection, t: Transmit) -> None:
            await ws.send(answer(t, id="00000000-0000-4000-8000-000000000000").to_json())
            await ws.send(answer(t).to_json())

        async def scenario() -> None:
            server, logs, final = await through_fault(tmp_path, unknown_first)
            assert final["F2"] == ("processed", 1)
            (line,) = events(logs, "upstream_response_unmatched")
            assert line["id"] == "00000000-0000-4000-8000-000000000000"
            assert_nothing_lost(server.received, MESSAGES)

        run(scenario())

    def test_one_transmit_answered_twice(self, tmp_path: Path) -> None:
        """A second answer to a settled transmit is logged and changes nothing: one processed row, the next message unaffected."""

        async def twice(ws: ServerConnection, t: Transmit) -> None:
            await ws.send(answer(t).to_json())
            await ws.send(answer(t, status=400).to_json())  # a contradicting duplicate must not win

        async def scenario() -> None:
            async with faulty({("F2", 1): twice}) as (server, url):
                with capture_logs() as logs:
                    async with agent_running(settings_for(tmp_path, url)) as agent:
                        await send(agent, MESSAGES)
                        final = await all_processed(agent, MESSAGES)
                        await send(agent, ["F4"])
                        final = await all_processed(agent, [*MESSAGES, "F4"])
            assert final == {c: ("processed", 1) for c in [*MESSAGES, "F4"]}
            late = events(logs, "upstream_response_unmatched") + events(logs, "upstream_response_stale")
            assert len(late) == 1 and late[0]["status"] == 400
            assert [t.control_id for t in server.received] == [*MESSAGES, "F4"]

        run(scenario())

    def test_an_answer_with_the_wrong_attempt(self, tmp_path: Path) -> None:
        """An answer naming attempt 7 for attempt 1 settles nothing (logged); after the response timeout attempt 2 is processed."""

        async def wrong_attempt(ws: ServerConnection, t: Transmit) -> None:
            await ws.send(answer(t, attempt=7).to_json())

        async def scenario() -> None:
            server, logs, final = await through_fault(tmp_path, wrong_attempt)
            assert final["F2"] == ("processed", 2)
            (stale,) = events(logs, "upstream_response_stale")
            assert (stale["attempt"], stale["waiting_attempt"]) == (7, 1)
            assert [t.attempt for t in server.received if t.control_id == "F2"] == [1, 2]
            assert_nothing_lost(server.received, MESSAGES)

        run(scenario())


class TestTokenRotation:
    def test_401_after_the_server_rotates_the_token_until_token_file_is_rewritten(self, tmp_path: Path) -> None:
        """The server takes a new token: 401s are logged with a hint, intake keeps queueing, and the rewritten token_file is used without a restart."""
        token_file = tmp_path / "token"
        token_file.write_text("old-token\n")

        async def scenario() -> None:
            server = DevServer(token="old-token")
            await server.start()
            settings = settings_for(tmp_path, f"ws://127.0.0.1:{server.port}/agent", token=None,
                                    token_file=token_file, response_timeout=5)
            try:
                with capture_logs() as logs:
                    async with agent_running(settings) as agent:
                        await send(agent, ["T1"])
                        await all_processed(agent, ["T1"])
                        server.token = "new-token"  # rotated on the server side ...
                        await server.close_connections(1012, "service restart")
                        await until(lambda: events(logs, "upstream_auth_failed"), 15, "a 401")
                        await send(agent, ["T2", "T3"])  # ... while senders go on
                        assert states(agent)["T2"][0] == "queued"
                        token_file.write_text("new-token\n")  # ... and then in the agent's file
                        final = await all_processed(agent, ["T1", "T2", "T3"], timeout=30)
            finally:
                await server.stop()
            assert final == {c: ("processed", 1) for c in ("T1", "T2", "T3")}
            assert "token" in events(logs, "upstream_auth_failed")[0]["hint"]
            assert [t.control_id for t in server.received] == ["T1", "T2", "T3"]

        run(scenario(), timeout=90)


"""The dev server's lease-epoch rules, against plain WebSocket clients on 127.0.0.1.

Per (agent_id, queue_id) the server keeps the highest epoch it has seen: a
hello below it is refused (error, close 4001); a hello at or above it
supersedes the older sessions of that agent and queue (and the agent's
epoch-less sessions), whose frames are dropped from then on even when that
session never read the close (a frozen holder). A "frozen" client here is one
whose transport has stopped reading: it still sends, as a process resumed
after SIGSTOP does before it reads anything.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from agenttest import log_events as events
from agenttest import run_async as run
from structlog.testing import capture_logs
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from agent.app.devserver import DevServer
from agent.core.protocol import (
    ErrorMessage,
    Hello,
    Transmit,
    TransmitResponse,
    Welcome,
    parse_server_frame,
)

TOKEN = "dev-token"
QUEUE_A = "0e8f5a1c-5f43-4c1e-9d6b-1a2b3c4d5e6f"
QUEUE_B = "7d2c9b8a-1e0f-4a3b-8c5d-6e7f8a9b0c1d"
BODY = "MSH|^~\\&|LAB|HOSP|EHR|HOSP|20240501123000||ORU^R01|CTRL42|T|2.5.1\rOBX|1|NM|x||7\r"


def transmit(seq: int, *, id: str | None = None, attempt: int = 1) -> Transmit:
    return Transmit(
        id=id or f"id-{seq}", channel="lab", control_id=f"C{seq}", message_type="ORU^R01", seq=seq,
        attempt=attempt, received_at="2024-05-01T12:30:00.000Z", remote="10.0.0.9:4000",
        body=BODY, encoding="utf-8",
    )


@asynccontextmanager
async def dev_server(**kwargs: Any) -> AsyncIterator[DevServer]:
    server = DevServer(token=TOKEN, **kwargs)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def session(server: DevServer, *, epoch: int | None, queue_id: str | None = QUEUE_A,
                  agent_id: str = "edge-01") -> tuple[ClientConnection, Any]:
    """Connect and say hello; (connection, first server frame)."""
    ws = await connect(f"ws://127.0.0.1:{server.port}/agent",
                       additional_headers={"Authorization": f"Bearer {TOKEN}"}, proxy=None)
    await ws.send(Hello(agent_id, "0.2.0", epoch=epoch, queue_id=queue_id).to_json())
    return ws, parse_server_frame(await ws.recv())


async def closed_with(ws: ClientConnection) -> tuple[list[Any], int | None]:
    """Read until the server closes: the frames it sent first, and its close code."""
    frames = []
    try:
        async with asyncio.timeout(10):
            while True:
                frames.append(parse_server_frame(await ws.recv()))
    except ConnectionClosed as exc:
        return frames, exc.rcvd.code if exc.rcvd else None


async def answer(ws: ClientConnection, t: Transmit) -> TransmitResponse:
    await ws.send(t.to_json())
    response = parse_server_frame(await ws.recv())
    assert isinstance(response, TransmitResponse)
    return response


class TestRefusal:
    def test_a_hello_below_the_highest_epoch_is_refused_with_4001(self) -> None:
        """Epoch 4 after epoch 5 was seen: an error frame saying why, then close code 4001; no welcome."""

        async def scenario() -> None:
            async with dev_server() as server:
                new, first = await session(server, epoch=5)
                assert isinstance(first, Welcome)
                with capture_logs() as logs:
                    old, refusal = await session(server, epoch=4)
                    assert isinstance(refusal, ErrorMessage) and "below the highest seen (5)" in refusal.message
                    frames, code = await closed_with(old)
                assert code == 4001 and frames == []
                (line,) = events(logs, "dev_server_epoch_refused")
                assert (line["epoch"], line["highest"]) == (4, 5)
                assert [a.kind for a in server.timeline] == ["hello", "refused_hello"]
                assert (await answer(new, transmit(1))).status == 200  # the holder is untouched
                await new.close()

        run(scenario())

    def test_epochs_are_per_queue_so_a_new_queue_is_never_locked_out(self) -> None:
        """Queue B starts at epoch 1 although queue A of the same agent is at 9; A's session stays open."""

        async def scenario() -> None:
            async with dev_server() as server:
                a, _ = await session(server, epoch=9, queue_id=QUEUE_A)
                b, first = await session(server, epoch=1, queue_id=QUEUE_B)
                assert isinstance(first, Welcome)
                assert server.highest_epochs == {("edge-01", QUEUE_A): 9, ("edge-01", QUEUE_B): 1}
                assert (await answer(a, transmit(1))).status == 200
                assert (await answer(b, transmit(2))).status == 200
                await a.close()
                await b.close()

        run(scenario())

    def test_another_agent_id_is_independent(self) -> None:
        """Epochs of edge-02 neither refuse nor supersede edge-01."""

        async def scenario() -> None:
            async with dev_server() as server:
                one, _ = await session(server, epoch=3, agent_id="edge-01")
                two, first = await session(server, epoch=1, agent_id="edge-02")
                assert isinstance(first, Welcome)
                assert (await answer(one, transmit(1))).status == 200
                await one.close()
                await two.close()

        run(scenario())

    def test_without_epoch_tracking_nothing_is_refused(self) -> None:
        """track_epochs=False: a lower epoch is welcomed and no session is closed (a server that does not fence)."""

        async def scenario() -> None:
            async with dev_server(track_epochs=False) as server:
                a, _ = await session(server, epoch=5)
                b, first = await session(server, epoch=4)
                assert isinstance(first, Welcome)
                assert (await answer(a, transmit(1))).status == 200
                assert server.highest_epochs == {}
                await a.close()
                await b.close()

        run(scenario())


class TestSupersede:
    def test_a_higher_epoch_closes_the_older_session_with_4001(self) -> None:
        """The older session of the same agent and queue gets an error and close 4001 when epoch 6 says hello."""

        async def scenario() -> None:
            async with dev_server() as server:
                old, _ = await session(server, epoch=5)
                with capture_logs() as logs:
                    new, first = await session(server, epoch=6)
                    assert isinstance(first, Welcome)
                    frames, code = await closed_with(old)
                assert code == 4001
                assert [type(f) for f in frames] == [ErrorMessage] and "epoch 6" in frames[0].message
                (line,) = events(logs, "dev_server_session_superseded")
                assert (line["epoch"], line["by_epoch"]) == (5, 6)
                assert (await answer(new, transmit(1))).status == 200
                await new.close()

        run(scenario())

    def test_an_equal_epoch_replaces_the_same_holders_older_connection(self) -> None:
        """A reconnect under the same epoch (the old TCP half-open) closes the old one: one session per holder."""

        async def scenario() -> None:
            async with dev_server() as server:
                old, _ = await session(server, epoch=5)
                new, first = await session(server, epoch=5)
                assert isinstance(first, Welcome)
                _frames, code = await closed_with(old)
                assert code == 4001
                await new.close()

        run(scenario())

    def test_a_frozen_holders_late_frame_is_dropped_unrecorded(self) -> None:
        """The old session never reads the close (frozen) and then sends: the frame is dropped, not recorded, not answered."""

        async def scenario() -> None:
            async with dev_server() as server:
                old, _ = await session(server, epoch=5)
                assert (await answer(old, transmit(1))).status == 200
                old.transport.pause_reading()  # frozen: the close will sit unread
                with capture_logs() as logs:
                    new, _ = await session(server, epoch=6)
                    assert (await answer(new, transmit(2))).status == 200
                    await old.send(transmit(1, attempt=2).to_json())  # the stale frame, after seq 2
                    await server.wait_until(lambda: any(a.kind == "stale_frame" for a in server.timeline))
                assert [(t.seq, t.attempt) for t in server.received] == [(1, 1), (2, 1)]
                assert [r.id for r in server.sent] == ["id-1", "id-2"]
                (line,) = events(logs, "dev_server_stale_frame_dropped")
                assert (line["id"], line["seq"], line["attempt"], line["epoch"]) == ("id-1", 1, 2, 5)
                kinds = [(a.kind, a.epoch) for a in server.timeline]
                assert kinds == [("hello", 5), ("transmit", 5), ("hello", 6), ("transmit", 6),
                                 ("stale_frame", 5)]
                old.transport.resume_reading()
                _frames, code = await closed_with(old)
                assert code == 4001
                await new.close()

        run(scenario())

    @pytest.mark.parametrize("queue_id", [QUEUE_A, QUEUE_B, None])
    def test_an_epochless_session_of_the_agent_is_superseded(self, queue_id: str | None) -> None:
        """A session from an older agent version (no epoch) is older than any epoch of that agent_id, whatever the queue."""

        async def scenario() -> None:
            async with dev_server() as server:
                legacy, first = await session(server, epoch=None, queue_id=None)
                assert isinstance(first, Welcome)  # accepted: an older agent keeps working
                new, _ = await session(server, epoch=1, queue_id=queue_id)
                _frames, code = await closed_with(legacy)
                assert code == 4001
                await new.close()

        run(scenario())

    def test_epochless_sessions_are_never_refused(self) -> None:
        """After epoch 7, an older agent's hello without epoch is still welcomed (it cannot be fenced by epoch)."""

        async def scenario() -> None:
            async with dev_server() as server:
                holder, _ = await session(server, epoch=7)
                legacy, first = await session(server, epoch=None, queue_id=None)
                assert isinstance(first, Welcome)
                assert (await answer(holder, transmit(1))).status == 200
                await holder.close()
                await legacy.close()

        run(scenario())

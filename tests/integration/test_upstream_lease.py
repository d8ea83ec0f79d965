"""The link and the lease: epoch and queue id in hello, the write guard, close code 4001 (real DevServer on 127.0.0.1)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from agenttest import log_events as events
from agenttest import run_async as run
from agenttest import until
from structlog.testing import capture_logs

from agent.app.devserver import DevServer
from agent.core.protocol import Transmit
from agent.runtime.upstream import (
    EPOCH_REFUSED,
    LeaseExpired,
    LinkSettings,
    SessionClosed,
    UpstreamLink,
)

TOKEN = "s3cret-token"
QUEUE_ID = "3b0d8c2a-9f1e-4d7c-a5b6-0e1f2a3b4c5d"
BODY = "MSH|^~\\&|LAB|HOSP|EHR|HOSP|20240501123000||ADT^A01|MSG0001|P|2.5\rPID|1||123\r"


def settings(port: int, **overrides: Any) -> LinkSettings:
    fields: dict[str, Any] = {
        "url": f"ws://127.0.0.1:{port}/agent", "token": TOKEN, "agent_id": "edge-01", "version": "0.2.0",
        "connect_timeout": 2.0, "reconnect_initial": 0.01, "reconnect_cap": 0.05,
        "epoch": 3, "queue_id": QUEUE_ID,
    }
    fields.update(overrides)
    return LinkSettings(**fields)


def transmit(attempt: int = 1) -> Transmit:
    return Transmit(id="id-1", channel="adt", control_id="MSG0001", message_type="ADT^A01", seq=1,
                    attempt=attempt, received_at="2024-05-01T12:30:00.000Z", remote="10.1.2.3:50122",
                    body=BODY, encoding="utf-8")


@asynccontextmanager
async def dev_server(**kwargs: Any) -> AsyncIterator[DevServer]:
    server = DevServer(token=TOKEN, **kwargs)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@asynccontextmanager
async def running(link: UpstreamLink) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(link.run())
    try:
        yield task
    finally:
        await link.close()
        await task


class TestHello:
    def test_hello_carries_the_epoch_and_the_queue_id(self) -> None:
        """The server learns the epoch and queue id this link dispatches under."""

        async def scenario() -> None:
            async with dev_server() as server:
                async with running(UpstreamLink(settings(server.port, epoch=7))) as _task:
                    await until(lambda: server.highest_epochs)
                assert server.highest_epochs == {("edge-01", QUEUE_ID): 7}
                assert [(a.kind, a.epoch) for a in server.timeline] == [("hello", 7)]

        run(scenario())


class TestWriteGuard:
    def test_a_refused_guard_writes_nothing_and_raises(self) -> None:
        """When the lease is not proven valid, transmit raises LeaseExpired and the server receives nothing."""
        allowed = [True]

        async def scenario() -> None:
            async with dev_server() as server:
                link = UpstreamLink(settings(server.port), write_allowed=lambda: allowed[0])
                async with running(link):
                    session = await link.session()
                    allowed[0] = False
                    with pytest.raises(LeaseExpired):
                        await session.transmit(transmit())
                    assert session.in_flight == 0
                    allowed[0] = True
                    assert (await session.transmit(transmit(2))).status == 200
                assert [t.attempt for t in server.received] == [2]

        run(scenario())

    def test_no_connection_and_no_hello_without_a_valid_lease(self) -> None:
        """A link whose guard refuses never connects, so the server never sees a hello under a lapsed lease."""
        checks: list[bool] = []

        def never() -> bool:
            checks.append(False)
            return False

        async def scenario() -> None:
            async with dev_server() as server:
                with capture_logs() as logs:
                    link = UpstreamLink(settings(server.port), write_allowed=never)
                    async with running(link):
                        await until(lambda: len(checks) >= 3)
                        assert not link.connected
                assert server.connections == 0 and server.timeline == []
                assert events(logs, "upstream_connect_skipped")

        run(scenario())


class TestEpochRefused:
    def test_a_refused_hello_stops_the_link_and_is_logged(self) -> None:
        """Close 4001 at hello: upstream_epoch_refused, refused is set, no reconnect, session() raises."""

        async def scenario() -> None:
            async with dev_server() as server:
                server.highest_epochs[("edge-01", QUEUE_ID)] = 9
                with capture_logs() as logs:
                    link = UpstreamLink(settings(server.port, epoch=3))
                    async with running(link) as task:
                        async with asyncio.timeout(10):
                            await link.refused.wait()
                        async with asyncio.timeout(10):
                            await asyncio.shield(task)  # run() ends on its own
                        with pytest.raises(SessionClosed) as excinfo:
                            await link.session()
                        assert excinfo.value.code == EPOCH_REFUSED
                (line,) = events(logs, "upstream_epoch_refused")
                assert line["epoch"] == 3 and line["queue_id"] == QUEUE_ID
                assert "lease" in line["hint"]
                assert next(e["message"] for e in events(logs, "upstream_error_message")).startswith("lease epoch 3")
                assert server.connections == 1
                assert link.last_error is not None and "4001" in link.last_error

        run(scenario())

    def test_a_session_superseded_by_a_higher_epoch_fails_its_waiters_and_stops(self) -> None:
        """A newer holder's hello closes ours with 4001: the waiting transmit gets SessionClosed(4001) and the link stops."""

        async def never(t: Transmit) -> None:
            return None

        async def scenario() -> None:
            async with dev_server(decide=never) as server:
                with capture_logs() as logs:
                    old = UpstreamLink(settings(server.port, epoch=3))
                    new = UpstreamLink(settings(server.port, epoch=4))
                    async with running(old):
                        session = await old.session()
                        waiting = asyncio.create_task(session.transmit(transmit()))
                        await server.wait_until(lambda: len(server.received) == 1)
                        async with running(new):
                            await new.session()
                            with pytest.raises(SessionClosed) as excinfo:
                                await waiting
                            assert excinfo.value.epoch_refused and not excinfo.value.too_big
                            async with asyncio.timeout(10):
                                await old.refused.wait()
                            assert not new.refused.is_set()
                assert len(events(logs, "upstream_epoch_refused")) == 1
                # The old link never came back: one connection each.
                assert server.connections == 2

        run(scenario())

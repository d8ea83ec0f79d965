"""A lease tenure ends promptly when one of its tasks ends it, whatever the other tasks were doing.

Real Agent, real SQLite, real WebSocket dev server. The tenure's end is real:
a second session of the same agent and queue says hello with a higher lease
epoch, so the server closes ours with 4001. What the test controls is *when*,
relative to that close, a channel worker's wake-up comes: ``wake()`` is what
intake calls after each commit, and a wake-up left over from a row the worker
already took (or one for a row another process took) finds no head — the
worker goes back to waiting. Before Python 3.12, ``asyncio.wait_for`` loses
a cancellation that comes in the same loop turn as the event it waits on
(CPython gh-86296); a worker waiting that way kept running after its
TaskGroup cancelled it, so the tenure never ended while the queue stayed
idle: no ``dispatch_paused_epoch_refused``, no ``lease_lost``, the process
never back in standby (seen in tests/system/test_frozen_holder.py about one
run in four). The wake-up is placed at every loop turn from the close on, so
the one turn that used to lose the cancellation is always among them.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from agenttest import log_events as events
from agenttest import run_async as run
from agenttest import until
from structlog.testing import capture_logs
from websockets.asyncio.client import connect

from agent.app.config import Settings
from agent.app.devserver import DevServer
from agent.app.service import Agent
from agent.core.protocol import Hello, Welcome, parse_server_frame
from agent.runtime import dispatcher as dispatcher_module
from agent.runtime.aio import cancel_and_wait, wait_event

TOKEN = "tenure-token"
AGENT_ID = "tenure-test"
#: Loop turns after the refusal at which the worker's wake-up comes; the
#: cancellation reaches the worker a few turns after the close is read.
OFFSETS = range(16)


def settings_for(data_dir: Path, port: int) -> Settings:
    return Settings(
        agent={"id": AGENT_ID, "data_dir": data_dir, "shutdown_budget": 5},
        admin={"listen": ""},
        server={"url": f"ws://127.0.0.1:{port}/agent", "token": TOKEN, "response_timeout": 5,
                "connect_timeout": 2},
        queue={"synchronous": "normal", "min_free_disk_bytes": 0},
        dispatch={"lease_ttl": 30, "lease_heartbeat": 10, "lease_acquire_interval": 0.2},
        channels=[{"name": "adt", "listen": "127.0.0.1:0"}],
    )


async def supersede(server: DevServer, epoch: int, queue_id: str) -> contextlib.AsyncExitStack:
    """Open a session of the same agent and queue with a higher epoch (kept open until the stack closes)."""
    stack = contextlib.AsyncExitStack()
    ws = await stack.enter_async_context(
        connect(f"ws://127.0.0.1:{server.port}/agent", additional_headers={"Authorization": f"Bearer {TOKEN}"}))
    await ws.send(Hello(agent_id=AGENT_ID, version="test", epoch=epoch, queue_id=queue_id).to_json())
    assert isinstance(parse_server_frame(await ws.recv()), Welcome)
    return stack


async def refuse_with_wake_at(tmp_path: Path, offset: int) -> bool:
    """One tenure refused by the server, the worker woken ``offset`` loop turns after; did the tenure end?"""
    server = DevServer(token=TOKEN)
    await server.start()
    agent = Agent(settings_for(tmp_path / f"data-{offset}", server.port))
    woken = None
    try:
        await agent.start()
        d = agent.dispatcher
        assert d is not None
        await until(lambda: d.connected, 10, "the first session")
        link, epoch, queue_id = d.link, d.epoch, d.queue_id
        assert link is not None and epoch is not None and queue_id is not None

        async def wake_after_refusal() -> None:
            await link.refused.wait()
            for _ in range(offset):
                await asyncio.sleep(0)
            d.wake("adt")

        woken = asyncio.create_task(wake_after_refusal())
        async with await supersede(server, epoch + 1, queue_id):
            await until(lambda: link.refused.is_set(), 10, "the server's 4001")
            with contextlib.suppress(AssertionError):
                await until(lambda: not d.lease_held, 5, "the tenure to end")
            ended = not d.lease_held
    finally:
        await cancel_and_wait(woken)
        await agent.shutdown()
        await server.stop()
    return ended


class TestTenureEndsOnRefusal:
    def test_a_worker_woken_as_the_tenure_ends_does_not_keep_it_alive(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """At every loop turn of the wake-up the tenure ends within 5 s and the pause after a refused epoch is logged."""
        # The worker waits on its wake-up, not on a short poll, so the wake-up
        # is what ends its wait (the poll only narrows the window, it does not close it).
        monkeypatch.setattr(dispatcher_module, "IDLE_POLL_SECONDS", 30.0)
        stuck: list[int] = []

        async def scenario() -> None:
            with capture_logs() as logs:
                for offset in OFFSETS:
                    if not await refuse_with_wake_at(tmp_path, offset):
                        stuck.append(offset)
            assert stuck == [], f"tenure still running after the refusal with the wake-up at turns {stuck}"
            assert len(events(logs, "dispatch_paused_epoch_refused")) == len(OFFSETS)

        run(scenario(), timeout=110)


class TestWaitEvent:
    @pytest.mark.parametrize("turns", range(6))
    def test_a_cancellation_in_the_turn_the_event_fires_propagates(self, turns: int) -> None:
        """The waiter is cancelled ``turns`` loop turns after the event is set: CancelledError, never a normal return."""

        async def scenario() -> None:
            event = asyncio.Event()
            waiter = asyncio.create_task(wait_event(event, 30))
            await asyncio.sleep(0)  # the waiter is waiting
            event.set()
            for _ in range(turns):
                await asyncio.sleep(0)
            if waiter.done():
                assert waiter.result() is True  # it returned before the cancellation came
                return
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter

        run(scenario())

    def test_set_and_timeout(self) -> None:
        """True when set (also when already set), False after the timeout."""

        async def scenario() -> None:
            event = asyncio.Event()
            assert await wait_event(event, 0.01) is False
            asyncio.get_running_loop().call_soon(event.set)
            assert await wait_event(event, 5) is True
            assert await wait_event(event, 0) is True

        run(scenario())

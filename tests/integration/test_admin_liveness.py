"""/healthz follows the event loop: 503 while a real loop is stuck in a blocking call, 200 after.

The loop is stuck for real: a callback that blocks in ``threading.Event.wait``
runs on it, so nothing else on that loop runs — the heartbeat included — while
the admin server's own threads keep answering HTTP.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from agenttest import http_get, run_async, until, wait_for

from agent.app.config import AdminSettings, AgentSettings, Settings
from agent.app.health import check_health
from agent.app.service import Agent
from agent.runtime.admin import LOOP_STALL_LIMIT, AdminServer, LoopHeartbeat, RuntimeView
from agent.runtime.aio import cancel_and_wait
from agent.runtime.metrics import AgentMetrics


class LoopThread:
    """A real asyncio loop on its own thread, beating a LoopHeartbeat every 50 ms."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.heartbeat = LoopHeartbeat()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-loop", daemon=True)
        self.thread.start()

        async def start() -> asyncio.Task[None]:
            return asyncio.create_task(self.heartbeat.run(0.05))

        self.beating = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)

    def block(self) -> threading.Event:
        """Make the loop run a callback that blocks until the returned event is set."""
        release = threading.Event()
        self.loop.call_soon_threadsafe(release.wait, 60)
        return release

    def close(self) -> None:
        async def stop() -> None:
            await cancel_and_wait(self.beating)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    try:
        yield lt
    finally:
        lt.close()


def view(loop_thread: LoopThread) -> RuntimeView:
    return RuntimeView(
        agent_id="edge-01",
        version="9.9.9",
        started_at=0.0,
        listeners_up=lambda: True,
        db_writable=lambda: (True, "ok"),
        upstream_state=dict,
        lease_held=lambda: False,
        stats=dict,
        recent_failures=lambda n: [],
        loop_age=loop_thread.heartbeat.age,
    )


class TestStuckLoop:
    def test_healthz_503_while_stuck_then_200(self, loop_thread: LoopThread) -> None:
        """A stuck loop turns /healthz 503 with its age; /readyz is not about the loop; unstuck, 200 again."""
        with AdminServer("127.0.0.1:0", view(loop_thread), AgentMetrics(), loop_stall_limit=1.0) as admin:
            host, port = admin.address
            base = f"http://{host}:{port}"
            listen = f"{host}:{port}"
            assert http_get(base + "/healthz") == (200, b"ok\n")
            release = loop_thread.block()
            try:
                wait_for(lambda: http_get(base + "/healthz")[0] == 503, timeout=15, what="/healthz 503")
                status, body = http_get(base + "/healthz")
                assert status == 503
                assert body.startswith(b"unhealthy: event loop stuck for ")
                assert b"limit 1s" in body
                assert not check_health(listen), "`hl7-agent health` must fail on a stuck loop"
                assert http_get(base + "/readyz")[0] == 200
            finally:
                release.set()
            wait_for(lambda: http_get(base + "/healthz")[0] == 200, timeout=15, what="/healthz 200 again")
            assert check_health(listen)

    def test_a_busy_but_running_loop_stays_healthy(self, loop_thread: LoopThread) -> None:
        """Blocking the loop for less than the limit does not flap /healthz."""
        with AdminServer("127.0.0.1:0", view(loop_thread), AgentMetrics(), loop_stall_limit=5.0) as admin:
            host, port = admin.address
            release = loop_thread.block()
            try:
                assert http_get(f"http://{host}:{port}/healthz")[0] == 200
            finally:
                release.set()

    def test_without_a_heartbeat_healthz_is_process_liveness(self) -> None:
        """A view with no loop to watch (loop_age None) answers 200 as before."""
        plain = RuntimeView(
            agent_id="x", version="1", started_at=0.0, listeners_up=lambda: True,
            db_writable=lambda: (True, "ok"), upstream_state=dict, lease_held=lambda: False,
            stats=dict, recent_failures=lambda n: [],
        )
        with AdminServer("127.0.0.1:0", plain, AgentMetrics()) as admin:
            host, port = admin.address
            assert http_get(f"http://{host}:{port}/healthz")[0] == 200


class TestDaemonLoop:
    def test_the_daemon_wires_its_own_loop(self, tmp_path: Path) -> None:
        """The real Agent's /healthz goes 503 when its own loop is stuck past LOOP_STALL_LIMIT, and recovers."""
        settings = Settings(agent=AgentSettings(id="inproc", data_dir=tmp_path / "data"),
                            admin=AdminSettings(listen="127.0.0.1:0"), channels=[])
        seen: list[tuple[int, bytes]] = []

        async def main() -> None:
            agent = Agent(settings)
            await agent.start()
            try:
                assert agent.admin is not None
                host, port = agent.admin.address
                url = f"http://{host}:{port}/healthz"
                assert await asyncio.to_thread(http_get, url) == (200, b"ok\n")
                release = threading.Event()

                def probe() -> None:
                    try:
                        seen.append(wait_for(lambda: (r := http_get(url))[0] == 503 and r,
                                             timeout=LOOP_STALL_LIMIT + 15, what="/healthz 503"))
                    except AssertionError:
                        pass  # reported below, on the test's own thread
                    finally:
                        release.set()

                prober = threading.Thread(target=probe, daemon=True)
                prober.start()
                release.wait(LOOP_STALL_LIMIT + 20)  # blocks this loop: the daemon is stuck
                prober.join(5)
                assert seen, "/healthz stayed 200 while the daemon's loop was stuck"
                await until(lambda: http_get(url)[0] == 200, timeout=10, what="/healthz 200 again")
            finally:
                agent.stop_requested.set()
                await agent.shutdown()

        run_async(main(), timeout=90)
        assert seen[0][1].startswith(b"unhealthy: event loop stuck")

"""The dispatcher's lease fences on the wire, in process: a real Agent, real SQLite, a real DevServer.

A stall is simulated by moving the dispatcher's lease clock forward a whole
TTL right after the ``inflight`` commit (the only fake here: a real freeze is
tests/system/test_frozen_holder.py); the database, the sockets and the server
are real. The server's refusal of an epoch is real: it is seeded with a
higher epoch for this queue, as a server would remember one from a restored
backup of this queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from agenttest import db_rows, hl7_message, until
from agenttest import log_events as events
from agenttest import run_async as run
from structlog.testing import capture_logs

from agent.app.config import Settings
from agent.app.devserver import DevServer
from agent.app.service import Agent
from agent.core import mllp
from agent.runtime import dispatcher
from agent.storage import sqlite as db
from agent.storage.store import SqliteStore

TOKEN = "test-token"
TTL = 10.0


def settings_for(tmp_path: Path, port: int) -> Settings:
    return Settings(
        agent={"id": "lease-test", "data_dir": tmp_path / "data", "shutdown_budget": 5},
        admin={"listen": ""},
        server={"url": f"ws://127.0.0.1:{port}/agent", "token": TOKEN, "response_timeout": 5,
                "connect_timeout": 2},
        queue={"synchronous": "normal", "min_free_disk_bytes": 0},
        dispatch={"lease_ttl": TTL, "lease_heartbeat": 3, "lease_acquire_interval": 0.2,
                  "retry_initial": 0.1, "retry_cap": 0.5},
        channels=[{"name": "adt", "listen": "127.0.0.1:0"}],
    )


@asynccontextmanager
async def running(tmp_path: Path, **server_options: Any) -> AsyncIterator[tuple[DevServer, Agent]]:
    server = DevServer(token=TOKEN, **server_options)
    await server.start()
    agent = Agent(settings_for(tmp_path, server.port))
    try:
        await agent.start()
        yield server, agent
    finally:
        await agent.shutdown()
        await server.stop()


async def send(agent: Agent, *control_ids: str) -> None:
    port = agent.listeners[0].sock.getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    decoder = mllp.MllpDecoder(1 << 20)
    try:
        for cid in control_ids:
            writer.write(mllp.encode_frame(hl7_message(cid)))
            got: list[bytes] = []
            async with asyncio.timeout(10):
                while not got:
                    got = [e.payload for e in decoder.feed(await reader.read(65536)) if isinstance(e, mllp.Frame)]
    finally:
        writer.close()


def state(agent: Agent, control_id: str) -> tuple[str, int] | None:
    found = db_rows(agent.settings.db_path,
                    "SELECT state, attempts FROM messages WHERE control_id = ? AND seq IS NOT NULL", (control_id,))
    return (str(found[0][0]), int(found[0][1])) if found else None


def queue_id_of(db_path: Path) -> str:
    return str(db_rows(db_path, "SELECT value FROM meta WHERE key = 'queue_id'")[0][0])


class TestOwnClockCheck:
    @pytest.mark.parametrize("replay", [True, False], ids=["replaying", "non-replaying"])
    def test_a_holder_stalled_past_its_lease_writes_nothing_then_resends_under_a_new_epoch(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, replay: bool
    ) -> None:
        """A TTL passes between the inflight commit and the write: no frame under epoch 1; the row is resent once under epoch 2, never failed."""
        offset = [0.0]
        real_clock = dispatcher.lease_clock
        monkeypatch.setattr(dispatcher, "lease_clock", lambda: real_clock() + offset[0])
        def then_stall(original: Callable[..., int | None]) -> Callable[..., int | None]:
            def mark(self: SqliteStore, *args: Any, **kwargs: Any) -> int | None:
                attempt = original(self, *args, **kwargs)
                if attempt is not None and offset[0] == 0.0:
                    offset[0] = TTL  # the process "slept" a whole TTL right after this commit
                return attempt

            return mark

        # Both ways a row is marked inflight: a head claimed and sent in one statement, or a claimed one.
        for name in ("claim_and_send", "mark_inflight"):
            monkeypatch.setattr(SqliteStore, name, then_stall(getattr(SqliteStore, name)))

        async def scenario() -> None:
            with capture_logs() as logs:
                async with running(tmp_path, replay=replay) as (server, agent):
                    await send(agent, "M1")
                    await until(lambda: state(agent, "M1") == ("processed", 2), 15, "M1 processed")
                    await send(agent, "M2")
                    await until(lambda: state(agent, "M2") == ("processed", 1), 10, "M2 processed")
                    expected_queue = queue_id_of(agent.settings.db_path)
            # Nothing was written under the stalled epoch: M1 reached the server once, under epoch 2.
            assert [(a.kind, a.epoch) for a in server.timeline if a.kind == "hello"] == [("hello", 1), ("hello", 2)]
            sent = [(a.epoch, a.transmit.control_id, a.transmit.attempt)
                    for a in server.timeline if a.kind == "transmit" and a.transmit is not None]
            assert sent == [(2, "M1", 2), (2, "M2", 1)]
            assert server.highest_epochs == {("lease-test", expected_queue): 2}
            (lapsed,) = events(logs, "lease_validity_lapsed")
            assert lapsed["epoch"] == 1 and lapsed["since_renewal_s"] >= TTL
            assert events(logs, "transmit_not_sent_lease_unproven")
            assert [e["epoch"] for e in events(logs, "lease_lost")] == [1]
            assert [e["epoch"] for e in events(logs, "lease_acquired")] == [1, 2]

        run(scenario())


class TestServerRefusesEpoch:
    def test_a_refused_epoch_is_logged_and_dispatch_resumes_above_it(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The server has seen epoch 3 for this queue: epochs 1 and 2 are refused (4001, logged, backoff), 3 is welcomed, nothing is lost."""
        monkeypatch.setattr(dispatcher, "EPOCH_REFUSED_INITIAL", 0.05)
        monkeypatch.setattr(dispatcher, "EPOCH_REFUSED_CAP", 0.1)

        async def scenario() -> None:
            server = DevServer(token=TOKEN)
            await server.start()
            settings = settings_for(tmp_path, server.port)
            # The queue exists before the agent starts, so the server can know its id.
            db.open_database(settings.db_path, "lease-test", db.DatabaseOptions(), 0.0).close()
            server.highest_epochs[("lease-test", queue_id_of(settings.db_path))] = 3
            agent = Agent(settings)
            with capture_logs() as logs:
                try:
                    await agent.start()
                    # Accepted while the server refuses us: queued, not lost.
                    await send(agent, "R1")
                    await until(lambda: state(agent, "R1") == ("processed", 1), 20, "R1 processed")
                finally:
                    await agent.shutdown()
                    await server.stop()
            refused = [e["epoch"] for e in events(logs, "upstream_epoch_refused")]
            assert refused and refused == list(range(refused[0], 3))
            assert len(events(logs, "dispatch_paused_epoch_refused")) == len(refused)
            assert [a.epoch for a in server.timeline if a.kind == "transmit"] == [3]

        run(scenario())

"""The daemon on PostgreSQL, in process: intake, readiness and dispatch through database faults.

A real Agent (its listener, writer, reader, dispatcher and admin server), a
real DevServer, and the session's real PostgreSQL server, which the tests
stop and start, make read-only, or hold the agent's write lock on. What is
checked is what a sender and a monitor see: AR/CE 207 "resend later" (never
an accept) while the database cannot take a write, ``/readyz`` failing, and
everything resuming by itself, nothing accepted lost.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from agenttest import ack_code, err3, free_port, hl7_message, http_get, until
from agenttest import exchange as mllp_exchange
from agenttest import run_async as run
from pgserver import PgDatabase

from agent.app.cli import main
from agent.app.config import Settings
from agent.app.devserver import Answer, DevServer, default_answer
from agent.app.service import Agent
from agent.core.acks import AckCode, build_ack
from agent.core.envelope import read_msh
from agent.core.protocol import Transmit
from agent.storage import postgres
from agent.storage.postgres import PgOptions, PostgresDialect

TOKEN = "test-token"
AGENT_ID = "pg-service"


def settings_for(tmp_path: Path, db: PgDatabase, server_port: int, name: str = "a",
                 admin_port: int | None = None, **dispatch: Any) -> Settings:
    return Settings(
        agent={"id": AGENT_ID, "data_dir": tmp_path / name, "shutdown_budget": 5},
        admin={"listen": f"127.0.0.1:{admin_port}" if admin_port else ""},
        server={"url": f"ws://127.0.0.1:{server_port}/agent", "token": TOKEN, "response_timeout": 5,
                "connect_timeout": 2},
        queue={"backend": "postgresql", "dsn": db.dsn},
        dispatch={"lease_ttl": 10, "lease_heartbeat": 2, "lease_acquire_interval": 0.2,
                  "retry_initial": 0.1, "retry_cap": 0.5, **dispatch},
        channels=[{"name": "adt", "listen": "127.0.0.1:0"}],
    )


@asynccontextmanager
async def agent_on(settings: Settings) -> AsyncIterator[Agent]:
    agent = Agent(settings)
    try:
        await agent.start()
        yield agent
    finally:
        await agent.shutdown()


@asynccontextmanager
async def agent_started_while_down(settings: Settings, pg_server: Any) -> AsyncIterator[Agent]:
    """The database server stopped, then the agent started; the server started again afterwards
    unless the test did so itself."""
    await asyncio.to_thread(pg_server.stop)
    try:
        async with agent_on(settings) as agent:
            yield agent
    finally:
        if not pg_server.running:
            await asyncio.to_thread(pg_server.start)


@asynccontextmanager
async def dev_server() -> AsyncIterator[DevServer]:
    server = DevServer(token=TOKEN)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def send(agent: Agent, control_id: str) -> bytes:
    return await mllp_exchange(agent.listeners[0].sock.getsockname()[1], hl7_message(control_id))


def delivered(server: DevServer) -> list[str]:
    done = set(server.answered)
    return [t.control_id for t in list(server.received) if t.id in done]


async def ready(admin_port: int) -> int:
    status, _ = await asyncio.to_thread(http_get, f"http://127.0.0.1:{admin_port}/readyz")
    return status


class TestDatabaseFaults:
    def test_database_down_means_resend_later_and_everything_resumes(
        self, tmp_path: Path, pg_database: PgDatabase, pg_server: Any
    ) -> None:
        """Server stopped: AR/CE 207 and /readyz 503; started again: AA within seconds, /readyz 200,
        and the messages accepted before and after are all delivered, in order."""
        admin_port = free_port()

        async def scenario() -> dict[str, float]:
            async with dev_server() as server, agent_on(
                    settings_for(tmp_path, pg_database, server.port, admin_port=admin_port)) as agent:
                assert ack_code(await send(agent, "B1")) == "AA"
                await until(lambda: delivered(server) == ["B1"], 15, "B1 delivered")
                # Settled too: a settle the outage cut off is sent again afterwards (same id, which
                # a replaying server dedupes), and the delivery check below would count it twice.
                await until(lambda: pg_database.rows("SELECT state FROM messages WHERE control_id = 'B1'")
                            == [("processed",)], 15, "B1 settled")
                await asyncio.to_thread(pg_server.stop)
                try:
                    down = await send(agent, "D1")
                    assert (ack_code(down), err3(down)) == ("AR", "207")
                    assert await ready(admin_port) == 503
                finally:
                    await asyncio.to_thread(pg_server.start)
                back = time.monotonic()
                while ack_code(await send(agent, "A1")) != "AA":
                    assert time.monotonic() - back < 20, "no accept within 20 s of the server's start"
                    await asyncio.sleep(0.05)
                accepted_after = time.monotonic() - back
                await until(lambda: delivered(server) == ["B1", "A1"], 20, "A1 delivered")
                delivered_after = time.monotonic() - back
                assert await ready(admin_port) == 200
                return {"accepted_after_s": accepted_after, "delivered_after_s": delivered_after}

        figures = run(scenario(), timeout=90)
        print(f"database back: first accept after {figures['accepted_after_s']:.2f}s, "
              f"dispatch after {figures['delivered_after_s']:.2f}s")

    def test_read_only_database_means_resend_later_until_writable(
        self, tmp_path: Path, pg_database: PgDatabase, pg_server: Any
    ) -> None:
        """A standby promoted elsewhere leaves this one read-only (25006): AR/CE 207, then AA once writable."""
        admin_port = free_port()

        async def admin(sql: str) -> None:
            def go() -> None:
                with pg_server.connect() as conn:
                    conn.execute(sql)
                    conn.execute("SELECT pg_reload_conf()")
            await asyncio.to_thread(go)

        async def scenario() -> None:
            async with dev_server() as server, agent_on(
                    settings_for(tmp_path, pg_database, server.port, admin_port=admin_port)) as agent:
                assert ack_code(await send(agent, "B1")) == "AA"
                await admin("ALTER SYSTEM SET default_transaction_read_only = on")
                try:
                    refused = None
                    deadline = time.monotonic() + 10
                    while time.monotonic() < deadline:  # the reload reaches the session within moments
                        refused = await send(agent, f"R{int(time.monotonic() * 1000)}")
                        if ack_code(refused) != "AA":
                            break
                        await asyncio.sleep(0.05)
                    assert refused is not None and (ack_code(refused), err3(refused)) == ("AR", "207")
                    assert await ready(admin_port) == 503
                finally:
                    await admin("ALTER SYSTEM RESET default_transaction_read_only")
                back = time.monotonic()
                while ack_code(await send(agent, "A1")) != "AA":
                    assert time.monotonic() - back < 20
                    await asyncio.sleep(0.05)
                await until(lambda: "A1" in delivered(server), 20, "A1 delivered")

        run(scenario(), timeout=90)


    def test_a_frozen_database_means_resend_later_not_silence(
        self, tmp_path: Path, pg_database: PgDatabase, pg_server: Any
    ) -> None:
        """The server and its backends stopped (SIGSTOP): TCP stays up and no server-side timeout
        fires. A sender must still get AR/CE 207 within moments, and /readyz fail; after SIGCONT
        the agent resumes by itself."""
        admin_port = free_port()

        async def scenario() -> float:
            async with dev_server() as server:
                settings = settings_for(tmp_path, pg_database, server.port, admin_port=admin_port)
                settings.queue.busy_timeout = 1.0  # the write deadline is this + 5 s
                async with agent_on(settings) as agent:
                    assert ack_code(await send(agent, "B1")) == "AA"
                    with pg_server.frozen():
                        sent = time.monotonic()
                        down = await send(agent, "D1")
                        answered_after = time.monotonic() - sent
                        assert (ack_code(down), err3(down)) == ("AR", "207")
                        assert await ready(admin_port) == 503
                    back = time.monotonic()
                    while ack_code(await send(agent, "A1")) != "AA":
                        assert time.monotonic() - back < 30, "no accept within 30 s of the server's return"
                        await asyncio.sleep(0.1)
                    await until(lambda: delivered(server) == ["B1", "A1"], 30, "A1 delivered")
                    return answered_after

        answered_after = run(scenario(), timeout=120)
        # The write deadline (6 s), then at most one connection attempt (connect_timeout 5 s).
        assert answered_after < 14, f"the sender waited {answered_after:.1f}s for its AR"
        print(f"database frozen: AR after {answered_after:.2f}s")

    def test_a_database_away_at_start_is_waited_out(
        self, tmp_path: Path, pg_database: PgDatabase, pg_server: Any
    ) -> None:
        """Started while the server is down: the daemon runs, answers AR/CE 207 and fails /readyz;
        the server back, its first write migrates the empty schema, then AA and delivery."""
        admin_port = free_port()

        async def scenario() -> None:
            async with dev_server() as server:
                settings = settings_for(tmp_path, pg_database, server.port, admin_port=admin_port)
                async with agent_started_while_down(settings, pg_server) as agent:
                    down = await send(agent, "D1")
                    assert (ack_code(down), err3(down)) == ("AR", "207")
                    assert await ready(admin_port) == 503
                    await asyncio.to_thread(pg_server.start)
                    back = time.monotonic()
                    while ack_code(await send(agent, "A1")) != "AA":
                        assert time.monotonic() - back < 20, "no accept within 20 s of the server's start"
                        await asyncio.sleep(0.05)
                    await until(lambda: delivered(server) == ["A1"], 20, "A1 delivered")
                    assert await ready(admin_port) == 200
            # The schema the first connection made is this version's, owned by this agent.
            assert pg_database.rows("SELECT value FROM meta WHERE key = 'agent_id'") == [(AGENT_ID,)]
            assert pg_database.rows("SELECT control_id, state FROM messages") == [("A1", "processed")]

        run(scenario(), timeout=120)

    def test_another_agents_database_found_after_start_takes_nothing(
        self, tmp_path: Path, pg_database: PgDatabase, pg_server: Any, capsys: Any
    ) -> None:
        """The owner check a start skipped while the server was down runs at the first connection:
        another agent.id's queue is never written to, every message answered AR 207, and said why."""
        admin_port = free_port()
        other = postgres.PostgresDialect(PgOptions(dsn=pg_database.dsn, agent_id="someone-else"), role="writer")
        conn = postgres.open_database(other, "someone-else", time.time())
        conn.close()

        async def scenario() -> None:
            async with dev_server() as server:
                settings = settings_for(tmp_path, pg_database, server.port, admin_port=admin_port)
                async with agent_started_while_down(settings, pg_server) as agent:
                    await asyncio.to_thread(pg_server.start)
                    deadline = time.monotonic() + 5  # well past a few reconnection attempts
                    while time.monotonic() < deadline:
                        answer = await send(agent, f"X{int(time.monotonic() * 1000)}")
                        assert (ack_code(answer), err3(answer)) == ("AR", "207")
                        await asyncio.sleep(0.2)
                    assert await ready(admin_port) == 503

        run(scenario(), timeout=120)
        assert pg_database.rows("SELECT count(*) FROM messages") == [(0,)]
        logged = capsys.readouterr()
        assert "queue_database_refused" in logged.out + logged.err


class TestWhatAnOperatorSees:
    def test_status_page_metrics_and_the_audit_trail_read_the_shared_database(
        self, tmp_path: Path, pg_database: PgDatabase, monkeypatch: Any
    ) -> None:
        """On PostgreSQL as on SQLite: a 422 with a reason pauses the channel (on_reject = pause);
        /status.json and the page show the channel blocked, the server's reason and the database;
        /metrics has the queue's gauges; `channel resume` from the CLI is logged by the daemon."""
        reason = "unknown patient identifier in PID-3"

        async def decide(t: Transmit) -> Answer:
            if t.control_id == "P0":
                return Answer(422, build_ack(read_msh(t.body.encode()), AckCode.AE, text=reason).decode())
            return default_answer(t)

        admin_port = free_port()
        settings = settings_for(tmp_path, pg_database, 0, admin_port=admin_port)
        settings.channels[0].on_reject = "pause"
        config = tmp_path / "cli.toml"
        config.write_text(f'[agent]\nid = "{AGENT_ID}"\ndata_dir = "{tmp_path / "cli"}"\n[admin]\nlisten = ""\n'
                          f'[queue]\nbackend = "postgresql"\ndsn = "{pg_database.dsn}"\n'
                          '[[channels]]\nname = "adt"\nlisten = "127.0.0.1:1"\n', encoding="utf-8")
        for name in [n for n in os.environ if n.startswith("HL7_AGENT_")]:
            monkeypatch.delenv(name)

        async def get(path: str) -> tuple[int, str]:
            status, body = await asyncio.to_thread(http_get, f"http://127.0.0.1:{admin_port}{path}")
            return status, body if isinstance(body, str) else body.decode()

        async def scenario() -> None:
            server = DevServer(token=TOKEN, decide=decide)
            await server.start()
            try:
                settings.server.url = f"ws://127.0.0.1:{server.port}/agent"
                async with agent_on(settings) as agent:
                    for cid in ("P0", "P1", "P2"):
                        assert ack_code(await send(agent, cid)) == "AA"

                    async def blocked() -> bool:
                        data = json.loads((await get("/status.json"))[1])
                        found = [c for c in data["assessment"]["channels"] if c["name"] == "adt"]
                        return bool(found) and found[0]["state"] == "blocked"

                    deadline = time.monotonic() + 20
                    while not await blocked():
                        assert time.monotonic() < deadline, "channel never blocked by the pause"
                        await asyncio.sleep(0.1)
                    status, body = await get("/status.json")
                    data = json.loads(body)
                    (c,) = [c for c in data["assessment"]["channels"] if c["name"] == "adt"]
                    assert (c["blocked_by"], c["depth"], c["last_settled_state"]) == ("pause", 2, "rejected")
                    (failure,) = data["recent_failures"]
                    assert failure["server_reason"] == reason and failure["server_status"] == 422
                    assert data["stats"]["db"]["backend"] == "postgresql" and data["lease_held"] is True
                    assert data["history"]["depth"][-1] == 2
                    status, page = await get("/")
                    assert status == 200 and reason in page
                    status, metrics = await get("/metrics")
                    assert status == 200
                    assert 'hl7_agent_queue_depth{channel="adt",state="queued"} 2.0' in metrics
                    assert 'hl7_agent_channel_paused{channel="adt"} 1.0' in metrics
                    assert "hl7_agent_db_size_bytes " in metrics
                    # An operator on any host resumes the channel: the daemon logs the entry (marks it).
                    assert await asyncio.to_thread(main, ["channel", "resume", "adt", "--config", str(config)]) == 0
                    await until(lambda: "P2" in delivered(server), 20, "the rest delivered after the resume")

                    def logged() -> bool:
                        return pg_database.rows("SELECT action FROM operator_actions "
                                                "WHERE logged_at IS NOT NULL") == [("resume",)]

                    await until(logged, 10, "the daemon to log the operator's action")
            finally:
                await server.stop()

        run(scenario(), timeout=90)


class TestStandby:
    def test_a_standby_waits_for_the_lease_without_the_write_lock(
        self, tmp_path: Path, pg_database: PgDatabase
    ) -> None:
        """While another process holds the lease, a standby polls it with reads only: its writer never
        queues for the agent's write lock (here held by an outside session), so it costs the holder's
        and other hosts' writes nothing."""

        async def scenario() -> None:
            async with dev_server() as server, \
                    agent_on(settings_for(tmp_path, pg_database, server.port, "a")) as holder:
                await until(lambda: holder.dispatcher is not None and holder.dispatcher.lease_held, 10, "a lease")
                async with agent_on(settings_for(tmp_path, pg_database, server.port, "b",
                                                 lease_acquire_interval=0.05)) as standby:
                    assert standby.writer is not None and standby.dispatcher is not None
                    # The standby's first retention sweep is its one write at start.
                    await until(lambda: standby.writer is not None and standby.writer.batches >= 1, 10,
                                "the standby's start-up sweep")
                    pid = standby.writer.store.conn.info.backend_pid
                    outside = PostgresDialect(PgOptions(dsn=pg_database.dsn, agent_id=AGENT_ID), role="writer")
                    conn = await asyncio.to_thread(outside.connect)
                    try:
                        await asyncio.to_thread(outside.begin_write, conn)  # the agent's write lock
                        waits = 0
                        for _ in range(40):  # 40 polls, 2 s: about 40 of the standby's lease checks
                            rows = await asyncio.to_thread(pg_database.rows,
                                "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'",
                                (pid,))
                            waits += len(rows)
                            await asyncio.sleep(0.05)
                        assert waits == 0, "the standby's writer queued for the write lock"
                        assert not standby.dispatcher.lease_held
                    finally:
                        await asyncio.to_thread(outside.rollback, conn)
                        conn.close()

        run(scenario(), timeout=60)


    def test_a_standby_on_another_host_is_no_second_instance_by_mistake(
        self, tmp_path: Path, pg_database: PgDatabase
    ) -> None:
        """On PostgreSQL another process holding the lease is the design (hosts sharing one queue),
        not a process started beside this one by mistake: the standby does not report one."""

        async def scenario() -> None:
            async with dev_server() as server, \
                    agent_on(settings_for(tmp_path, pg_database, server.port, "a")) as holder:
                await until(lambda: holder.dispatcher is not None and holder.dispatcher.lease_held, 10, "a lease")
                async with agent_on(settings_for(tmp_path, pg_database, server.port, "b")) as standby:
                    assert standby.dispatcher is not None and not standby.dispatcher.lease_held
                    assert await standby._other_instance() is None
                    assert await holder._other_instance() is None

        run(scenario(), timeout=60)


class TestIdleHolder:
    def test_an_idle_holder_polls_with_reads_and_writes_only_its_renewals(
        self, tmp_path: Path, pg_database: PgDatabase
    ) -> None:
        """Nothing queued: the holder looks at each channel's head with reads (the reader's
        connection), so in 5 s its writer commits about the lease renewals (heartbeat 2 s) and
        nothing per poll; the agent's write lock stays free for the other hosts' intake."""

        async def scenario() -> int:
            async with dev_server() as server, agent_on(settings_for(tmp_path, pg_database, server.port)) as agent:
                await until(lambda: agent.dispatcher is not None and agent.dispatcher.lease_held, 10, "the lease")
                assert agent.writer is not None and agent.reader is not None
                await asyncio.sleep(1.0)  # start-up writes (the first sweep, recovery) are done
                before = agent.writer.batches
                await asyncio.sleep(5.0)  # a measurement window, not synchronisation
                return agent.writer.batches - before

        batches = run(scenario(), timeout=60)
        assert batches <= 4, f"{batches} write transactions in 5 s of an idle holder"


def test_postgres_module_is_the_dialect_in_use(tmp_path: Path, pg_database: PgDatabase) -> None:
    """The service opens the configured backend: both of its stores run on PostgresDialect."""

    async def scenario() -> None:
        settings = settings_for(tmp_path, pg_database, 1)
        settings.server.url = None
        async with agent_on(settings) as agent:
            assert agent.writer is not None and agent.reader is not None
            assert isinstance(agent.writer.store.dialect, postgres.PostgresDialect)
            assert isinstance(agent.reader.store.dialect, postgres.PostgresDialect)
            assert (tmp_path / "a").is_dir()  # the state directory for the hand-over sockets
            assert not (tmp_path / "a" / "queue.db").exists()
            assert ack_code(await send(agent, "P1")) == "AA"

    run(scenario(), timeout=30)


"""What the status page is told, from a real Agent in process: the dispatcher's and the store's facts.

A real ``Agent`` (real SQLite file, MLLP on 127.0.0.1 port 0) against a real
``DevServer`` whose ``decide`` hook scripts the server; the page's facts are
read through the same ``RuntimeView`` the admin endpoint uses.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from agenttest import http_get, log_events, until
from agenttest import run_async as run
from structlog.testing import capture_logs

from agent.app.devserver import Answer, default_answer
from agent.app.service import Agent
from agent.core.acks import AckCode, build_ack
from agent.core.envelope import read_msh
from agent.core.protocol import Transmit
from agent.core.states import State
from tests.agenttest import hl7_message
from tests.integration import test_store_contract as contract
from tests.integration.test_dispatch import (
    agent_running,
    dev_server,
    port_of,
    send_all,
    settings_for,
    url,
)
from tests.integration.test_store_contract import Harness, acquire, holder, queue_n, send

#: The contract's fixture: a fresh store per test, for every backend it is parametrised by.
harness = contract.harness


class TestUpstreamSince:
    def test_changed_at_moves_when_the_session_comes_up_and_goes_down(self, tmp_path: Path) -> None:
        """upstream_changed_at() is the start until a session is up, then each change's time."""

        async def scenario() -> None:
            async with dev_server() as server:
                settings = settings_for(tmp_path, url(server), [{"name": "adt"}])
                before = time.time()
                async with agent_running(settings) as agent:
                    dispatcher = agent.dispatcher
                    assert dispatcher is not None
                    started = dispatcher.upstream_changed_at()
                    assert before <= started <= time.time()
                    await until(lambda: dispatcher.connected, 10, "upstream connected")
                    up_at = dispatcher.upstream_changed_at()
                    assert up_at > started
                    await server.close_connections(1001, "going away")
                    await until(lambda: not dispatcher.connected, 10, "upstream down")
                    down_at = dispatcher.upstream_changed_at()
                    assert down_at > up_at and not dispatcher.upstream_state()["connected"]

        run(scenario())

    def test_a_password_in_the_server_url_is_never_shown(self, tmp_path: Path) -> None:
        """ws://user:pw@host: the status page, /status.json and agent_started show the URL without user info."""

        async def scenario() -> None:
            async with dev_server() as server:
                secret_url = url(server).replace("ws://", "ws://agent:s3cret@")
                settings = settings_for(tmp_path, secret_url, [{"name": "adt"}])
                async with agent_running(settings) as agent:
                    dispatcher = agent.dispatcher
                    assert dispatcher is not None
                    assert dispatcher.upstream_state()["url"] == url(server)

        with capture_logs() as logs:
            run(scenario())
        (started,) = log_events(logs, "agent_started")
        assert "s3cret" not in str(started) and "agent:" not in str(started["upstream"])


class TestChannelActivity:
    """The store's facts per channel (any backend: written against the contract harness)."""

    def test_an_unknown_or_empty_channel_has_nothing(self, harness: Harness) -> None:
        """No head, nothing received or delivered, not paused."""
        (empty,) = harness.store.channel_activity(["adt"])
        assert (empty.channel, empty.head, empty.last_received_at, empty.last_settled) == ("adt", None, None, None)
        assert not empty.paused and empty.paused_at is None and empty.paused_reason is None
        assert harness.store.live_depth() == 0

    def test_head_retrying_behind_a_delivered_row(self, harness: Harness) -> None:
        """The head's attempts, backoff and last error; the last row in and the last one out."""
        ids = queue_n(harness, 3)
        queue_n(harness, 2, "lab")
        epoch = acquire(harness, holder("h1"))
        first = send(harness, "h1", epoch, ids[0])
        harness.clock.advance(2)
        delivered_at = harness.clock.now
        assert harness.tx(lambda s: s.settle("h1", epoch, ids[0], first, State.PROCESSED,
                                             server_status=200, server_ack=None))
        harness.clock.advance(3)
        second = send(harness, "h1", epoch, ids[1])
        due = harness.clock.now + 7
        assert harness.tx(lambda s: s.requeue("h1", epoch, ids[1], second, due, server_status=503,
                                              error_code="503", error_text="transient status 503"))
        adt, lab = harness.store.channel_activity(["adt", "lab"])
        assert adt.head is not None and adt.head.id == ids[1] and adt.head.state == State.QUEUED
        assert (adt.head.attempts, adt.head.redrive_base, adt.head.next_attempt_at) == (1, 0, due)
        assert (adt.head.server_status, adt.head.error_code, adt.head.error_text) == (
            503, "503", "transient status 503")
        assert adt.last_received_at == harness.row(ids[2])["received_at"]
        assert adt.last_settled is not None
        assert (adt.last_settled.state, adt.last_settled.settled_at) == (State.PROCESSED, delivered_at)
        assert "body" not in {f for f in vars(adt.head)}
        assert lab.head is not None and lab.head.attempts == 0 and lab.last_settled is None
        assert harness.store.live_depth() == 4

    def test_last_delivered_with_no_head_left_and_a_rejection(self, harness: Harness) -> None:
        """With every row settled the last one out is the newest; its state says how it ended."""
        ids = queue_n(harness, 2)
        epoch = acquire(harness, holder("h1"))
        attempt = send(harness, "h1", epoch, ids[0])
        assert harness.tx(lambda s: s.settle("h1", epoch, ids[0], attempt, State.PROCESSED,
                                             server_status=200, server_ack=None))
        harness.clock.advance(1)
        attempt = send(harness, "h1", epoch, ids[1])
        ack = "MSH|^~\\&|EHR|C|LAB|N|20260101||ACK|1|P|2.5\rMSA|AE|C1|unknown patient\r"
        assert harness.tx(lambda s: s.settle("h1", epoch, ids[1], attempt, State.REJECTED,
                                             server_status=422, server_ack=ack,
                                             error_code="422", error_text="rejected by server (status 422)"))
        (adt,) = harness.store.channel_activity(["adt"])
        assert adt.head is None and adt.last_settled is not None
        assert adt.last_settled.state == State.REJECTED and adt.last_settled.settled_at == harness.clock.now
        assert harness.store.server_acks([ids[0], ids[1], "no-such-id"]) == {ids[1]: ack}

    def test_paused_by_whom_and_since_when(self, harness: Harness) -> None:
        """The pause flag with its time and reason; resumed, both are gone."""
        queue_n(harness, 1)
        harness.tx(lambda s: s.pause_channel("adt", "operator (alice)"))
        (adt,) = harness.store.channel_activity(["adt"])
        assert adt.paused and adt.paused_at == harness.clock.now and adt.paused_reason == "operator (alice)"
        harness.tx(lambda s: s.resume_channel("adt"))
        (adt,) = harness.store.channel_activity(["adt"])
        assert not adt.paused and adt.paused_at is None and adt.paused_reason is None


REASON = "unknown patient identifier in PID-3"


async def status_json(agent: Agent) -> dict[str, Any]:
    """GET /status.json from the agent's own admin server (on a thread: the loop keeps running)."""
    assert agent.admin is not None
    host, port = agent.admin.address
    status, body = await asyncio.to_thread(http_get, f"http://{host}:{port}/status.json")
    assert status == 200
    data: dict[str, Any] = json.loads(body)
    return data


def adt(data: dict[str, Any]) -> dict[str, Any]:
    (found,) = [c for c in data["assessment"]["channels"] if c["name"] == "adt"]
    return found


class TestStatusJsonOfARunningAgent:
    def test_a_head_retrying_a_503_is_retrying_with_its_facts(self, tmp_path: Path) -> None:
        """503 forever: /status.json says retrying, attempt n, the error, the next try and who waits."""

        async def decide(t: Transmit) -> Answer:
            return Answer(503)

        async def scenario() -> None:
            async with dev_server(decide) as server:
                settings = settings_for(tmp_path, url(server), [{"name": "adt"}], admin={"listen": "127.0.0.1:0"})
                async with agent_running(settings) as agent:
                    await send_all(port_of(agent, "adt"), [hl7_message(f"R{i}") for i in range(4)])
                    await until(lambda: len(server.received) >= 2, 15, "two attempts")
                    data = await status_json(agent)
                    c = adt(data)
                    assert c["state"] == "retrying" and c["level"] == "warn", c
                    assert c["attempt"] >= 1 and c["waiting_behind"] == 3 and c["depth"] == 4
                    assert c["last_error"] == "transient status 503"
                    assert c["last_received_at"] is not None and c["last_settled_at"] is None
                    assert data["assessment"]["upstream"]["state"] == "connected"
                    assert data["upstream"]["since"] is not None  # the dispatcher's accessor, as RFC 3339
                    assert data["history"]["in"][-1] + data["history"]["in"][-2] == 4
                    assert data["history"]["depth"][-1] == 4
                    for key in ("agent_id", "version", "started_at", "generated_at", "uptime_s", "listeners_up",
                                "upstream", "lease_held", "stats", "recent_failures", "errors"):
                        assert key in data  # the keys /status.json always had stay
                    assert data["errors"] == {}

        run(scenario())

    def test_a_rejection_shows_the_servers_reason_and_the_pause_blocks(self, tmp_path: Path) -> None:
        """422 with an AE naming the reason; on_reject = pause: the failure shows the reason, the channel is blocked."""

        async def decide(t: Transmit) -> Answer:
            if t.control_id == "P0":
                inbound = read_msh(t.body.encode())
                return Answer(422, build_ack(inbound, AckCode.AE, text=REASON, error_code=204).decode())
            return default_answer(t)

        async def scenario() -> None:
            async with dev_server(decide) as server:
                settings = settings_for(tmp_path, url(server), [{"name": "adt", "on_reject": "pause"}],
                                        admin={"listen": "127.0.0.1:0"})
                async with agent_running(settings) as agent:
                    await send_all(port_of(agent, "adt"), [hl7_message(f"P{i}") for i in range(3)])

                    async def paused() -> bool:
                        # blocked_by, not the state: just after start the same rows are
                        # "blocked: no lease" until the dispatcher has taken it.
                        return adt(await status_json(agent))["blocked_by"] == "pause"

                    deadline = time.monotonic() + 15
                    while not await paused():
                        assert time.monotonic() < deadline, "channel never blocked by the pause"
                        await asyncio.sleep(0.05)
                    data = await status_json(agent)
                    c = adt(data)
                    assert (c["blocked_by"], c["depth"], c["level"]) == ("pause", 2, "bad")
                    assert c["paused_reason"].startswith("rejected row ") and "(status 422)" in c["paused_reason"]
                    assert c["last_settled_state"] == "rejected"
                    (failure,) = data["recent_failures"]
                    assert failure["server_reason"] == REASON  # MSA-3 written for people; codes only stand in
                    assert failure["error_text"] == "rejected by server (status 422)"
                    assert data["assessment"]["level"] == "bad"
                    assert data["history"]["out"][-1] + data["history"]["out"][-2] == 1

        run(scenario())

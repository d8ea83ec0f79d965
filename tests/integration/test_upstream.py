"""The WebSocket link against a real in-process DevServer on 127.0.0.1 (SPEC 5, 6)."""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
from agenttest import log_events as events
from agenttest import make_test_pki, until
from agenttest import run_async as run
from structlog.testing import capture_logs
from websockets.asyncio.client import connect as ws_connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.proxy import get_proxy
from websockets.uri import parse_uri

from agent.app.devserver import Answer, DevServer, default_answer
from agent.core.protocol import Transmit, TransmitResponse
from agent.errors import ProtocolError
from agent.runtime.upstream import (
    LinkSettings,
    SessionClosed,
    TransmitInProgress,
    TransmitTooLarge,
    UpstreamLink,
)

T = TypeVar("T")
TOKEN = "s3cret-token"
BODY = "MSH|^~\\&|LAB|HOSP|EHR|HOSP|20240501123000||ADT^A01|MSG0001|P|2.5\rPID|1||123\r"


def settings(port: int, **overrides: Any) -> LinkSettings:
    fields: dict[str, Any] = {
        "url": f"ws://127.0.0.1:{port}/agent",
        "token": TOKEN,
        "agent_id": "edge-01",
        "version": "0.1.0",
        "connect_timeout": 2.0,
        "reconnect_initial": 0.01,
        "reconnect_cap": 0.05,
    }
    fields.update(overrides)
    return LinkSettings(**fields)


def transmit(attempt: int = 1, *, id: str = "id-1", body: str = BODY) -> Transmit:
    return Transmit(
        id=id,
        channel="adt",
        control_id="MSG0001",
        message_type="ADT^A01",
        seq=1,
        attempt=attempt,
        received_at="2024-05-01T12:30:00.000Z",
        remote="10.1.2.3:50122",
        body=body,
        encoding="utf-8",
    )


@asynccontextmanager
async def running(link: UpstreamLink) -> AsyncIterator[asyncio.Task[None]]:
    """Run ``link`` for the block; close it and make sure run() returned."""
    task = asyncio.create_task(link.run())
    try:
        yield task
    finally:
        await link.close()
        await task


@asynccontextmanager
async def dev_server(**kwargs: Any) -> AsyncIterator[DevServer]:
    kwargs.setdefault("token", TOKEN)
    server = DevServer(**kwargs)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


class TestHandshake:
    def test_hello_welcome_publishes_a_session(self) -> None:
        """With the right token the link says hello, gets welcome and publishes a session."""

        async def scenario() -> None:
            async with dev_server(replay=True) as server:
                link = UpstreamLink(settings(server.port))
                assert not link.connected and link.current() is None
                async with running(link):
                    session = await link.session()
                    assert session.replay is True
                    assert link.connected and link.current() is session
                    assert link.last_error is None
                    assert server.connections == 1

        run(scenario())

    def test_user_info_in_the_url_does_not_make_a_second_authorization_header(self) -> None:
        """wss://user:pw@host with a token: websockets would add "Authorization: Basic" beside our
        Bearer one, and a server refuses two (websockets answers 500). Only the bearer token goes."""

        async def scenario() -> None:
            async with dev_server() as server:
                link = UpstreamLink(settings(server.port, url=f"ws://bob:pw@127.0.0.1:{server.port}/agent"))
                async with running(link):
                    async with asyncio.timeout(10):
                        await link.session()
                    assert link.last_error is None

        run(scenario())

    def test_welcome_without_replay_is_reported(self) -> None:
        """welcome.replay false reaches the session (the dispatcher then fails inflight rows)."""

        async def scenario() -> None:
            async with dev_server(replay=False) as server:
                link = UpstreamLink(settings(server.port))
                async with running(link):
                    assert (await link.session()).replay is False

        run(scenario())

    def test_bad_token_keeps_retrying_and_never_connects(self) -> None:
        """A 401 logs upstream_auth_failed with a hint and the link keeps retrying, disconnected."""

        async def scenario() -> None:
            async with dev_server() as server:
                with capture_logs() as logs:
                    link = UpstreamLink(settings(server.port, token="wrong"))
                    async with running(link):
                        await until(lambda: len(events(logs, "upstream_auth_failed")) >= 3)
                        assert not link.connected
                        assert link.last_error is not None and "401" in link.last_error
                assert "token" in events(logs, "upstream_auth_failed")[0]["hint"]
                assert server.connections == 0

        run(scenario())

    def test_token_source_is_read_before_every_connect(self) -> None:
        """A rotated token_file takes effect at the next reconnect, with no restart."""
        current = {"token": "old-token"}

        async def scenario() -> None:
            async with dev_server() as server:
                with capture_logs() as logs:
                    link = UpstreamLink(settings(server.port, token="old-token",
                                                 token_source=lambda: current["token"]))
                    async with running(link):
                        await until(lambda: len(events(logs, "upstream_auth_failed")) >= 1)
                        current["token"] = TOKEN  # the operator rotates the file
                        await link.session()
                assert server.connections == 1

        run(scenario())

    def test_missing_welcome_times_out_and_retries(self) -> None:
        """A server that never welcomes is dropped after connect_timeout and retried."""
        hellos: list[dict[str, Any]] = []

        async def mute(ws: ServerConnection) -> None:
            hellos.append(json.loads(await ws.recv()))
            await ws.wait_closed()

        async def scenario() -> None:
            async with serve(mute, "127.0.0.1", 0) as server:
                port = server.sockets[0].getsockname()[1]
                with capture_logs() as logs:
                    link = UpstreamLink(settings(port, connect_timeout=0.2))
                    async with running(link):
                        await until(lambda: len(events(logs, "upstream_welcome_timeout")) >= 2)
                        assert not link.connected
            assert hellos[0] == {
                "type": "hello",
                "agent_id": "edge-01",
                "version": "0.1.0",
                "protocol": 1,
            }

        run(scenario())

    def test_session_raises_after_close(self) -> None:
        """Once the link is closed, waiting for a session raises instead of hanging."""

        async def scenario() -> None:
            link = UpstreamLink(settings(1))
            await link.close()
            with pytest.raises(SessionClosed):
                await link.session()

        run(scenario())


class TestTransmit:
    def test_default_answer_is_200_with_an_hl7_ack(self) -> None:
        """A transmit comes back 200 with the server's AA for our control id."""

        async def scenario() -> None:
            async with dev_server() as server:
                link = UpstreamLink(settings(server.port))
                async with running(link):
                    session = await link.session()
                    response = await session.transmit(transmit())
            assert response.id == "id-1" and response.attempt == 1
            assert response.status == 200
            assert response.ack is not None and "MSA|AA|MSG0001" in response.ack
            assert [t.id for t in server.received] == ["id-1"]
            assert server.received[0].body == BODY

        run(scenario())

    def test_statuses_come_back_without_link_retries(self) -> None:
        """503 then 200 come back as they are; the link never resends on its own."""
        statuses = iter([503, 200])

        async def decide(t: Transmit) -> Answer:
            return Answer(next(statuses))

        async def scenario() -> None:
            async with dev_server(decide=decide) as server:
                link = UpstreamLink(settings(server.port))
                async with running(link):
                    session = await link.session()
                    first = await session.transmit(transmit(1))
                    second = await session.transmit(transmit(2))
            assert (first.status, first.attempt) == (503, 1)
            assert (second.status, second.attempt) == (200, 2)
            assert second.ack is None
            assert [t.attempt for t in server.received] == [1, 2]

        run(scenario())

    def test_replay_returns_remembered_answer_with_current_attempt(self) -> None:
        """A resend of an id answered 2xx gets the same answer, re-stamped with its attempt."""
        decided: list[int] = []

        async def decide(t: Transmit) -> Answer:
            decided.append(t.attempt)
            return default_answer(t)

        async def scenario() -> None:
            async with dev_server(decide=decide, replay=True) as server:
                link = UpstreamLink(settings(server.port))
                async with running(link):
                    session = await link.session()
                    first = await session.transmit(transmit(1))
                    again = await session.transmit(transmit(2))
            assert decided == [1]
            assert again == TransmitResponse("id-1", 2, first.status, first.ack)
            assert server.answered["id-1"].attempt == 1

        run(scenario())

    def test_late_answer_for_older_attempt_is_ignored(self) -> None:
        """An answer to attempt 1 arriving while attempt 2 waits does not settle attempt 2."""
        release = asyncio.Event()
        server_box: list[DevServer] = []

        async def decide(t: Transmit) -> Answer:
            if t.attempt == 1:
                await release.wait()
                return Answer(200, ack="late")
            release.set()
            server = server_box[0]
            await server.wait_until(lambda: any(r.attempt == 1 for r in server.sent))
            return Answer(503)

        async def scenario() -> None:
            async with dev_server(decide=decide) as server:
                server_box.append(server)
                with capture_logs() as logs:
                    link = UpstreamLink(settings(server.port))
                    async with running(link):
                        session = await link.session()
                        first = asyncio.create_task(session.transmit(transmit(1)))
                        await server.wait_until(lambda: len(server.received) == 1)
                        first.cancel()  # what asyncio.wait_for(response_timeout) does
                        with pytest.raises(asyncio.CancelledError):
                            await first
                        response = await session.transmit(transmit(2))
                assert (response.attempt, response.status) == (2, 503)
                stale = events(logs, "upstream_response_stale")
                assert [(e["attempt"], e["waiting_attempt"]) for e in stale] == [(1, 2)]
                assert all("late" not in str(e) for e in logs)

        run(scenario())

    def test_oversized_transmit_is_never_sent(self) -> None:
        """A frame over max_frame_bytes raises TransmitTooLarge (a ProtocolError) and is not sent."""

        async def scenario() -> None:
            async with dev_server() as server:
                link = UpstreamLink(settings(server.port, max_frame_bytes=1024))
                async with running(link):
                    session = await link.session()
                    with pytest.raises(TransmitTooLarge) as excinfo:
                        await session.transmit(transmit(body=BODY + "X" * 2000))
                    assert isinstance(excinfo.value, ProtocolError)
                    assert excinfo.value.limit == 1024
                    # the session is still usable for normal frames
                    ok = await session.transmit(transmit(id="id-2"))
            assert ok.status == 200
            assert [t.id for t in server.received] == ["id-2"]

        run(scenario())

    def test_same_id_twice_on_one_session_is_refused(self) -> None:
        """Two concurrent transmits of one id are a dispatcher bug and refused loudly."""

        async def never(t: Transmit) -> None:
            return None

        async def scenario() -> None:
            async with dev_server(decide=never) as server:
                link = UpstreamLink(settings(server.port))
                async with running(link):
                    session = await link.session()
                    first = asyncio.create_task(session.transmit(transmit(1)))
                    await server.wait_until(lambda: len(server.received) == 1)
                    with pytest.raises(TransmitInProgress):
                        await session.transmit(transmit(2))
                    first.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await first
                    assert session.in_flight == 0

        run(scenario())

    def test_error_and_garbage_frames_are_logged_not_fatal(self) -> None:
        """Server error frames and malformed frames are logged; the session goes on."""

        async def chatty(ws: ServerConnection) -> None:
            await ws.recv()  # hello
            await ws.send(json.dumps({"type": "error", "message": "warming up"}))
            await ws.send(json.dumps({"type": "welcome", "replay": True}))
            t = json.loads(await ws.recv())
            await ws.send(json.dumps({"type": "error", "message": "slow disk"}))
            await ws.send("{not json")
            unmatched = {"type": "transmit_response", "id": "other", "attempt": 1, "status": 200}
            await ws.send(json.dumps(unmatched))
            await ws.send(TransmitResponse(t["id"], t["attempt"], 201, None).to_json())
            await ws.wait_closed()

        async def scenario() -> None:
            async with serve(chatty, "127.0.0.1", 0) as server:
                port = server.sockets[0].getsockname()[1]
                with capture_logs() as logs:
                    link = UpstreamLink(settings(port))
                    async with running(link):
                        session = await link.session()
                        response = await session.transmit(transmit())
                        assert response.status == 201
                        assert not session.closed
            messages = [e["message"] for e in events(logs, "upstream_error_message")]
            assert messages == ["warming up", "slow disk"]
            assert len(events(logs, "upstream_protocol_error")) == 1
            assert len(events(logs, "upstream_response_unmatched")) == 1

        run(scenario())


class TestConnectionLoss:
    def test_server_close_code_reaches_waiters(self) -> None:
        """A server close with 1009 fails the waiting transmit with SessionClosed(code=1009)."""

        async def never(t: Transmit) -> None:
            return None

        async def scenario() -> None:
            async with dev_server(decide=never) as server:
                link = UpstreamLink(settings(server.port))
                async with running(link):
                    session = await link.session()
                    waiting = asyncio.create_task(session.transmit(transmit()))
                    await server.wait_until(lambda: len(server.received) == 1)
                    await server.close_connections(1009, "too big")
                    with pytest.raises(SessionClosed) as excinfo:
                        await waiting
                    assert excinfo.value.code == 1009
                    assert excinfo.value.reason == "too big"
                    assert excinfo.value.by_server and excinfo.value.too_big
                    info = await session.wait_closed()
                    assert info.code == 1009 and session.closed
                    with pytest.raises(SessionClosed):
                        await session.transmit(transmit(2))

        run(scenario())

    def test_frame_over_server_limit_gets_1009(self) -> None:
        """A frame the server finds too big closes the session with 1009, reported to the sender."""

        async def scenario() -> None:
            async with dev_server(max_size=4096) as server:
                link = UpstreamLink(settings(server.port))
                async with running(link):
                    session = await link.session()
                    with pytest.raises(SessionClosed) as excinfo:
                        await session.transmit(transmit(body=BODY + "X" * 10_000))
                    assert excinfo.value.code == 1009 and excinfo.value.too_big
            assert server.received == []

        run(scenario())

    def test_oversized_server_frame_is_not_blamed_on_our_transmit(self) -> None:
        """A server frame over our limit closes with our 1009, which too_big does not count."""

        async def bloated(ws: ServerConnection) -> None:
            await ws.recv()  # hello
            await ws.send(json.dumps({"type": "welcome", "replay": True}))
            await ws.recv()  # transmit
            await ws.send(json.dumps({"type": "error", "message": "x" * 5000}))
            await ws.wait_closed()

        async def scenario() -> None:
            async with serve(bloated, "127.0.0.1", 0) as server:
                port = server.sockets[0].getsockname()[1]
                link = UpstreamLink(settings(port, max_frame_bytes=2048))
                async with running(link):
                    session = await link.session()
                    with pytest.raises(SessionClosed) as excinfo:
                        await session.transmit(transmit())
            assert excinfo.value.code == 1009
            assert not excinfo.value.by_server and not excinfo.value.too_big

        run(scenario())

    def test_dropped_tcp_connection_reports_1006(self) -> None:
        """A connection lost without a Close frame reports code 1006 (RFC 6455 7.1.5)."""

        async def dropper(ws: ServerConnection) -> None:
            await ws.recv()  # hello
            await ws.send(json.dumps({"type": "welcome", "replay": True}))
            await ws.recv()  # transmit
            ws.transport.abort()

        async def scenario() -> None:
            async with serve(dropper, "127.0.0.1", 0) as server:
                port = server.sockets[0].getsockname()[1]
                link = UpstreamLink(settings(port))
                async with running(link):
                    session = await link.session()
                    with pytest.raises(SessionClosed) as excinfo:
                        await session.transmit(transmit())
            assert excinfo.value.code == 1006 and not excinfo.value.too_big

        run(scenario())

    def test_reconnects_after_server_restart_on_same_port(self) -> None:
        """When the server goes away and comes back on its port, a new session is published."""

        async def scenario() -> None:
            first = DevServer(token=TOKEN)
            await first.start()
            port = first.port
            link = UpstreamLink(settings(port))
            async with running(link):
                s1 = await link.session()
                await first.stop()
                await s1.wait_closed()
                await until(lambda: not link.connected)
                async with _restart(port) as second:
                    s2 = await link.session()
                    assert s2 is not s1 and s2.generation == s1.generation + 1
                    response = await s2.transmit(transmit())
                    assert response.status == 200
                    assert len(second.received) == 1

        run(scenario())

    def test_close_stops_run_and_closes_the_session(self) -> None:
        """close() ends the connection (1001) and run() returns."""

        async def scenario() -> None:
            async with dev_server() as server:
                link = UpstreamLink(settings(server.port))
                task = asyncio.create_task(link.run())
                session = await link.session()
                await link.close()
                await task
                assert session.closed and not link.connected
                await until(lambda: server.active_sessions == 0)

        run(scenario())


@asynccontextmanager
async def _restart(port: int) -> AsyncIterator[DevServer]:
    server = DevServer(token=TOKEN)
    await server.start(port=port)
    try:
        yield server
    finally:
        await server.stop()


class TestProxy:
    def test_proxy_environment_is_ignored_when_proxy_is_none(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """HTTPS_PROXY/ALL_PROXY in the environment are not used with proxy = "none" (SPEC 5)."""
        for name in ("NO_PROXY", "no_proxy"):
            monkeypatch.delenv(name, raising=False)
        dead = "http://127.0.0.1:9"  # discard port: nothing listens there
        for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HTTP_PROXY"):
            monkeypatch.setenv(name, dead)

        async def scenario() -> None:
            async with dev_server() as server:
                url = f"ws://127.0.0.1:{server.port}/agent"
                # websockets itself would pick the dead proxy up from the environment:
                assert get_proxy(parse_uri(url)) is not None
                link = UpstreamLink(settings(server.port, proxy="none"))
                async with running(link):
                    response = await (await link.session()).transmit(transmit())
                assert response.status == 200

        run(scenario())

    def test_default_connect_would_have_used_the_proxy(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Control: without proxy=None websockets goes through the dead proxy and fails."""
        for name in ("NO_PROXY", "no_proxy"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")

        async def scenario() -> None:
            async with dev_server() as server:
                with pytest.raises(OSError):
                    await ws_connect(f"ws://127.0.0.1:{server.port}/", open_timeout=2)

        run(scenario())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available")
    return make_test_pki(tmp_path_factory.mktemp("pki"))


def server_tls(pki: Path, *, require_client_cert: bool = False) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki / "server.pem", pki / "server.key")
    if require_client_cert:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(pki / "ca.pem")
    return context


class TestTls:
    def test_wss_with_ca_file(self, pki: Path) -> None:
        """wss:// verifies the server against ca_file and then works like ws://."""

        async def scenario() -> None:
            async with dev_server(ssl_context=server_tls(pki)) as server:
                link = UpstreamLink(
                    settings(
                        server.port,
                        url=f"wss://127.0.0.1:{server.port}/agent",
                        ca_file=str(pki / "ca.pem"),
                    )
                )
                async with running(link):
                    response = await (await link.session()).transmit(transmit())
                assert response.status == 200

        run(scenario())

    def test_unknown_ca_is_refused_and_retried(self, pki: Path) -> None:
        """Without our CA the certificate fails verification; the link logs and retries."""

        async def scenario() -> None:
            async with dev_server(ssl_context=server_tls(pki)) as server:
                with capture_logs() as logs:
                    link = UpstreamLink(
                        settings(server.port, url=f"wss://127.0.0.1:{server.port}/agent")
                    )
                    async with running(link):
                        await until(lambda: len(events(logs, "upstream_connect_failed")) >= 2)
                        assert not link.connected
                assert "CERTIFICATE_VERIFY_FAILED" in (link.last_error or "")
                assert server.connections == 0

        run(scenario())

    def test_client_certificate_is_presented(self, pki: Path) -> None:
        """client_cert / client_key are presented to a server that requires them."""

        async def scenario() -> None:
            tls = server_tls(pki, require_client_cert=True)
            async with dev_server(ssl_context=tls) as server:
                link = UpstreamLink(
                    settings(
                        server.port,
                        url=f"wss://127.0.0.1:{server.port}/agent",
                        ca_file=str(pki / "ca.pem"),
                        client_cert=str(pki / "client.pem"),
                        client_key=str(pki / "client.key"),
                    )
                )
                async with running(link):
                    assert (await link.session()).replay is True

        run(scenario())

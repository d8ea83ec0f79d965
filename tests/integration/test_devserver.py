"""The reference server on its own: auth, protocol checks, default ACKs, store, CLI entry (SPEC 2, 5)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
from agenttest import log_events as events
from agenttest import run_async as run
from structlog.testing import capture_logs
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from agent.app.config import Settings
from agent.app.devserver import DevServer, default_answer, read_dev_token, run_dev_server
from agent.core.protocol import (
    ErrorMessage,
    Hello,
    Transmit,
    TransmitResponse,
    Welcome,
    parse_server_frame,
)
from agent.errors import ConfigError

T = TypeVar("T")
TOKEN = "dev-token"
BODY = "MSH|^~\\&|LAB|HOSP|EHR|HOSP|20240501123000||ORU^R01|CTRL42|T|2.5.1\rOBX|1|NM|x||7\r"


def transmit(attempt: int = 1, *, id: str = "id-1", body: str = BODY) -> Transmit:
    return Transmit(
        id=id,
        channel="lab",
        control_id="CTRL42",
        message_type="ORU^R01",
        seq=5,
        attempt=attempt,
        received_at="2024-05-01T12:30:00.000Z",
        remote="10.0.0.9:4000",
        body=body,
        encoding="utf-8",
    )


@asynccontextmanager
async def dev_server(**kwargs: Any) -> AsyncIterator[DevServer]:
    kwargs.setdefault("token", TOKEN)
    server = DevServer(**kwargs)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@asynccontextmanager
async def client(server: DevServer, token: str | None = TOKEN) -> AsyncIterator[ClientConnection]:
    headers = {"Authorization": f"Bearer {token}"} if token else None
    async with connect(
        f"ws://127.0.0.1:{server.port}/agent", additional_headers=headers, proxy=None
    ) as ws:
        yield ws


async def hello(ws: ClientConnection) -> Welcome:
    await ws.send(Hello("edge-01", "0.1.0").to_json())
    welcome = parse_server_frame(await ws.recv())
    assert isinstance(welcome, Welcome)
    return welcome


class TestAuth:
    def test_wrong_token_gets_401(self) -> None:
        """A wrong bearer token is refused in the HTTP upgrade with 401 and a challenge."""

        async def scenario() -> None:
            async with dev_server() as server:
                for token in ("nope", None):
                    with pytest.raises(InvalidStatus) as excinfo:
                        async with client(server, token):
                            pass
                    response = excinfo.value.response
                    assert response.status_code == 401
                    assert response.headers["WWW-Authenticate"].startswith("Bearer")
                assert server.connections == 0

        run(scenario())

    def test_no_token_accepts_everyone_with_a_warning(self) -> None:
        """Without a configured token every client is accepted and a warning says so."""

        async def scenario() -> None:
            with capture_logs() as logs:
                async with dev_server(token=None) as server, client(server, None) as ws:
                    assert (await hello(ws)).replay is True
            assert events(logs, "dev_server_no_token")

        run(scenario())


class TestProtocol:
    def test_welcome_carries_replay_flag(self) -> None:
        """welcome.replay mirrors the server's replay setting."""

        async def scenario() -> None:
            async with dev_server(replay=False) as server, client(server) as ws:
                assert (await hello(ws)).replay is False

        run(scenario())

    def test_transmit_before_hello_is_refused(self) -> None:
        """A first frame other than hello gets an error frame and a 1002 close."""

        async def scenario() -> None:
            async with dev_server() as server, client(server) as ws:
                await ws.send(transmit().to_json())
                assert isinstance(parse_server_frame(await ws.recv()), ErrorMessage)
                with pytest.raises(ConnectionClosed) as excinfo:
                    await ws.recv()
                assert excinfo.value.rcvd is not None and excinfo.value.rcvd.code == 1002
                assert server.received == []

        run(scenario())

    def test_unsupported_protocol_version_is_refused(self) -> None:
        """hello with protocol 2 is refused; this server speaks v1 only."""

        async def scenario() -> None:
            async with dev_server() as server, client(server) as ws:
                await ws.send(Hello("edge-01", "9.0", protocol=2).to_json())
                error = parse_server_frame(await ws.recv())
                assert isinstance(error, ErrorMessage) and "protocol 2" in error.message
                with pytest.raises(ConnectionClosed):
                    await ws.recv()

        run(scenario())

    def test_malformed_frame_gets_error_and_session_goes_on(self) -> None:
        """A malformed frame is answered with an error frame; later transmits still work."""

        async def scenario() -> None:
            async with dev_server() as server, client(server) as ws:
                await hello(ws)
                await ws.send('{"type": "transmit", "id": 5}')
                error = parse_server_frame(await ws.recv())
                assert isinstance(error, ErrorMessage) and "'id'" in error.message
                await ws.send(transmit().to_json())
                response = parse_server_frame(await ws.recv())
                assert isinstance(response, TransmitResponse) and response.status == 200

        run(scenario())

    def test_replay_off_does_not_reuse_answers(self) -> None:
        """Without replay, a resend is decided afresh (no remembered answer)."""
        seen: list[int] = []

        async def decide(t: Transmit) -> Any:
            seen.append(t.attempt)
            return default_answer(t)

        async def scenario() -> None:
            async with dev_server(replay=False, decide=decide) as server, client(server) as ws:
                await hello(ws)
                for attempt in (1, 2):
                    await ws.send(transmit(attempt).to_json())
                    response = parse_server_frame(await ws.recv())
                    assert isinstance(response, TransmitResponse)
                    assert response.attempt == attempt
            assert seen == [1, 2]

        run(scenario())

    def test_failing_decide_answers_500(self) -> None:
        """A decide script that raises is logged and answered 500 (transient), not swallowed."""

        async def broken(t: Transmit) -> Any:
            raise RuntimeError("script bug")

        async def scenario() -> None:
            with capture_logs() as logs:
                async with dev_server(decide=broken) as server, client(server) as ws:
                    await hello(ws)
                    await ws.send(transmit().to_json())
                    response = parse_server_frame(await ws.recv())
            assert isinstance(response, TransmitResponse) and response.status == 500
            assert events(logs, "dev_server_decide_failed")

        run(scenario())

    def test_counts_concurrent_sessions(self) -> None:
        """connections and max_concurrent_sessions_seen count overlapping agents."""

        async def scenario() -> None:
            async with dev_server() as server:
                async with client(server) as a, client(server) as b:
                    await hello(a)
                    await hello(b)
                    assert server.active_sessions == 2
                await server.wait_until(lambda: server.active_sessions == 0)
                assert server.connections == 2
                assert server.max_concurrent_sessions_seen == 2

        run(scenario())

    def test_logs_ids_never_bodies(self) -> None:
        """dev_server_received names id/channel/seq/control_id and never carries the body."""

        async def scenario() -> None:
            with capture_logs() as logs:
                async with dev_server() as server, client(server) as ws:
                    await hello(ws)
                    await ws.send(transmit().to_json())
                    await ws.recv()
            (line,) = events(logs, "dev_server_received")
            assert (line["id"], line["channel"], line["seq"], line["control_id"]) == (
                "id-1",
                "lab",
                5,
                "CTRL42",
            )
            assert all("OBX" not in repr(entry) for entry in logs)

        run(scenario())


class TestDefaultAnswer:
    def test_builds_aa_from_the_message(self) -> None:
        """The default answer is 200 with an AA ACK for the message's control id."""
        answer = default_answer(transmit())
        assert answer.status == 200 and answer.ack is not None
        segments = answer.ack.rstrip("\r").split("\r")
        assert segments[0].startswith("MSH|^~\\&|EHR|HOSP|LAB|HOSP|")
        assert "|ACK^R01^ACK|" in segments[0]
        assert segments[1].startswith("MSA|AA|CTRL42")

    def test_unreadable_msh_is_rejected_with_ae(self) -> None:
        """A body without a readable MSH is answered 400 with an AE."""
        answer = default_answer(transmit(body="PID|1||123\r"))
        assert answer.status == 400
        assert answer.ack is not None and "MSA|AE|CTRL42" in answer.ack


class TestStore:
    def test_appends_each_transmit_as_a_json_line(self, tmp_path: Path) -> None:
        """With store_path every received transmit, resends included, is one JSON line."""
        store = tmp_path / "received.jsonl"

        async def scenario() -> None:
            async with dev_server(store_path=str(store)) as server, client(server) as ws:
                await hello(ws)
                for attempt in (1, 2):
                    await ws.send(transmit(attempt).to_json())
                    await ws.recv()

        run(scenario())
        lines = [json.loads(line) for line in store.read_text(encoding="utf-8").splitlines()]
        assert [(d["id"], d["attempt"]) for d in lines] == [("id-1", 1), ("id-1", 2)]
        assert lines[0]["body"] == BODY


class TestToken:
    def test_token_file_wins(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """--token-file contents (stripped) are used even when the env var is set."""
        monkeypatch.setenv("HL7_AGENT_DEV_TOKEN", "from-env")
        path = tmp_path / "token"
        path.write_text("from-file\n", encoding="utf-8")
        assert read_dev_token(str(path)) == "from-file"

    def test_token_file_is_read_as_the_agent_reads_it(self, tmp_path: Path) -> None:
        """Only the trailing line break goes, as with server.token_file: one file serves both ends."""
        path = tmp_path / "token"
        path.write_text("  s3cr3t  \r\n", encoding="utf-8")
        settings = Settings(server={"token_file": path})
        assert read_dev_token(str(path)) == settings.server.token_value() == "  s3cr3t  "

    def test_env_fallback_and_none(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Without a file the env var is used; without either there is no token."""
        monkeypatch.setenv("HL7_AGENT_DEV_TOKEN", "from-env")
        assert read_dev_token(None) == "from-env"
        monkeypatch.delenv("HL7_AGENT_DEV_TOKEN")
        assert read_dev_token(None) is None

    def test_unreadable_or_empty_file_is_a_config_error(self, tmp_path: Path) -> None:
        """A missing or empty token file is a configuration error, not an open server."""
        with pytest.raises(ConfigError, match="cannot read"):
            read_dev_token(str(tmp_path / "missing"))
        empty = tmp_path / "empty"
        empty.write_text("  \n", encoding="utf-8")
        with pytest.raises(ConfigError, match="empty"):
            read_dev_token(str(empty))


class TestRunDevServer:
    def test_serves_until_sigterm(self, tmp_path: Path) -> None:
        """run_dev_server serves until SIGTERM, then exits 0."""
        code = (
            "import sys; from agent.app.devserver import run_dev_server; "
            "sys.exit(run_dev_server('127.0.0.1', 0, 'tok', True, None))"
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
            env={**os.environ, "NO_COLOR": "1"},
        )
        try:
            assert proc.stdout is not None
            port = None
            deadline = time.monotonic() + 10
            while port is None and time.monotonic() < deadline:
                line = proc.stdout.readline()
                match = re.search(r"dev_server_listening.*port=(?:\x1b\[[0-9;]*m)*(\d+)", line)
                if match:
                    port = int(match.group(1))
            assert port is not None, "dev server did not report its port"

            async def talk() -> None:
                headers = {"Authorization": "Bearer tok"}
                url = f"ws://127.0.0.1:{port}/"
                async with connect(url, additional_headers=headers, proxy=None) as ws:
                    await ws.send(Hello("edge-01", "0.1.0").to_json())
                    assert isinstance(parse_server_frame(await ws.recv()), Welcome)

            run(talk())
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()

    def test_bind_failure_returns_1(self) -> None:
        """An address already in use makes run_dev_server return 1 instead of raising."""
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = busy.getsockname()[1]
            assert run_dev_server("127.0.0.1", port, None, True, None) == 1

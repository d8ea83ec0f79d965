"""Outbound channels end to end: the agent dials a sender that is the MLLP server (real TCP, TLS, SQLite, DevServer).

``PushingSender`` is the other side as such systems behave: an MLLP server
that, on each connection the agent makes, pushes its messages one at a time
and waits for each ACK; what it pushed without getting an ACK it pushes
again on the next connection. The scripts drop connections the hard way
(RST) to make the agent reconnect.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agenttest import ack_code, hl7_message, make_test_pki, msa2, until
from agenttest import run_async as run

from agent.app.config import Settings
from agent.core import mllp
from agent.runtime.statusview import collect_view_data
from tests.agenttest import free_port
from tests.integration.test_dispatch import agent_running, dev_server, first_attempts, rows, url

Script = Callable[["PushingSender", asyncio.StreamReader, asyncio.StreamWriter, int], Any]


class PushingSender:
    """An MLLP server that pushes messages to whoever connects, one at a time, each awaiting its ACK."""

    def __init__(self, script: Script, *, ssl_ctx: ssl.SSLContext | None = None) -> None:
        self.script = script
        self.ssl_ctx = ssl_ctx
        self.connections = 0
        self.acks: list[bytes] = []
        self.peer_certs: list[Any] = []
        self.server: asyncio.Server | None = None
        self.done = asyncio.Event()

    async def start(self, port: int = 0) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", port, ssl=self.ssl_ctx)
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        ssl_object = writer.get_extra_info("ssl_object")
        if ssl_object is not None:
            self.peer_certs.append(ssl_object.getpeercert())
        try:
            await self.script(self, reader, writer, self.connections)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def push(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, message: bytes) -> bytes:
        writer.write(mllp.encode_frame(message))
        await writer.drain()
        ack = await read_frame(reader)
        self.acks.append(ack)
        return ack


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    decoder = mllp.MllpDecoder(1 << 20)
    async with asyncio.timeout(10):
        while True:
            data = await reader.read(65536)
            if not data:
                raise ConnectionError("closed")
            frames = [e.payload for e in decoder.feed(data) if isinstance(e, mllp.Frame)]
            if frames:
                return frames[0]


def outbound_settings(tmp_path: Path, server_url: str | None, port: int, **channel: Any) -> Settings:
    return Settings(
        agent={"id": "outbound-test", "data_dir": tmp_path / "data", "shutdown_budget": 5},
        admin={"listen": ""},
        server={"url": server_url, "token": "test-token", "response_timeout": 5, "connect_timeout": 2},
        queue={"synchronous": "normal", "min_free_disk_bytes": 0},
        dispatch={"lease_ttl": 10, "lease_heartbeat": 3, "lease_acquire_interval": 0.2,
                  "retry_initial": 0.1, "retry_cap": 0.5},
        channels=[{"name": "adt", "connect": f"127.0.0.1:{port}", "reconnect_initial": 0.05,
                   "reconnect_cap": 0.5, **channel}],
    )


def control_ids(agent: Any) -> list[str]:
    return [str(r[0]) for r in rows(agent, "SELECT control_id FROM messages WHERE state <> 'nacked' ORDER BY seq")]


def cid(n: int) -> str:
    return f"OUT{n:03d}"


class TestOutboundChannel:
    def test_twenty_drop_reconnect_twenty_more_delivered_once_in_order(self, tmp_path: Path) -> None:
        """40 messages over two connections, the first dropped with one ACK unread: 40 rows, 40 transmits, in order."""

        async def script(sender: PushingSender, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         n: int) -> None:
            if n == 1:
                for i in range(1, 20):
                    ack = await sender.push(reader, writer, hl7_message(cid(i), pid=str(i)))
                    assert (ack_code(ack), msa2(ack)) == ("AA", cid(i))
                # The 20th goes out, then the connection is reset before its ACK is read.
                writer.write(mllp.encode_frame(hl7_message(cid(20), pid="20")))
                await writer.drain()
                await asyncio.sleep(0)  # let the bytes leave before the reset
                writer.transport.abort()
                return
            # The sender never saw the 20th's ACK: it pushes it again, then 20 more.
            for i in range(20, 41):
                ack = await sender.push(reader, writer, hl7_message(cid(i), pid=str(i)))
                assert (ack_code(ack), msa2(ack)) == ("AA", cid(i))
            sender.done.set()
            await reader.read()  # keep the connection until the agent closes it

        async def scenario() -> None:
            sender = PushingSender(script)
            port = await sender.start()
            try:
                async with dev_server() as server, agent_running(
                        outbound_settings(tmp_path, url(server), port)) as agent:
                    async with asyncio.timeout(30):
                        await sender.done.wait()
                    assert sender.connections == 2
                    assert control_ids(agent) == [cid(i) for i in range(1, 41)], "each once, in arrival order"
                    await until(lambda: len(first_attempts(server, "adt")) == 40, timeout=30, what="40 transmits")
                    assert [t.control_id for t in first_attempts(server, "adt")] == [cid(i) for i in range(1, 41)]
                    await until(lambda: rows(agent, "SELECT count(*) FROM messages WHERE state = 'processed'")[0][0]
                                == 40, timeout=30, what="all processed")
                    assert len([t for t in server.received]) == 40, "no second delivery"
                    (outbound,) = agent.outbound
                    status = outbound.status()
                    assert (status["state"], status["connects"]) == ("connected", 2)
                    metrics = agent.metrics.exposition_for(None)[0].decode()
                    assert 'hl7_agent_outbound_connected{channel="adt"} 1.0' in metrics
                    assert 'hl7_agent_outbound_connect_attempts_total{channel="adt",result="connected"} 2.0' in metrics
                    view = await asyncio.to_thread(collect_view_data, agent._view())
                    (channel,) = view["assessment"]["channels"]
                    assert channel["outbound"]["state"] == "connected"
                    assert channel["detail"][0].startswith(f"connected to the sender at 127.0.0.1:{port}")
            finally:
                await sender.stop()

        run(scenario(), timeout=90)

    def test_sender_not_up_yet_reconnecting_then_connected(self, tmp_path: Path) -> None:
        """Nobody listens yet: reconnecting with the error on the page and in metrics; the sender comes up: connected."""
        port = free_port()

        async def script(sender: PushingSender, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         n: int) -> None:
            await sender.push(reader, writer, hl7_message("LATE-1"))
            sender.done.set()
            await reader.read()

        async def scenario() -> None:
            async with agent_running(outbound_settings(tmp_path, None, port)) as agent:
                (outbound,) = agent.outbound
                await until(lambda: outbound.failures >= 3, what="a few failed dials")
                status = outbound.status()
                assert status["state"] == "reconnecting" and status["last_error"] == "connection refused"
                view = await asyncio.to_thread(collect_view_data, agent._view())
                assert view["assessment"]["level"] == "warn"
                assert f"reconnecting to the sender at 127.0.0.1:{port}" in view["assessment"]["summary"]
                assert "connection refused" in view["assessment"]["summary"]
                metrics = agent.metrics.exposition_for(None)[0].decode()
                assert 'hl7_agent_outbound_connected{channel="adt"} 0.0' in metrics
                # queue stats, from another process, reads what the daemon recorded in the database.
                await until(lambda: rows(agent, "SELECT value FROM meta WHERE key = 'outbound:adt'"), what="recorded")
                config = tmp_path / "agent.toml"
                config.write_text(f'[agent]\nid = "outbound-test"\ndata_dir = "{tmp_path / "data"}"\n'
                                  f'[admin]\nlisten = ""\n[[channels]]\nname = "adt"\nconnect = "127.0.0.1:{port}"\n',
                                  encoding="utf-8")
                for flag in ("--json", ""):
                    proc = await asyncio.create_subprocess_exec(
                        sys.executable, "-m", "agent", "queue", "stats", *([flag] if flag else []), "--config",
                        str(config), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
                    async with asyncio.timeout(30):
                        out, err = await proc.communicate()
                    assert proc.returncode == 0, err
                    if flag:
                        recorded = json.loads(out)["channels"]["adt"]["outbound"]
                        assert (recorded["state"], recorded["last_error"]) == ("reconnecting", "connection refused")
                        assert recorded["connect"] == f"127.0.0.1:{port}"
                    else:
                        assert f"outbound  adt  reconnecting to 127.0.0.1:{port} since" in out.decode()
                        assert "last error: connection refused" in out.decode()
                sender = PushingSender(script)
                await sender.start(port)
                try:
                    async with asyncio.timeout(20):
                        await sender.done.wait()
                    assert ack_code(sender.acks[0]) == "AA" and control_ids(agent) == ["LATE-1"]
                    assert outbound.status()["state"] == "connected" and outbound.failures == 0
                finally:
                    await sender.stop()

        run(scenario())

    def test_enhanced_mode_and_dedupe_apply_to_what_arrives(self, tmp_path: Path) -> None:
        async def script(sender: PushingSender, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         n: int) -> None:
            await sender.push(reader, writer, hl7_message("ENH-1", msh15="AL", msh16="NE"))
            await sender.push(reader, writer, hl7_message("ENH-1", msh15="AL", msh16="NE"))  # a resend
            sender.done.set()
            await reader.read()

        async def scenario() -> None:
            sender = PushingSender(script)
            port = await sender.start()
            try:
                async with agent_running(outbound_settings(tmp_path, None, port)) as agent:
                    async with asyncio.timeout(20):
                        await sender.done.wait()
                    assert [ack_code(a) for a in sender.acks] == ["CA", "CA"]
                    assert sender.acks[0] == sender.acks[1], "the resend gets the original ACK, byte for byte"
                    assert control_ids(agent) == ["ENH-1"]
            finally:
                await sender.stop()

        run(scenario())


    def test_a_sender_that_closes_at_once_is_redialled_with_growing_delays(self, tmp_path: Path) -> None:
        """Connected, then closed at once (the sender serves another client): the backoff does not start over."""

        async def script(sender: PushingSender, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         n: int) -> None:
            writer.transport.abort()

        async def scenario() -> None:
            sender = PushingSender(script)
            port = await sender.start()
            try:
                async with agent_running(outbound_settings(tmp_path, None, port)) as agent:
                    (outbound,) = agent.outbound
                    await until(lambda: outbound.connects >= 5, what="five short connections")
                    # reconnect_initial 0.05 s doubling: the wait before the 5th dial was 0.4 s less
                    # at most 20 % jitter (and every later one more); a reset would make it 0.05 s.
                    assert outbound.last_delay >= 0.3
            finally:
                await sender.stop()

        run(scenario())


class TestOutboundTls:
    def test_tls_with_a_client_certificate(self, tmp_path: Path) -> None:
        pki = make_test_pki(tmp_path)
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_ctx.load_cert_chain(pki / "server.pem", pki / "server.key")
        server_ctx.load_verify_locations(cafile=pki / "ca.pem")
        server_ctx.verify_mode = ssl.CERT_REQUIRED

        async def script(sender: PushingSender, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         n: int) -> None:
            for i in range(3):
                await sender.push(reader, writer, hl7_message(f"TLS-{i}"))
            sender.done.set()
            await reader.read()

        async def scenario() -> None:
            sender = PushingSender(script, ssl_ctx=server_ctx)
            port = await sender.start()
            try:
                settings = outbound_settings(tmp_path, None, port, tls_server_ca=pki / "ca.pem",
                                             tls_cert=pki / "client.pem", tls_key=pki / "client.key")
                async with agent_running(settings) as agent:
                    async with asyncio.timeout(20):
                        await sender.done.wait()
                    assert [ack_code(a) for a in sender.acks] == ["AA", "AA", "AA"]
                    assert control_ids(agent) == ["TLS-0", "TLS-1", "TLS-2"]
                    subject = dict(x[0] for x in sender.peer_certs[0]["subject"])
                    assert subject["commonName"] == "client", "the agent presented its client certificate"
                    assert agent.outbound[0].status()["tls"] is True
            finally:
                await sender.stop()

        run(scenario())

    def test_a_server_certificate_from_another_ca_is_refused(self, tmp_path: Path) -> None:
        (tmp_path / "real").mkdir()
        (tmp_path / "other").mkdir()
        pki = make_test_pki(tmp_path / "real")
        other = make_test_pki(tmp_path / "other")
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_ctx.load_cert_chain(other / "server.pem", other / "server.key")

        async def script(*_: Any) -> None:
            raise AssertionError("no message may be exchanged with an unverified server")

        async def scenario() -> None:
            sender = PushingSender(script, ssl_ctx=server_ctx)
            port = await sender.start()
            try:
                async with agent_running(outbound_settings(tmp_path, None, port,
                                                           tls_server_ca=pki / "ca.pem")) as agent:
                    (outbound,) = agent.outbound
                    await until(lambda: outbound.failures >= 2, what="refused handshakes")
                    assert str(outbound.status()["last_error"]).startswith("TLS: certificate verify failed")
                    assert control_ids(agent) == []
            finally:
                await sender.stop()

        run(scenario())

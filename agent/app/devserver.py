"""``hl7-agent dev-server``: a small reference server speaking protocol v1 (docs/protocol.md).

For trying the agent and for tests, not for production; it shares no code
with the agent's dispatch path beyond the frame definitions in
``agent.core.protocol``, so it checks the agent against the contract rather than
against itself.

Behaviour: bearer-token check in the HTTP upgrade (401 otherwise), hello ->
welcome, and for each transmit either the remembered 2xx answer (when
``replay``; re-stamped with the current attempt), the answer a ``decide``
callback scripts (status, ack, delay, a close instead of the answer, or
``None`` = never answer), or by default 200 with an AA built from the
message's own MSH.

Lease epochs (``track_epochs``, on by default): the highest epoch seen is
kept per (agent_id, queue_id), in memory. A hello below it is refused (an
``error`` frame, then close code 4001); a hello at or above it closes, with
4001, every other session of the same agent_id and queue_id, and every
session of that agent_id that sent no epoch (an older agent version, which
cannot be fenced otherwise). From the moment a session is superseded its
frames are dropped unrecorded, even those already on the wire: the close
handshake takes a round trip a frozen agent may never make. A hello without
``epoch`` is accepted and not tracked, so the previous agent version keeps
working against this server during an upgrade overlap.

One module of about 500 lines on purpose: it is the reference implementation
a server team reads from top to bottom (docs/protocol.md#reference-implementation),
and its parts (authentication, the epoch rules, the answers) only make sense
together.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import signal
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, replace
from http import HTTPStatus
from pathlib import Path
from typing import Literal

import structlog
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from agent.core.acks import AckCode, build_ack
from agent.core.addresses import format_peer
from agent.core.envelope import read_msh
from agent.core.protocol import (
    EPOCH_REFUSED,
    PROTOCOL_VERSION,
    ErrorMessage,
    Hello,
    Transmit,
    TransmitResponse,
    Welcome,
    parse_client_frame,
)
from agent.errors import ConfigError, HL7Error, ProtocolError

log = structlog.get_logger(__name__)

#: Accept frames up to 64 MiB: comfortably above 6 x any sane max_message_bytes.
DEFAULT_MAX_SIZE = 64 * 1024 * 1024
TOKEN_ENV = "HL7_AGENT_DEV_TOKEN"  # noqa: S105 - the name of a variable, not a secret


@dataclass(frozen=True, slots=True)
class Answer:
    """What the server says to one transmit: a status, an optional ACK, after ``delay`` seconds.

    ``close``: instead of writing the answer, close the session (1011) — the
    answer lost on the way. A 2xx is remembered first (processed, then the
    connection broke), so a replaying server answers the resend from memory.
    """

    status: int
    ack: str | None = None
    delay: float = 0
    close: bool = False


Decide = Callable[[Transmit], Awaitable[Answer | None]]


@dataclass(frozen=True, slots=True)
class Arrival:
    """One frame as the server took it, in arrival order: what tests check fencing against.

    ``kind``: ``hello`` (welcomed), ``refused_hello`` (epoch below the
    highest: 4001), ``transmit`` (recorded and answered), ``stale_frame``
    (from a superseded session: dropped, never recorded or answered).
    """

    kind: Literal["hello", "refused_hello", "transmit", "stale_frame"]
    session: int
    agent_id: str
    epoch: int | None
    transmit: Transmit | None = None


@dataclass(slots=True)
class _Peer:
    """One session past hello, as far as epoch fencing is concerned."""

    session: int
    agent_id: str
    queue_id: str | None
    epoch: int | None
    superseded: bool = False


def default_answer(t: Transmit) -> Answer:
    """200 with an AA built from the transmit's MSH; 400 with an AE when its MSH is unreadable."""
    body = t.body.encode("utf-8")
    try:
        inbound = read_msh(body)
    except HL7Error as exc:
        ack = build_ack(
            None,
            AckCode.AE,
            text="unreadable MSH",
            error_code=exc.error_code,
            codec="utf-8",
            inbound_control_id=t.control_id,
        )
        return Answer(400, ack.decode("utf-8"))
    return Answer(200, build_ack(inbound, AckCode.AA, codec="utf-8").decode("utf-8"))


class DevServer:
    """The reference upstream server; tests read ``received`` / ``answered`` / ``sent``."""

    def __init__(
        self,
        *,
        token: str | None,
        replay: bool = True,
        store_path: str | None = None,
        decide: Decide | None = None,
        max_size: int = DEFAULT_MAX_SIZE,
        hello_timeout: float = 10.0,
        ssl_context: ssl.SSLContext | None = None,
        track_epochs: bool = True,
    ) -> None:
        self.token = token
        self.replay = replay
        self.store_path = Path(store_path) if store_path else None
        self.decide = decide
        self.max_size = max_size
        self.hello_timeout = hello_timeout
        self.ssl_context = ssl_context  # wss:// for TLS tests; the CLI serves plain ws://
        self.track_epochs = track_epochs
        self.received: list[Transmit] = []  # every transmit, arrival order, resends too
        self.timeline: list[Arrival] = []  # hellos and transmits, kept or dropped, in arrival order
        self.highest_epochs: dict[tuple[str, str | None], int] = {}  # per (agent_id, queue_id)
        self.answered: dict[str, TransmitResponse] = {}  # 2xx answers by id (replay)
        self.sent: list[TransmitResponse] = []  # every transmit_response written, in order
        self.connections = 0  # WebSocket connections accepted (past the token check)
        self.max_concurrent_sessions_seen = 0
        self._active: set[ServerConnection] = set()
        self._peers: dict[ServerConnection, _Peer] = {}
        self._server: Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._changed = asyncio.Event()

    # -- lifecycle -------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        if self.token is None:
            log.warning("dev_server_no_token", hint="accepting every client without a token")
        self._server = await serve(
            self._handle,
            host,
            port,
            process_request=self._authorize,
            max_size=self.max_size,
            compression=None,
            ssl=self.ssl_context,
        )
        log.info("dev_server_listening", host=host, port=self.port, replay=self.replay)

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("DevServer is not started")
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    @property
    def active_sessions(self) -> int:
        return len(self._active)

    async def stop(self) -> None:
        """Stop listening, close every connection (1001) and cancel pending answers."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)

    async def close_connections(self, code: int = 1000, reason: str = "") -> None:
        """Close every open session with ``code`` (tests use 1009, "message too big")."""
        await asyncio.gather(*(ws.close(code, reason) for ws in list(self._active)))

    async def wait_until(self, predicate: Callable[[], bool], timeout: float = 5.0) -> None:
        """Wait until ``predicate()`` holds, re-checked on every received/sent frame."""
        async with asyncio.timeout(timeout):
            while not predicate():
                await self._changed.wait()

    def _pulse(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # -- HTTP upgrade ------------------------------------------------------------

    def _authorize(self, connection: ServerConnection, request: Request) -> Response | None:
        """``Authorization: Bearer <token>``, else HTTP 401 (docs/protocol.md#transport-and-authentication)."""
        if self.token is None:
            return None
        given = request.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            return None
        log.warning("dev_server_auth_failed", peer=format_peer(connection.remote_address))
        response = connection.respond(HTTPStatus.UNAUTHORIZED, "missing or invalid bearer token\n")
        response.headers["WWW-Authenticate"] = 'Bearer realm="hl7-agent"'
        return response

    # -- protocol ------------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        self.connections += 1
        number = self.connections
        self._active.add(ws)
        self.max_concurrent_sessions_seen = max(
            self.max_concurrent_sessions_seen, len(self._active)
        )
        peer = format_peer(ws.remote_address)
        mine: set[asyncio.Task[None]] = set()
        try:
            hello = await self._expect_hello(ws, peer)
            if hello is None:
                return
            me = _Peer(number, hello.agent_id, hello.queue_id, hello.epoch)
            refusal = self._admit(ws, me)
            if refusal is not None:
                await ws.send(ErrorMessage(refusal).to_json())
                await ws.close(EPOCH_REFUSED, "stale lease epoch")
                return
            await ws.send(Welcome(self.replay).to_json())
            log.info(
                "dev_server_session",
                peer=peer,
                agent_id=hello.agent_id,
                version=hello.version,
                epoch=hello.epoch,
                queue_id=hello.queue_id,
                session=number,
            )
            self._pulse()
            async for frame in ws:
                if me.superseded:
                    self._drop_stale(me, frame)
                    continue
                try:
                    message = parse_client_frame(frame)
                except ProtocolError as exc:
                    log.warning("dev_server_protocol_error", peer=peer, error=str(exc))
                    await ws.send(ErrorMessage(str(exc)).to_json())
                    continue
                if isinstance(message, Transmit):
                    # Recorded here, in arrival order, before any other frame is read.
                    self._record(me, message)
                    task = asyncio.create_task(self._on_transmit(ws, message))
                    mine.add(task)
                    self._tasks.add(task)
                    task.add_done_callback(mine.discard)
                    task.add_done_callback(self._tasks.discard)
                elif isinstance(message, ErrorMessage):
                    log.warning("dev_server_agent_error", peer=peer, message=message.message[:500])
                else:
                    await ws.send(ErrorMessage("hello already received").to_json())
        except ConnectionClosed:
            pass
        finally:
            self._active.discard(ws)
            self._peers.pop(ws, None)
            for task in mine:
                task.cancel()
            self._pulse()

    # -- lease epochs ----------------------------------------------------------------

    def _admit(self, ws: ServerConnection, me: _Peer) -> str | None:
        """Apply the epoch rules to a hello; the refusal text, or None when welcomed.

        Synchronous on purpose: no other frame is handled between comparing the
        epoch and superseding the older sessions.
        """
        if self.track_epochs and me.epoch is not None:
            key = (me.agent_id, me.queue_id)
            highest = self.highest_epochs.get(key)
            if highest is not None and me.epoch < highest:
                log.warning(
                    "dev_server_epoch_refused",
                    agent_id=me.agent_id,
                    queue_id=me.queue_id,
                    epoch=me.epoch,
                    highest=highest,
                    session=me.session,
                )
                self.timeline.append(Arrival("refused_hello", me.session, me.agent_id, me.epoch))
                self._pulse()
                return (
                    f"lease epoch {me.epoch} is below the highest seen ({highest}) for agent "
                    f"{me.agent_id} and queue {me.queue_id}: another process holds the lease"
                )
            self.highest_epochs[key] = me.epoch
            for other_ws, other in self._peers.items():
                if other.superseded or other.agent_id != me.agent_id:
                    continue
                if other.epoch is None or (other.queue_id == me.queue_id and other.epoch <= me.epoch):
                    self._supersede(other_ws, other, me)
        self._peers[ws] = me
        self.timeline.append(Arrival("hello", me.session, me.agent_id, me.epoch))
        return None

    def _supersede(self, ws: ServerConnection, old: _Peer, new: _Peer) -> None:
        """From now on ``old``'s frames are dropped; tell it why and close it with 4001."""
        old.superseded = True
        log.warning(
            "dev_server_session_superseded",
            agent_id=old.agent_id,
            session=old.session,
            epoch=old.epoch,
            by_session=new.session,
            by_epoch=new.epoch,
        )

        async def close() -> None:
            with contextlib.suppress(ConnectionClosed):
                await ws.send(
                    ErrorMessage(f"superseded by a session with lease epoch {new.epoch}").to_json()
                )
                await ws.close(EPOCH_REFUSED, f"superseded by lease epoch {new.epoch}")

        task = asyncio.create_task(close())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _drop_stale(self, me: _Peer, frame: str | bytes) -> None:
        try:
            message = parse_client_frame(frame)
        except ProtocolError:
            message = None
        t = message if isinstance(message, Transmit) else None
        self.timeline.append(Arrival("stale_frame", me.session, me.agent_id, me.epoch, t))
        log.warning(
            "dev_server_stale_frame_dropped",
            agent_id=me.agent_id,
            session=me.session,
            epoch=me.epoch,
            id=t.id if t else None,
            seq=t.seq if t else None,
            attempt=t.attempt if t else None,
        )
        self._pulse()

    # -- transmits -------------------------------------------------------------------

    async def _expect_hello(self, ws: ServerConnection, peer: str) -> Hello | None:
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can lose a
            # cancellation (see agent.runtime.aio), and stop() cancels this handler.
            async with asyncio.timeout(self.hello_timeout):
                frame = await ws.recv()
            message = parse_client_frame(frame)
        except TimeoutError:
            await ws.close(1002, "no hello")
            return None
        except ProtocolError as exc:
            await ws.send(ErrorMessage(str(exc)).to_json())
            await ws.close(1002, "expected hello")
            return None
        if not isinstance(message, Hello):
            await ws.send(ErrorMessage("expected hello first").to_json())
            await ws.close(1002, "expected hello")
            return None
        if message.protocol != PROTOCOL_VERSION:
            log.warning("dev_server_protocol_unsupported", peer=peer, protocol=message.protocol)
            await ws.send(ErrorMessage(f"unsupported protocol {message.protocol}").to_json())
            await ws.close(1002, "unsupported protocol")
            return None
        return message

    def _record(self, me: _Peer, t: Transmit) -> None:
        self.received.append(t)
        self.timeline.append(Arrival("transmit", me.session, me.agent_id, me.epoch, t))
        log.info(
            "dev_server_received",
            id=t.id,
            channel=t.channel,
            seq=t.seq,
            attempt=t.attempt,
            control_id=t.control_id,
            message_type=t.message_type,
            session=me.session,
        )
        self._store(t)
        self._pulse()

    async def _on_transmit(self, ws: ServerConnection, t: Transmit) -> None:
        remembered = self.answered.get(t.id) if self.replay else None
        if remembered is not None:
            # A replayed answer carries the current attempt (docs/protocol.md#the-replay-rule).
            response = replace(remembered, attempt=t.attempt)
        else:
            try:
                answer = await self.decide(t) if self.decide is not None else default_answer(t)
            except Exception:  # a broken script answers 500, visibly
                log.exception("dev_server_decide_failed", id=t.id, attempt=t.attempt)
                answer = Answer(500)
            if answer is None:
                return  # scripted silence: the agent's response timeout must cope
            if answer.delay > 0:
                await asyncio.sleep(answer.delay)  # scripted server latency
            response = TransmitResponse(t.id, t.attempt, answer.status, answer.ack)
            if 200 <= answer.status <= 299:
                # Remembered once processed, even if the answer is then lost:
                # that is what makes a resend after a broken connection safe.
                self.answered[t.id] = response
            if answer.close:
                # RFC 6455 section 7.4.1: 1011, the server hit a condition it cannot handle.
                await ws.close(1011, "scripted close")
                return
        try:
            await ws.send(response.to_json())
        except ConnectionClosed:
            return
        self.sent.append(response)
        self._pulse()

    def _store(self, t: Transmit) -> None:
        if self.store_path is None:
            return
        line = json.dumps(asdict(t), ensure_ascii=False, separators=(",", ":"))
        with self.store_path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")


def read_dev_token(token_file: str | None) -> str | None:
    """The dev server's token: ``--token-file`` contents, else env HL7_AGENT_DEV_TOKEN, else None.

    The file is read as the agent reads ``server.token_file``: only its
    trailing line break goes, so one file serves both ends.
    """
    if token_file:
        try:
            token = Path(token_file).read_text(encoding="utf-8").rstrip("\r\n")
        except OSError as exc:
            raise ConfigError(f"cannot read --token-file {token_file}: {exc.strerror}") from None
        if not token.strip():
            raise ConfigError(f"--token-file {token_file} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def run_dev_server(
    host: str, port: int, token: str | None, replay: bool, store_path: str | None
) -> int:
    """Serve until SIGINT/SIGTERM; 0 on a clean stop, 1 if the address cannot be bound."""

    async def main() -> int:
        server = DevServer(token=token, replay=replay, store_path=store_path)
        try:
            await server.start(host, port)
        except OSError as exc:
            log.error("dev_server_bind_failed", host=host, port=port, error=str(exc))
            return 1
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            await server.stop()
            log.info("dev_server_stopped", received=len(server.received))
        return 0

    return asyncio.run(main())

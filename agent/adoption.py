"""Live sender connections handed to the successor during an upgrade (SPEC 7).

Closing a connection "after its current message" has a race no server can
win alone: a sender that streams sends its next frame right after reading an
ACK, and that frame crosses our close — the sender sees EOF instead of an
ACK. So the old process does not close: at a frame boundary it pauses
reading and passes the connected socket itself (SCM_RIGHTS), together with
any bytes it had read but not handled, to the successor, which serves it as
if it had accepted it. The sender notices nothing.

The successor publishes ``adopt.sock`` in the data directory when it starts
(atomically, over its predecessor's). A process whose path is still its own
has no successor and falls back to closing (a plain stop).

Exchange, one Unix connection per adopted socket: the giver sends one JSON
line ``{"v":1,"channel":…,"remote":…,"buffered":<base64>}`` with the fd
attached; the taker answers ``{"ok":true}`` once it serves the connection.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog

from agent.aio import cancel_and_wait
from agent.errors import HandoverError
from agent.sockets import (
    accept_forever,
    bind_unix_atomically,
    path_identity,
    peer_credentials,
    read_line,
    send_all,
)

log = structlog.get_logger(__name__)

ADOPT_SOCKET = "adopt.sock"
_VERSION = 1
#: Read-but-unhandled bytes that travel with a connection (pipelined frames).
#: Beyond this the giver closes the usual way instead; base64 makes the line ~4/3 of it.
MAX_BUFFERED = 8 * 1024 * 1024
_MAX_LINE = MAX_BUFFERED * 4 // 3 + 4096

#: (channel, connected socket, remote, bytes read but not handled) -> served?
Adopter = Callable[[str, socket.socket, str, bytes], Awaitable[bool]]


class AdoptionServer:
    """Accepts connections handed over by a predecessor that is shutting down."""

    def __init__(self, path: Path, adopt: Adopter) -> None:
        self.path = Path(path)
        self._adopt = adopt
        self._sock: socket.socket | None = None
        self.identity: tuple[int, int] | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.adopted = 0

    async def start(self) -> None:
        self._sock, self.identity = bind_unix_atomically(self.path)
        self._accept_task = asyncio.create_task(self._accept_loop(self._sock), name="adoption-accept")

    async def close(self) -> None:
        """Stop taking connections; remove the path only while it is still ours."""
        task, self._accept_task = self._accept_task, None
        await cancel_and_wait(task, *self._tasks)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.identity is not None and path_identity(self.path) == self.identity:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    async def _accept_loop(self, server: socket.socket) -> None:
        await accept_forever(server, self._serve, self._tasks, name="adoption")

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        fds: list[int] = []
        with conn:
            conn.setblocking(False)
            try:
                _pid, uid, _gid = peer_credentials(conn)
            except OSError:
                uid = -1
            if uid not in (os.geteuid(), 0):
                log.warning("adoption_refused", peer_uid=uid)
                return
            ok = False
            try:
                async with asyncio.timeout(5.0):
                    line, fds = await read_line(loop, conn, with_fds=True, max_bytes=_MAX_LINE)
                    header = json.loads(line)
                    if len(fds) != 1 or not isinstance(header, dict) or header.get("v") != _VERSION:
                        raise HandoverError("malformed adoption request")
                    sock = socket.socket(fileno=fds.pop())
                    buffered = base64.b64decode(str(header.get("buffered", "")))
                    ok = await self._adopt(str(header["channel"]), sock, str(header.get("remote", "")), buffered)
                    if ok:
                        self.adopted += 1
                    else:
                        sock.close()  # only our copy of the fd: the giver still holds the connection
                    await send_all(loop, conn, json.dumps({"ok": ok}).encode() + b"\n", [])
            except (OSError, HandoverError, TimeoutError, ValueError, KeyError) as exc:
                log.warning("adoption_failed", error=str(exc))
            finally:
                for fd in fds:
                    os.close(fd)


async def hand_over(
    path: Path,
    own_identity: tuple[int, int] | None,
    channel: str,
    remote: str,
    fd: int,
    buffered: bytes,
    *,
    timeout: float = 3.0,
) -> bool:
    """Give the connected socket ``fd`` (and what was read from it but not handled) to the successor at ``path``.

    False when there is no successor (the path is missing or still ours), or
    the exchange fails: the caller then closes the connection itself.
    """
    current = path_identity(path)
    if current is None or current == own_identity or len(buffered) > MAX_BUFFERED:
        return False
    loop = asyncio.get_running_loop()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.setblocking(False)
    try:
        async with asyncio.timeout(timeout):
            await loop.sock_connect(client, str(path))
            header = {"v": _VERSION, "channel": channel, "remote": remote,
                      "buffered": base64.b64encode(buffered).decode("ascii")}
            await send_all(loop, client, json.dumps(header).encode() + b"\n", [fd])
            line, _ = await read_line(loop, client, with_fds=False)
        reply = json.loads(line)
    except (OSError, HandoverError, TimeoutError, ValueError) as exc:
        log.info("connection_handover_failed", channel=channel, error=str(exc))
        return False
    finally:
        client.close()
    return isinstance(reply, dict) and reply.get("ok") is True

"""Live sender connections handed to the successor during an upgrade (docs/deploy.md).

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

Version 2 adds what the sender is still owed on that connection (``Owed``):
``"replies"``, the answers it waits for in arrival order — ACK frames ready to
write, or an application ACK held for the server with the time left — and
``"relays"``, enhanced-mode application ACKs to relay when their rows settle.
The successor keeps the per-connection order rule (ACKs in arrival order,
each in its own write). Compatibility both ways during an upgrade or a
rollback: a giver sends version 1, byte for byte as before, whenever nothing
is owed; a successor of the previous version knows only 1 and refuses a
version 2 request, and the giver then keeps the connection and answers what
it owes itself (AR "resend later" for held application ACKs) before closing.
A taker accepts both versions and ignores keys it does not know.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import structlog

from agent.core.envelope import Envelope
from agent.core.intake_types import NOTHING_OWED, Owed, OwedFrame, OwedRelay, OwedReply, OwedWait
from agent.errors import HandoverError
from agent.runtime.aio import cancel_and_wait
from agent.runtime.unixsock import (
    accept_forever,
    bind_unix_atomically,
    connect_unix,
    path_identity,
    peer_credentials,
    read_line,
    send_all,
)

__all__ = [
    "ADOPT_SOCKET",
    "MAX_BUFFERED",
    "NOTHING_OWED",
    "Adopter",
    "AdoptionServer",
    "Owed",
    "OwedFrame",
    "OwedRelay",
    "OwedReply",
    "OwedWait",
    "hand_over",
    "owed_from",
    "owed_json",
]

log = structlog.get_logger(__name__)

ADOPT_SOCKET = "adopt.sock"
#: Version 1: the connection and its unread bytes; version 2: and what it is owed.
_VERSION = 1
_VERSION_OWED = 2
#: Read-but-unhandled bytes that travel with a connection (pipelined frames).
#: Beyond this the giver closes the usual way instead; base64 makes the line ~4/3 of it.
MAX_BUFFERED = 8 * 1024 * 1024
#: What is owed (ACK frames, MSH fields of rows awaiting the server) travels in the same line.
MAX_OWED_BYTES = 4 * 1024 * 1024
_MAX_LINE = MAX_BUFFERED * 4 // 3 + MAX_OWED_BYTES + 4096


#: (channel, connected socket, remote, bytes read but not handled, what is owed) -> served?
Adopter = Callable[[str, socket.socket, str, bytes, Owed], Awaitable[bool]]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _envelope_json(env: Envelope) -> dict[str, str]:
    return {f.name: getattr(env, f.name) for f in fields(Envelope)}


def _envelope_from(data: Any) -> Envelope:
    if not isinstance(data, dict):
        raise ValueError("msh must be an object")
    return Envelope(**{f.name: str(data.get(f.name, "")) for f in fields(Envelope)})


def _relay_json(relay: OwedRelay) -> dict[str, Any]:
    return {"id": relay.message_id, "msh": _envelope_json(relay.inbound)}


def _relay_from(data: Any) -> OwedRelay:
    return OwedRelay(str(data["id"]), _envelope_from(data["msh"]))


def owed_json(owed: Owed) -> dict[str, Any]:
    """The version 2 keys for ``owed``."""
    replies: list[dict[str, Any]] = []
    for reply in owed.replies:
        if reply.wait is not None:
            w = reply.wait
            replies.append({"wait": {"id": w.message_id, "msh": _envelope_json(w.inbound), "codec": w.codec,
                                     "timeout": round(max(0.0, w.timeout), 3)}})
            continue
        entry: dict[str, Any] = {"frames": [{"frame": _b64(f.frame), "id": f.message_id,
                                             **({"also": list(f.also)} if f.also else {})}
                                            for f in reply.frames]}
        if reply.relay is not None:
            entry["relay"] = _relay_json(reply.relay)
        if reply.relays:  # an ACK batch's members' application ACKs
            entry["batch_relays"] = [_relay_json(r) for r in reply.relays]
        replies.append(entry)
    return {"replies": replies, "relays": [_relay_json(r) for r in owed.relays]}


def owed_from(header: dict[str, Any]) -> Owed:
    """What a version 2 request says is owed (a version 1 request owes nothing); ValueError when malformed."""
    try:
        replies: list[OwedReply] = []
        for entry in header.get("replies") or ():
            if entry.get("wait") is not None:
                w = entry["wait"]
                replies.append(OwedReply(wait=OwedWait(str(w["id"]), _envelope_from(w["msh"]), str(w["codec"]),
                                                       float(w["timeout"]))))
                continue
            frames = tuple(
                OwedFrame(base64.b64decode(str(f["frame"]), validate=True),
                          None if f.get("id") is None else str(f["id"]),
                          tuple(str(i) for i in f.get("also") or ()))
                for f in entry.get("frames") or ()
            )
            relay = _relay_from(entry["relay"]) if entry.get("relay") is not None else None
            batch_relays = tuple(_relay_from(r) for r in entry.get("batch_relays") or ())
            replies.append(OwedReply(frames=frames, relay=relay, relays=batch_relays))
        relays = tuple(_relay_from(r) for r in header.get("relays") or ())
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ValueError(f"malformed owed ACKs: {exc!r}") from None
    return Owed(tuple(replies), relays)


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
                    if (len(fds) != 1 or not isinstance(header, dict)
                            or header.get("v") not in (_VERSION, _VERSION_OWED)):
                        raise HandoverError("malformed adoption request")
                    # Everything parsed before the fd becomes ours: a malformed request closes it below.
                    channel, remote = str(header["channel"]), str(header.get("remote", ""))
                    buffered = base64.b64decode(str(header.get("buffered", "")))
                    owed = owed_from(header) if header["v"] == _VERSION_OWED else NOTHING_OWED
                    sock = socket.socket(fileno=fds.pop())
                    ok = await self._adopt(channel, sock, remote, buffered, owed)
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
    owed: Owed = NOTHING_OWED,
    timeout: float = 3.0,
) -> bool:
    """Give the connected socket ``fd`` (what was read from it but not handled, what it is owed) to the successor at ``path``.

    False when there is no successor (the path is missing or still ours), or
    the exchange fails, or the successor does not take what is owed (a
    previous version): the caller then keeps the connection and closes it itself.
    """
    current = path_identity(path)
    if current is None or current == own_identity or len(buffered) > MAX_BUFFERED:
        return False
    header: dict[str, Any] = {"v": _VERSION, "channel": channel, "remote": remote, "buffered": _b64(buffered)}
    if owed:
        header.update(v=_VERSION_OWED, **owed_json(owed))
    line = json.dumps(header).encode() + b"\n"
    if len(line) > _MAX_LINE:
        log.info("connection_handover_skipped", channel=channel, reason="too much owed to hand over", size=len(line))
        return False
    loop = asyncio.get_running_loop()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.setblocking(False)
    try:
        async with asyncio.timeout(timeout):
            await connect_unix(client, path)
            await send_all(loop, client, line, [fd])
            answer, _ = await read_line(loop, client, with_fds=False)
        reply = json.loads(answer)
    except (OSError, HandoverError, TimeoutError, ValueError) as exc:
        log.info("connection_handover_failed", channel=channel, error=str(exc))
        return False
    finally:
        client.close()
    return isinstance(reply, dict) and reply.get("ok") is True

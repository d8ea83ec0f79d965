"""Unix stream sockets between two processes of the agent: fds, credentials, publishing.

What both hand-overs need — the listening sockets (:mod:`agent.runtime.handover`)
and the live connections (:mod:`agent.runtime.adoption`) — written once: a
line-based exchange on a non-blocking socket with SCM_RIGHTS fds riding on it
(unix(7)), received close-on-exec from the start; the peer's credentials
(SO_PEERCRED), and a server socket published 0600 at its path by rename, so no
one can connect before the mode is right.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import secrets
import socket
import struct
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import structlog

from agent.errors import HandoverError

log = structlog.get_logger(__name__)

_MAX_HEADER_BYTES = 64 * 1024
_MAX_FDS = 253  # SCM_MAX_FD, the kernel's limit per message (unix(7))


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the peer of a Unix stream socket (SO_PEERCRED)."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


async def _wait_fd(loop: asyncio.AbstractEventLoop, sock: socket.socket, *, write: bool) -> None:
    """Wait until ``sock`` is readable (or writable)."""
    fut: asyncio.Future[None] = loop.create_future()

    def _ready() -> None:
        if not fut.done():
            fut.set_result(None)

    fd = sock.fileno()
    if write:
        loop.add_writer(fd, _ready)
    else:
        loop.add_reader(fd, _ready)
    try:
        await fut
    finally:
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


def _recv_with_fds(sock: socket.socket) -> tuple[bytes, list[int], int]:
    """recvmsg() collecting SCM_RIGHTS fds, close-on-exec from the start.

    Not socket.recv_fds(): on Python 3.11 it drops its ``flags`` argument, so
    MSG_CMSG_CLOEXEC would silently not apply and a child spawned meanwhile
    could inherit (and keep alive) a listener.
    """
    item = array.array("i").itemsize
    data, ancdata, flags, _addr = sock.recvmsg(
        65536, socket.CMSG_SPACE(_MAX_FDS * item), socket.MSG_CMSG_CLOEXEC
    )
    fds = array.array("i")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % item)])
    return data, list(fds), flags


async def read_line(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    *,
    with_fds: bool,
    max_bytes: int = _MAX_HEADER_BYTES,
) -> tuple[bytes, list[int]]:
    """Read one ``\\n``-terminated line, collecting any SCM_RIGHTS fds on the way."""
    buf = bytearray()
    fds: list[int] = []
    data = b""
    try:
        while b"\n" not in data:  # only the newest chunk can hold the end: linear in the line
            if len(buf) > max_bytes:
                raise HandoverError("handover header too long")
            try:
                if with_fds:
                    data, new_fds, flags = _recv_with_fds(sock)
                    fds.extend(new_fds)
                    if flags & socket.MSG_CTRUNC:
                        raise HandoverError("handover fds truncated (MSG_CTRUNC)")
                else:
                    data = sock.recv(65536)
            except BlockingIOError:
                await _wait_fd(loop, sock, write=False)
                continue
            if not data:
                raise HandoverError("handover peer closed the connection early")
            buf.extend(data)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    line, _, _rest = bytes(buf).partition(b"\n")
    return line, fds


async def send_all(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    data: bytes,
    fds: list[int],
) -> None:
    """Send ``data``; the fds ride on the first byte(s) actually sent."""
    view = memoryview(data)
    pending_fds = fds
    while view:
        try:
            if pending_fds:
                sent = socket.send_fds(sock, [view], pending_fds)
            else:
                sent = sock.send(view)
        except BlockingIOError:
            await _wait_fd(loop, sock, write=True)
            continue
        if sent > 0:
            pending_fds = []
        view = view[sent:]


#: How long a connect waits before trying again while the peer's accept queue is full.
_FULL_QUEUE_RETRY_S = 0.002


async def connect_unix(sock: socket.socket, path: Path) -> None:
    """Connect the non-blocking Unix stream socket ``sock`` to ``path``, waiting while its queue is full.

    On a Unix socket a connect() into a full accept queue fails with EAGAIN
    (unix(7)), not EINPROGRESS as on TCP; asyncio's ``sock_connect`` then
    waits for the socket to be writable and takes it as connected when it is
    not, and the first send fails with ENOTCONN. A stopping process hands
    every connection over at once, so this tries again until the successor
    has accepted some (the caller bounds it with a timeout).
    """
    while True:
        try:
            sock.connect(str(path))
        except BlockingIOError:  # EAGAIN: the accept queue is full for now
            await asyncio.sleep(_FULL_QUEUE_RETRY_S)
            continue
        return


def bind_unix_atomically(path: Path) -> tuple[socket.socket, tuple[int, int]]:
    """A listening Unix socket published at ``path`` by rename, 0600 before anyone can connect.

    Returns the socket and the (dev, inode) identity of the published file, so
    its owner can later tell whether ``path`` is still its own.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(tmp))
        os.chmod(tmp, 0o600)
        sock.listen(socket.SOMAXCONN)  # a stopping process hands over all its connections at once
        sock.setblocking(False)
        st = os.stat(tmp)
        os.replace(tmp, path)
    except BaseException:
        sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return sock, (st.st_dev, st.st_ino)


def path_identity(path: Path) -> tuple[int, int] | None:
    """(dev, inode) of ``path``, or None when it does not exist."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


async def accept_forever(
    server: socket.socket,
    serve: Callable[[socket.socket], Coroutine[Any, Any, None]],
    tasks: set[asyncio.Task[None]],
    *,
    name: str,
) -> None:
    """Accept on a Unix server socket and serve each peer in a tracked task, until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            conn, _ = await loop.sock_accept(server)
        except OSError as exc:
            # Transient (EMFILE, ECONNABORTED): keep serving, the peer
            # retries; never kill the daemon over it.
            log.warning(f"{name}_accept_failed", error=str(exc))
            await asyncio.sleep(0.1)
            continue
        task = asyncio.create_task(serve(conn), name=f"{name}-conn")
        tasks.add(task)
        task.add_done_callback(tasks.discard)

"""Handing listening sockets to a successor process over a Unix socket (SCM_RIGHTS).

The running process serves its listeners (:class:`HandoverServer`) at a path
in the state directory; its successor connects (:func:`receive_handover`) and
receives duplicates of the very same sockets (unix(7)), so both share one
accept queue and nothing queued is lost when the old one stops accepting
(docs/deploy.md#how-the-listening-sockets-outlive-a-process). The Unix-socket
plumbing under it is :mod:`agent.runtime.unixsock`.

Handover wire format (one connection per handover, version 1):
    server -> client: one JSON line ``{"v":1,"names":[...],"pid":N}\\n``; the
                      fds, in ``names`` order, ride on the same sendmsg.
    client -> server: ``{"ok":true}\\n`` once it owns the sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from collections.abc import Callable
from pathlib import Path

import structlog

from agent.errors import HandoverError
from agent.runtime.aio import cancel_and_wait
from agent.runtime.sockets import ListeningSocket, is_listening
from agent.runtime.unixsock import (
    accept_forever,
    bind_unix_atomically,
    connect_unix,
    path_identity,
    peer_credentials,
    read_line,
    send_all,
)
from agent.storage.liveness import process_exited

log = structlog.get_logger(__name__)

_PROTOCOL_VERSION = 1


class HandoverServer:
    """Serves this process's listening sockets to a successor over a Unix socket (SCM_RIGHTS)."""

    def __init__(
        self,
        path: Path,
        sockets: Callable[[], dict[str, socket.socket]],
        *,
        recheck_interval: float = 1.0,
    ) -> None:
        """``sockets`` is asked at each request, so it always reflects the live listeners."""
        self.path = Path(path)
        self._sockets = sockets
        self._recheck_interval = recheck_interval
        self._server_sock: socket.socket | None = None
        self._identity: tuple[int, int] | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._conn_tasks: set[asyncio.Task[None]] = set()
        #: The process our listeners went to last, while it may still be serving at ``path``.
        self._successor_pid: int | None = None
        self.handed_over = asyncio.Event()

    async def start(self) -> None:
        """Bind atomically over ``path`` and start serving.

        bind() on a temporary name in the same directory, chmod 0600, listen,
        then rename over ``path``: a predecessor's server is superseded (it
        keeps its now-unnamed socket), never unlinked from under it, and no
        one can connect before the mode is right.
        """
        if self._server_sock is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._serve_on(*self._bind())
        self._watch_task = asyncio.create_task(self._watch(), name="handover-watch")
        log.info("handover_server_started", path=str(self.path))

    async def close(self) -> None:
        """Stop serving; remove ``path`` only while it is still ours (same inode)."""
        watch, self._watch_task = self._watch_task, None
        await cancel_and_wait(watch)
        await self._stop_accepting()
        await cancel_and_wait(*self._conn_tasks)
        if self._identity is not None:
            if self._path_identity() == self._identity:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
            self._identity = None

    def _bind(self) -> tuple[socket.socket, tuple[int, int]]:
        return bind_unix_atomically(self.path)

    def _serve_on(self, sock: socket.socket, identity: tuple[int, int]) -> None:
        self._server_sock = sock
        self._identity = identity
        self._accept_task = asyncio.create_task(self._accept_loop(sock), name="handover-accept")

    async def _stop_accepting(self) -> None:
        task, self._accept_task = self._accept_task, None
        await cancel_and_wait(task)
        sock, self._server_sock = self._server_sock, None
        if sock is not None:
            sock.close()

    def _path_identity(self) -> tuple[int, int] | None:
        return path_identity(self.path)

    @property
    def superseded(self) -> bool:
        """A successor took our listeners and publishes its own server at ``path`` now."""
        current = self._path_identity()
        return self.handed_over.is_set() and current is not None and current != self._identity

    def _successor_left_a_dead_socket(self) -> bool:
        """Our successor died (kill -9, a crash) and its socket at ``path`` answers no one."""
        pid = self._successor_pid
        if pid is None or not process_exited(pid):
            return False
        self._successor_pid = None  # looked at once per successor
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.setblocking(False)
        try:
            probe.connect(str(self.path))
        except (ConnectionRefusedError, FileNotFoundError):
            return True
        except OSError:
            return False  # someone serves there (a backlog full, a new server coming up)
        finally:
            probe.close()
        return False  # a newer process serves there: leave it

    async def _watch(self) -> None:
        """Publish our server again when ``path`` vanished or its successor's socket died.

        A successor that took our listeners supersedes our path; if it then
        fails and exits (an upgrade rolled back) it removes the path, and if
        it is killed it leaves its socket file behind with no one listening.
        Without this the next attempt would find no one to take over from and
        fail to bind a port we still hold. A path superseded by a live
        successor is left alone.
        """
        while True:
            await asyncio.sleep(self._recheck_interval)
            current = self._path_identity()
            if current is not None and (current == self._identity or not self._successor_left_a_dead_socket()):
                continue
            try:
                sock, identity = self._bind()
            except OSError as exc:
                log.warning("handover_rebind_failed", path=str(self.path), error=str(exc))
                continue
            await self._stop_accepting()
            self._serve_on(sock, identity)
            log.info("handover_server_republished", path=str(self.path))

    async def _accept_loop(self, server: socket.socket) -> None:
        await accept_forever(server, self._serve, self._conn_tasks, name="handover")

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        with conn:
            conn.setblocking(False)
            try:
                peer_pid, peer_uid, _gid = peer_credentials(conn)
            except OSError:
                peer_pid, peer_uid = -1, -1
            # The file is 0600 in a 0700 directory; refuse other users anyway.
            if peer_uid not in (os.geteuid(), 0):
                log.warning("handover_refused", peer_pid=peer_pid, peer_uid=peer_uid)
                return
            # A listener this process already closed (it is shutting down) is
            # skipped: its fileno() is -1 and sending it would break the exchange.
            socks = {n: s for n, s in self._sockets().items() if s.fileno() >= 0}
            names = list(socks)
            header = (
                json.dumps(
                    {"v": _PROTOCOL_VERSION, "names": names, "pid": os.getpid()},
                    separators=(",", ":"),
                ).encode("utf-8")
                + b"\n"
            )
            try:
                async with asyncio.timeout(10.0):
                    await send_all(loop, conn, header, [socks[n].fileno() for n in names])
                    line, _ = await read_line(loop, conn, with_fds=False)
                reply = json.loads(line)
            except (OSError, HandoverError, TimeoutError, ValueError) as exc:
                log.warning("handover_failed", peer_pid=peer_pid, error=str(exc))
                return
            if not isinstance(reply, dict) or reply.get("ok") is not True:
                log.warning("handover_failed", peer_pid=peer_pid, error="no ok from successor")
                return
        log.info("listeners_handed_over", names=names, successor_pid=peer_pid)
        self._successor_pid = peer_pid if peer_pid > 0 else None
        self.handed_over.set()


async def receive_republished(path: Path, within: float) -> dict[str, socket.socket] | None:
    """:func:`receive_handover`, tried until ``within`` seconds passed: for a port found taken.

    A predecessor still holding the listeners whose successor was killed
    serves at ``path`` again within its recheck interval (a second); a
    process started in that second found only the dead file.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        handed = await receive_handover(path)
        if handed is not None or loop.time() >= deadline:
            return handed
        await asyncio.sleep(0.1)  # the predecessor's recheck, not a peer we could wait on


async def receive_handover(path: Path, timeout: float = 5.0) -> dict[str, socket.socket] | None:
    """Take over a predecessor's listening sockets from its HandoverServer at ``path``.

    None when nobody serves there (no file, or a stale file: ECONNREFUSED) —
    the caller then binds. A broken exchange raises HandoverError: the
    predecessor exists but something is wrong, and binding anew over a live
    predecessor would fail or split the accept queue.
    """
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    received: list[ListeningSocket] = []
    fds: list[int] = []
    try:
        try:
            async with asyncio.timeout(timeout):
                try:
                    await connect_unix(sock, path)
                except (FileNotFoundError, ConnectionRefusedError):
                    return None
                line, fds = await read_line(loop, sock, with_fds=True)
                try:
                    header = json.loads(line)
                    names = header["names"]
                    pid = header.get("pid")
                    if header.get("v") != _PROTOCOL_VERSION:
                        raise ValueError(f"unsupported handover version {header.get('v')!r}")
                    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                        raise ValueError("names is not a list of strings")
                except (ValueError, KeyError, TypeError) as exc:
                    raise HandoverError(f"bad handover header: {exc}") from exc
                if len(names) != len(fds) or len(set(names)) != len(names):
                    raise HandoverError(f"handover sent {len(fds)} fds for names {names!r}")
                while fds:
                    fd = fds.pop(0)
                    try:
                        listener = ListeningSocket(fileno=fd)
                    except OSError:
                        os.close(fd)
                        raise
                    received.append(listener)
                for listener, name in zip(received, names, strict=True):
                    if not is_listening(listener):
                        raise HandoverError(f"handed-over socket {name!r} is not listening")
                    listener.setblocking(False)
                await send_all(loop, sock, b'{"ok":true}\n', [])
        except TimeoutError as exc:
            raise HandoverError(f"handover from {path} timed out after {timeout}s") from exc
        except OSError as exc:
            raise HandoverError(f"handover from {path} failed: {exc}") from exc
    except BaseException:
        for listener in received:
            listener.close()
        for fd in fds:
            os.close(fd)
        raise
    finally:
        sock.close()
    result = dict(zip(names, received, strict=True))
    log.info("listeners_inherited", source="handover", names=names, predecessor_pid=pid)
    return result

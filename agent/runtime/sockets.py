"""Listening sockets that outlive a process (SPEC 7).

Three ways to get a channel's listener, in the daemon's order of preference:

1. **systemd socket activation** (sd_listen_fds(3)): the fds start at 3,
   ``LISTEN_FDS`` says how many, ``LISTEN_FDNAMES`` names them
   (``FileDescriptorName=`` in the .socket unit), ``LISTEN_PID`` says whom
   they are for. systemd keeps the socket across service restarts.
2. **handover**: the running process serves its listeners over a Unix socket
   in the state directory; its successor receives duplicates of the very same
   sockets (SCM_RIGHTS, unix(7)). Old and new share one socket and one accept
   queue, so when the old one stops accepting nothing queued is lost.
3. **bind**, with ``SO_REUSEPORT`` when asked. Its trap: each reuseport
   listener has its own accept queue and closing one resets the connections
   still queued in it, unless ``net.ipv4.tcp_migrate_req=1`` (Linux >= 5.14).

Never call ``shutdown()`` on a listener obtained here: it acts on the shared
socket and would stop the successor's accepts too. ``close()`` only drops
this process's reference.

Handover wire format (one connection per handover, version 1):
    server -> client: one JSON line ``{"v":1,"names":[...],"pid":N}\\n``; the
                      fds, in ``names`` order, ride on the same sendmsg.
    client -> server: ``{"ok":true}\\n`` once it owns the sockets.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import errno
import json
import os
import secrets
import socket
import struct
from collections.abc import Callable, Coroutine, MutableMapping
from pathlib import Path
from typing import Any

import structlog

from agent.errors import HandoverError
from agent.runtime.aio import cancel_and_wait

log = structlog.get_logger(__name__)

SD_LISTEN_FDS_START = 3  # sd_listen_fds(3)
_PROTOCOL_VERSION = 1
_MAX_HEADER_BYTES = 64 * 1024
_MAX_FDS = 253  # SCM_MAX_FD, the kernel's limit per message (unix(7))
_TCP_MIGRATE_REQ = Path("/proc/sys/net/ipv4/tcp_migrate_req")


# --------------------------------------------------------------------------
# systemd socket activation


def inherited_sockets(
    environ: MutableMapping[str, str] = os.environ,
) -> dict[str, list[socket.socket]]:
    """Sockets passed by systemd, by FileDescriptorName (unnamed → ``"unknown"``).

    Follows sd_listen_fds_with_names(unset_environment=1): the fds are ours
    only when LISTEN_PID is our PID; the LISTEN_* variables are removed in
    every case so a child process never mistakes them for its own.
    """
    try:
        raw_pid = environ.get("LISTEN_PID", "")
        raw_fds = environ.get("LISTEN_FDS", "")
        raw_names = environ.get("LISTEN_FDNAMES")
    finally:
        for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            environ.pop(key, None)

    if not raw_pid or not raw_fds:
        return {}
    try:
        pid = int(raw_pid)
        count = int(raw_fds)
    except ValueError:
        log.warning("listen_fds_invalid", listen_pid=raw_pid, listen_fds=raw_fds)
        return {}
    if pid != os.getpid():
        log.info("listen_fds_not_ours", listen_pid=pid)
        return {}
    if count <= 0:
        return {}

    names = raw_names.split(":") if raw_names is not None else []
    result: dict[str, list[socket.socket]] = {}
    for index in range(count):
        fd = SD_LISTEN_FDS_START + index
        name = names[index] if index < len(names) and names[index] else "unknown"
        try:
            # FD_CLOEXEC: systemd passes them inheritable; our children must
            # not keep the listener alive (sd_listen_fds sets it too).
            os.set_inheritable(fd, False)
            # fileno= detects family and type from the fd (uvicorn does the same).
            sock = socket.socket(fileno=fd)
        except OSError as exc:
            for socks in result.values():
                for s in socks:
                    s.close()
            raise HandoverError(
                f"LISTEN_FDS fd {fd} ({name!r}) is not a usable socket: {exc.strerror}"
            ) from exc
        sock.setblocking(False)
        result.setdefault(name, []).append(sock)
    log.info(
        "listeners_inherited",
        source="systemd",
        names=sorted(result),
        count=count,
    )
    return result


# --------------------------------------------------------------------------
# binding ourselves


def _split_host(host: str) -> str | None:
    """``[::1]`` → ``::1``; empty → None (all interfaces)."""
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or None


def bind_listener(
    host: str,
    port: int,
    *,
    reuse_port: bool = False,
    backlog: int = 1024,
) -> socket.socket:
    """A non-blocking TCP listener on host:port (IPv4 or IPv6 by the host string).

    SO_REUSEADDR lets a restart bind over TIME_WAIT remnants; SO_REUSEPORT is
    the overlap fallback of SPEC 7 (see this module's docstring for its trap).
    """
    infos = socket.getaddrinfo(
        _split_host(host),
        port,
        family=socket.AF_UNSPEC,
        type=socket.SOCK_STREAM,
        proto=socket.IPPROTO_TCP,
        flags=socket.AI_PASSIVE,
    )
    if not infos:  # pragma: no cover - getaddrinfo raises instead
        raise OSError(errno.EADDRNOTAVAIL, f"no address for {host!r}")
    family, type_, proto, _canon, sockaddr = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(sockaddr)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def tcp_migrate_req_enabled(path: Path = _TCP_MIGRATE_REQ) -> bool | None:
    """Whether the kernel migrates queued connections off a closing reuseport listener.

    None when unknown (no such sysctl: kernel < 5.14, or /proc not mounted).
    Note it is per network namespace: a container sees its own value.
    """
    try:
        return path.read_text(encoding="ascii").strip() == "1"
    except (OSError, ValueError):
        return None


def is_listening(sock: socket.socket) -> bool:
    """True when ``sock`` is a listening (SO_ACCEPTCONN) stream socket."""
    try:
        return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
    except OSError:
        return False


# --------------------------------------------------------------------------
# handover between processes


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
        sock.listen(8)
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

    async def _watch(self) -> None:
        """Publish our server again when ``path`` vanished.

        A successor that took our listeners supersedes our path; if it then
        fails and exits (an upgrade rolled back) it removes the path, and
        without this the next attempt would find no one to take over from and
        fail to bind a port we still hold. A path superseded by a live
        successor is left alone.
        """
        while True:
            await asyncio.sleep(self._recheck_interval)
            if self._path_identity() is not None:
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
        self.handed_over.set()


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
    received: list[socket.socket] = []
    fds: list[int] = []
    try:
        try:
            async with asyncio.timeout(timeout):
                try:
                    await loop.sock_connect(sock, str(path))
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
                        s = socket.socket(fileno=fd)
                    except OSError:
                        os.close(fd)
                        raise
                    received.append(s)
                for s, name in zip(received, names, strict=True):
                    if not is_listening(s):
                        raise HandoverError(f"handed-over socket {name!r} is not listening")
                    s.setblocking(False)
                await send_all(loop, sock, b'{"ok":true}\n', [])
        except TimeoutError as exc:
            raise HandoverError(f"handover from {path} timed out after {timeout}s") from exc
        except OSError as exc:
            raise HandoverError(f"handover from {path} failed: {exc}") from exc
    except BaseException:
        for s in received:
            s.close()
        for fd in fds:
            os.close(fd)
        raise
    finally:
        sock.close()
    result = dict(zip(names, received, strict=True))
    log.info("listeners_inherited", source="handover", names=names, predecessor_pid=pid)
    return result

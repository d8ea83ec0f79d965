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

The file status flags, O_NONBLOCK among them, belong to the open file
description, which every process sharing a listener shares too (fcntl(2)).
Another process can therefore switch *our* listener to blocking mode: systemd
does exactly that when it passes a socket to a unit without ``NonBlocking=yes``
(the default is no, and it clears the flag). An event loop would then block
inside accept4() until the next connection arrives. ``ListeningSocket`` checks
the flag before every accept and puts it back (logging
``listener_blocking_mode_repaired``), and ``SO_RCVTIMEO``, which Linux also
applies to a blocking accept (socket(7)), bounds the stall to
``ACCEPT_STALL_BOUND_S`` should the flag be cleared between check and call.

Sockets this process bound or took over are also given to systemd's file
descriptor store (``FDSTORE=1``, sd_pid_notify_with_fds(3)) when it runs under
a unit with ``FileDescriptorStoreMax=``: after a crash systemd passes them
back to the restarted process, and connections arriving in between wait in
the kernel's accept queue instead of being refused.

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
import fcntl
import json
import os
import secrets
import socket
import struct
import time
from collections.abc import Callable, Coroutine, Mapping, MutableMapping
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

#: The longest an accept() on a listener switched to blocking mode behind our
#: back may stall the event loop (SO_RCVTIMEO on the listening socket).
ACCEPT_STALL_BOUND_S = 0.05
#: How often ``listener_blocking_mode_repaired`` is logged per listener at most.
_REPAIR_LOG_INTERVAL_S = 60.0
#: Suffix of the names under which our own listeners sit in systemd's fd store,
#: so a restarted process tells them from a socket unit's (FileDescriptorName=).
STORED_SUFFIX = ".stored"


# --------------------------------------------------------------------------
# listeners shared with other processes


class ListeningSocket(socket.socket):
    """A listening socket whose ``accept()`` never waits, whoever else shares it.

    asyncio calls ``accept()`` in a loop until it raises BlockingIOError; on
    a listener that another process switched to blocking mode the last call
    would wait for the next connection with the whole event loop. The flag is
    checked (one fcntl) and put back before each call. Accepted connections
    are plain sockets.
    """

    __slots__ = ()

    def accept(self) -> tuple[socket.socket, Any]:
        restore_nonblocking(self)
        return super().accept()


_repairs: dict[int, tuple[float, int]] = {}


def restore_nonblocking(sock: socket.socket) -> bool:
    """Set O_NONBLOCK again when someone sharing ``sock`` cleared it; True when it was cleared."""
    fd = sock.fileno()
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if flags & os.O_NONBLOCK:
        return False
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    now = time.monotonic()
    last, count = _repairs.get(fd, (float("-inf"), 0))
    count += 1
    if now - last >= _REPAIR_LOG_INTERVAL_S:
        log.warning(
            "listener_blocking_mode_repaired",
            listen=_address_text(sock),
            times=count,
            hint="another process sharing this listening socket switched it to blocking mode "
            "(systemd does so for a unit without NonBlocking=yes); set it back to non-blocking",
        )
        count = 0
        last = now
    _repairs[fd] = (last, count)
    return True


def guard_listener(sock: socket.socket) -> ListeningSocket:
    """Make ``sock`` (the same object) a non-blocking ``ListeningSocket`` with a bounded accept."""
    if not isinstance(sock, ListeningSocket):
        if type(sock) is not socket.socket:
            raise TypeError(f"cannot guard a listener of type {type(sock).__name__}")
        # Same memory layout (no new slots): the object, and everyone's
        # reference to it, simply gains the checked accept().
        sock.__class__ = ListeningSocket
    assert isinstance(sock, ListeningSocket)
    sock.setblocking(False)
    usec = int(ACCEPT_STALL_BOUND_S * 1_000_000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("@ll", 0, usec))
    return sock


def _address_text(sock: socket.socket) -> str:
    try:
        name = sock.getsockname()
    except OSError:
        return "unknown"
    if isinstance(name, tuple) and len(name) >= 2:
        host, port = name[0], name[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(name)


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
            sock = ListeningSocket(fileno=fd)
        except OSError as exc:
            for socks in result.values():
                for s in socks:
                    s.close()
            raise HandoverError(
                f"LISTEN_FDS fd {fd} ({name!r}) is not a usable socket: {exc.strerror}"
            ) from exc
        # systemd passes them blocking unless the unit says NonBlocking=yes.
        sock.setblocking(False)
        result.setdefault(name, []).append(sock)
    log.info(
        "listeners_inherited",
        source="systemd",
        names=sorted(result),
        count=count,
    )
    return result


def _notify_address(environ: Mapping[str, str]) -> str | None:
    """$NOTIFY_SOCKET as an AF_UNIX address (``@name``: abstract namespace), or None."""
    raw = environ.get("NOTIFY_SOCKET", "")
    if raw.startswith("@"):
        return "\0" + raw[1:]
    if raw.startswith("/"):
        return raw
    return None


def store_listeners(
    listeners: Mapping[str, socket.socket],
    environ: Mapping[str, str] = os.environ,
) -> list[str]:
    """Give systemd a copy of each listener to keep across restarts; the channel names stored.

    One ``FDSTORE=1`` datagram per listener with its fd attached (SCM_RIGHTS)
    and ``FDNAME=<channel>.stored`` (sd_pid_notify_with_fds(3)). systemd keeps
    them while the unit restarts (crash, watchdog) and passes them back in
    LISTEN_FDS; it closes them when the unit stops. Without NOTIFY_SOCKET
    (run by hand, Docker) nothing is sent. A unit without
    ``FileDescriptorStoreMax=`` drops them (systemd logs that); a send that
    fails is logged and costs only the zero-refusal restart.
    """
    address = _notify_address(environ)
    if address is None or not listeners:
        return []
    stored: list[str] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as notify:
        notify.settimeout(0.5)
        for name, sock in listeners.items():
            payload = f"FDSTORE=1\nFDNAME={name}{STORED_SUFFIX}\n".encode("ascii")
            rights = array.array("i", [sock.fileno()]).tobytes()
            try:
                notify.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)], 0, address)
            except OSError as exc:
                log.warning("listener_not_stored", channel=name, error=str(exc))
                continue
            stored.append(name)
    if stored:
        log.info("listeners_stored_with_systemd", channels=stored)
    return stored


def forget_stored_listener(name: str, environ: Mapping[str, str] = os.environ) -> None:
    """Ask systemd to close a listener it keeps for us (``FDSTOREREMOVE=1``), e.g. a stale address."""
    address = _notify_address(environ)
    if address is None:
        return
    payload = f"FDSTOREREMOVE=1\nFDNAME={name}{STORED_SUFFIX}\n".encode("ascii")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as notify:
            notify.settimeout(0.5)
            notify.sendto(payload, address)
    except OSError as exc:
        log.warning("stored_listener_not_removed", channel=name, error=str(exc))


def same_address(sock: socket.socket, host: str, port: int) -> bool:
    """Whether ``sock`` is bound where ``host:port`` would bind (port 0: any port)."""
    try:
        bound = sock.getsockname()
        infos = socket.getaddrinfo(
            _split_host(host), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError:
        return False
    if not infos:  # pragma: no cover - getaddrinfo raises instead
        return False
    want = infos[0][4]
    return bool(want[0] == bound[0] and (port == 0 or want[1] == bound[1]))


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
) -> ListeningSocket:
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
    sock = ListeningSocket(family, type_, proto)
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

    @property
    def superseded(self) -> bool:
        """A successor took our listeners and publishes its own server at ``path`` now."""
        current = self._path_identity()
        return self.handed_over.is_set() and current is not None and current != self._identity

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
    received: list[ListeningSocket] = []
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

"""Listening sockets that outlive a process (docs/deploy.md#how-the-listening-sockets-outlive-a-process).

Three ways to get a channel's listener, in the daemon's order of preference:

1. **systemd socket activation** (sd_listen_fds(3)): the fds start at 3,
   ``LISTEN_FDS`` says how many, ``LISTEN_FDNAMES`` names them
   (``FileDescriptorName=`` in the .socket unit), ``LISTEN_PID`` says whom
   they are for. systemd keeps the socket across service restarts.
2. **handover** (:mod:`agent.runtime.handover`): the running process serves
   its listeners over a Unix socket in the state directory; its successor
   receives duplicates of the very same sockets (SCM_RIGHTS, unix(7)). Old and
   new share one socket and one accept queue, so when the old one stops
   accepting nothing queued is lost.
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

"""

from __future__ import annotations

import array
import errno
import fcntl
import os
import socket
import struct
import time
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

import structlog

from agent.errors import HandoverError

log = structlog.get_logger(__name__)

SD_LISTEN_FDS_START = 3  # sd_listen_fds(3)
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
    the upgrade overlap's fallback (see this module's docstring for its trap).
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

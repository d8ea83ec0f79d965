"""systemd's readiness and watchdog protocol (sd_notify), without libsystemd.

The protocol (sd_notify(3)) is one datagram of newline-separated ``KEY=VALUE``
lines sent to the AF_UNIX socket named by ``$NOTIFY_SOCKET``; a leading ``@``
names a socket in the abstract namespace. With ``Type=notify`` systemd treats
the unit as started only on ``READY=1``, so the daemon sends it once its
listeners and database are up (the upgrade script waits for it: docs/deploy.md#systemd).
``WatchdogSec=`` expects ``WATCHDOG=1`` more often than ``$WATCHDOG_USEC``;
the service pings from an event-loop task (``Service._watchdog``), so a
wedged loop misses the ping and systemd restarts the unit.

Notification is best effort: a lost datagram must never take the daemon down,
so sends never raise; the first failure is logged once.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import structlog

log = structlog.get_logger(__name__)

# A full READY+STATUS+MAINPID datagram is a few hundred bytes; systemd reads
# at most PIPE_BUF-ish sizes comfortably. Keep STATUS short and single-line.
_MAX_STATUS_CHARS = 200

# Bound how long a send may block the event loop if systemd's queue is full.
_SEND_TIMEOUT_S = 0.5


def _socket_address(value: str) -> str | None:
    """Turn $NOTIFY_SOCKET into an AF_UNIX address, or None if unusable.

    sd_notify(3): an absolute path, or ``@name`` for the abstract namespace
    (a leading NUL byte). ``vsock:`` addresses (systemd >= 254 in VMs) are not
    supported here and disable notification.
    """
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None


def _clean_status(text: str) -> str:
    """One line, bounded: a newline would start a new KEY=VALUE assignment."""
    flat = " ".join(text.split())
    return flat[:_MAX_STATUS_CHARS]


class Notifier:
    """Sends sd_notify datagrams; a no-op when not started by systemd."""

    def __init__(
        self,
        address: str | None,
        *,
        watchdog_usec: int | None = None,
        watchdog_pid: int | None = None,
    ) -> None:
        """``address`` is an AF_UNIX address (abstract ones start with NUL) or None."""
        self._address = address
        self._watchdog_usec = watchdog_usec
        self._watchdog_pid = watchdog_pid
        self._sock: socket.socket | None = None
        self._failed_once = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> Notifier:
        """Build from $NOTIFY_SOCKET / $WATCHDOG_USEC / $WATCHDOG_PID.

        No NOTIFY_SOCKET (run by hand, in Docker, in tests) gives a notifier
        whose methods do nothing.
        """
        raw = environ.get("NOTIFY_SOCKET", "")
        address = _socket_address(raw) if raw else None
        if raw and address is None:
            log.warning("notify_socket_unsupported", notify_socket=raw)
        usec: int | None = None
        raw_usec = environ.get("WATCHDOG_USEC", "")
        if raw_usec:
            try:
                usec = int(raw_usec)
            except ValueError:
                log.warning("watchdog_usec_invalid", watchdog_usec=raw_usec)
            else:
                if usec <= 0:
                    usec = None
        wd_pid: int | None = None
        raw_pid = environ.get("WATCHDOG_PID", "")
        if raw_pid:
            try:
                wd_pid = int(raw_pid)
            except ValueError:
                # sd_watchdog_enabled(3) treats an unparsable PID as "not for us".
                wd_pid = -1
        return cls(address, watchdog_usec=usec, watchdog_pid=wd_pid)

    @property
    def enabled(self) -> bool:
        """True when there is a notify socket to talk to."""
        return self._address is not None

    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings (half of $WATCHDOG_USEC), or None.

        sd_watchdog_enabled(3): the watchdog applies to us only when
        WATCHDOG_PID is unset or equals our PID; systemd recommends pinging at
        half the timeout so one late tick does not kill the service.
        """
        if self._watchdog_usec is None:
            return None
        if self._watchdog_pid is not None and self._watchdog_pid != os.getpid():
            return None
        return self._watchdog_usec / 1_000_000 / 2

    def ready(self, status: str | None = None) -> None:
        """READY=1: listeners and database are up (Type=notify start completes)."""
        lines = ["READY=1", f"MAINPID={os.getpid()}"]
        if status:
            lines.append(f"STATUS={_clean_status(status)}")
        self._send(lines)

    def status(self, text: str) -> None:
        """STATUS=...: shown by `systemctl status`."""
        self._send([f"STATUS={_clean_status(text)}"])

    def watchdog(self) -> None:
        """WATCHDOG=1: the event loop is alive."""
        self._send(["WATCHDOG=1"])

    def stopping(self, status: str | None = None) -> None:
        """STOPPING=1: shutdown began (draining connections and in-flight rows)."""
        lines = ["STOPPING=1"]
        if status:
            lines.append(f"STATUS={_clean_status(status)}")
        self._send(lines)

    def close(self) -> None:
        """Release the datagram socket (idempotent)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _send(self, lines: list[str]) -> None:
        """Send one datagram; never raises (best effort, logged once)."""
        if self._address is None:
            return
        payload = ("\n".join(lines) + "\n").encode("utf-8")
        try:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                sock.settimeout(_SEND_TIMEOUT_S)
                self._sock = sock
            self._sock.sendto(payload, self._address)
        except OSError as exc:
            if not self._failed_once:
                self._failed_once = True
                log.warning("sd_notify_failed", error=str(exc), errno=exc.errno)


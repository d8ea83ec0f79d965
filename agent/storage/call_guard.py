"""Drop a database connection whose call outlives its deadline: a server that froze.

A PostgreSQL server stopped with SIGSTOP, or a VM paused under it, keeps its
TCP connections: the kernel still acknowledges what we send and answers
keepalives, so neither libpq's ``tcp_user_timeout`` nor keepalives notice,
and the server-side ``statement_timeout`` and ``lock_timeout`` never fire. A
call on such a connection blocks for as long as the freeze lasts — the
writer thread with it, and every sender waiting for its ACK behind it.

So the writer and the reader arm a :class:`CallGuard` around each database
call they make (a write batch, one read), and one watchdog thread shuts down
the socket of a connection whose guard is still armed past its deadline.
The blocked call then fails as a lost connection does (the dialect opens a
new one, with backoff), so intake answers "resend later" instead of nothing.
A guarded call costs a ``dup`` and a ``close`` of the socket's descriptor (so
the watchdog never shuts down a number the connection gave up and another
socket took); the watchdog wakes a few times a second while any guard is
armed, and sleeps otherwise.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import structlog

log = structlog.get_logger(__name__)

__all__ = ["CallGuard"]

#: How often the watchdog looks at the armed guards.
CHECK_INTERVAL = 0.2

#: A look that comes this much later than CHECK_INTERVAL means this process did not run
#: meanwhile (SIGSTOP, a suspended VM): its own pause, not the server's silence.
PAUSE_SLACK = 1.0


class CallGuard:
    """One connection's deadline: armed around a call, the socket shut down when it passes."""

    def __init__(self, role: str, on_trip: Callable[[float], None] | None = None) -> None:
        """``on_trip(seconds)``: called (on the watchdog thread) when the connection was dropped."""
        self.role = role
        self._on_trip = on_trip
        self._lock = threading.Lock()
        self._deadline: float | None = None
        #: Our own descriptor of the connection's socket while armed: it cannot be
        #: closed and its number reused under the watchdog (-1: none).
        self._fd = -1
        self._seconds = 0.0
        #: How often the watchdog dropped the connection (for tests).
        self.tripped = 0

    def arm(self, fd: int, seconds: float) -> None:
        """From now, the call on socket ``fd`` has ``seconds`` to return."""
        own = os.dup(fd)
        with self._lock:
            self._release_fd()
            self._fd, self._seconds = own, seconds
            self._deadline = time.monotonic() + seconds
        _watchdog().watch(self)

    def disarm(self) -> None:
        with self._lock:
            self._deadline = None
            self._release_fd()

    @contextmanager
    def around(self, fd: int, seconds: float) -> Iterator[None]:
        """Armed for the block."""
        self.arm(fd, seconds)
        try:
            yield
        finally:
            self.disarm()

    def _release_fd(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _postpone(self, seconds: float) -> None:
        """The deadline moves on by ``seconds`` this process did not run: the server had no chance then."""
        with self._lock:
            if self._deadline is not None:
                self._deadline += seconds

    def _trip_if_late(self, now: float) -> bool:
        """Shut the socket down when the deadline passed; True while the guard is armed."""
        with self._lock:
            deadline = self._deadline
            if deadline is None:
                return False
            if now < deadline:
                return True
            self._deadline = None
            self.tripped += 1
            _shut_down(self._fd)
        log.warning("queue_database_unresponsive", role=self.role, waited_s=self._seconds,
                    hint="the database server accepts the connection but does not answer (frozen, "
                         "paused VM?): the connection is dropped and opened again")
        if self._on_trip is not None:
            self._on_trip(self._seconds)
        return False


def _shut_down(fd: int) -> None:
    """Shut the socket behind ``fd`` down for both directions: a call blocked on it returns."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()  # the descriptor stays the guard's, closed when it is disarmed


class _Watchdog:
    """One daemon thread for every guard of the process; it sleeps while none is armed."""

    def __init__(self) -> None:
        self._guards: weakref.WeakSet[CallGuard] = weakref.WeakSet()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, guard: CallGuard) -> None:
        if guard not in self._guards:
            with self._lock:
                self._guards.add(guard)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="db-call-guard", daemon=True)
                    self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            last = time.monotonic()
            while True:
                now = time.monotonic()
                armed = self.check(now, last)
                last = now
                if not armed:
                    break  # none armed: sleep until one is
                time.sleep(CHECK_INTERVAL)

    def check(self, now: float, last: float) -> bool:
        """One look at every guard (the last one was at ``last``); True while any is armed.

        A look much later than CHECK_INTERVAL after the last means this
        process itself did not run in between (SIGSTOP, a suspended VM):
        the deadlines move on by that pause instead of being blamed on the
        server, which may well have answered meanwhile.
        """
        with self._lock:
            guards = list(self._guards)
        paused = now - last - CHECK_INTERVAL
        if paused > PAUSE_SLACK:
            log.warning("process_was_paused", paused_s=round(paused, 1),
                        hint="this process did not run (SIGSTOP, a suspended VM?): database calls "
                             "under way get that much longer")
            for guard in guards:
                guard._postpone(paused)
        return any([guard._trip_if_late(now) for guard in guards])


_WATCHDOG: _Watchdog | None = None
_WATCHDOG_LOCK = threading.Lock()


def _watchdog() -> _Watchdog:
    global _WATCHDOG  # noqa: PLW0603 - one watchdog thread per process, made on first use
    if _WATCHDOG is None:
        with _WATCHDOG_LOCK:
            if _WATCHDOG is None:
                _WATCHDOG = _Watchdog()
    return _WATCHDOG

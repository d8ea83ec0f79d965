"""The call guard: a call blocked on a socket past its deadline returns, one that finished is left alone.

A real socket pair stands in for the database connection: the peer never
answers, as a frozen server does.
"""

from __future__ import annotations

import socket
import threading
import time

from agent.storage.call_guard import CHECK_INTERVAL, CallGuard, _Watchdog


def test_a_call_blocked_past_its_deadline_is_released() -> None:
    ours, peer = socket.socketpair()
    guard = CallGuard("writer")
    got: list[bytes | Exception] = []
    try:
        with guard.around(ours.fileno(), 0.3):
            started = time.monotonic()
            reader = threading.Thread(target=lambda: got.append(ours.recv(10)))
            reader.start()
            reader.join(5)
            waited = time.monotonic() - started
        assert not reader.is_alive(), "the blocked recv was never released"
        assert got == [b""] and guard.tripped == 1
        assert 0.3 <= waited < 0.3 + 5 * CHECK_INTERVAL + 1.0
    finally:
        ours.close()
        peer.close()


def test_a_call_that_returns_in_time_keeps_its_connection() -> None:
    ours, peer = socket.socketpair()
    guard = CallGuard("reader")
    try:
        for _ in range(3):
            with guard.around(ours.fileno(), 0.2):
                peer.sendall(b"x")
                assert ours.recv(1) == b"x"
        time.sleep(0.2 + 3 * CHECK_INTERVAL)  # past the deadline: nothing armed, nothing dropped
        peer.sendall(b"y")
        assert ours.recv(1) == b"y" and guard.tripped == 0
    finally:
        ours.close()
        peer.close()


def test_a_pause_of_this_process_is_not_blamed_on_the_server() -> None:
    """A look at the guards long after the last one (this process was stopped) moves deadlines on.

    A SIGSTOP of the test process itself cannot be taken from inside it, so
    the watchdog's look is called with the times a pause would give: 10 s
    between two looks meant 0.2 s apart. A frozen server (no pause of ours)
    is still dropped at its deadline.
    """
    ours, peer = socket.socketpair()
    guard = CallGuard("writer")
    watchdog = _Watchdog()
    watchdog._guards.add(guard)
    try:
        guard.arm(ours.fileno(), 2.0)
        armed_at = time.monotonic()
        # This process stopped for 10 s at once: the 2 s deadline moves on by that pause.
        assert watchdog.check(armed_at + 10.2, armed_at)
        assert guard.tripped == 0
        peer.sendall(b"x")
        assert ours.recv(1) == b"x"  # the connection was kept: the server's answer is read
        # Looks at the usual interval after it: the moved deadline still holds, then passes.
        assert watchdog.check(armed_at + 11.0, armed_at + 10.8)
        assert not watchdog.check(armed_at + 12.3, armed_at + 12.1)
        assert guard.tripped == 1
    finally:
        guard.disarm()
        ours.close()
        peer.close()

"""The holder's own check that its lease still stands, before every write to the server (pure, a clock the test moves)."""

from __future__ import annotations

import time

import pytest

from agent.core.lease import LEASE_WRITE_FRACTION, LeaseValidity, lease_clock


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class TestLeaseValidity:
    def test_nothing_is_valid_before_the_lease_was_taken(self) -> None:
        """Without a successful take or renewal there is no lease to write under."""
        validity = LeaseValidity(30.0, Clock())
        assert not validity.valid() and validity.age() is None

    def test_valid_until_the_share_of_the_ttl_has_passed(self) -> None:
        """Renewed at t: valid up to just before t + 0.8 x TTL, not at it (the margin before a successor may start)."""
        clock = Clock()
        validity = LeaseValidity(30.0, clock)
        validity.renewed(clock.now)
        assert LEASE_WRITE_FRACTION == 0.8
        clock.now += 23.999
        assert validity.valid()
        clock.now += 0.001
        assert not validity.valid()

    def test_a_renewal_counts_from_when_it_began(self) -> None:
        """A renewal that took 5 s to commit counts from its start: the age is never under-counted."""
        clock = Clock()
        validity = LeaseValidity(10.0, clock)
        started = clock.now
        clock.now += 5.0  # the transaction waited on a busy database
        validity.renewed(started)
        assert validity.age() == pytest.approx(5.0)
        clock.now += 3.0
        assert not validity.valid()  # 8 s since the renewal began: the limit

    def test_a_late_answer_for_an_older_renewal_never_moves_it_back(self) -> None:
        """renewed() keeps the newest start it was told."""
        clock = Clock()
        validity = LeaseValidity(10.0, clock)
        validity.renewed(clock.now)
        validity.renewed(clock.now - 7.0)
        assert validity.age() == 0.0

    def test_a_freeze_longer_than_the_margin_invalidates(self) -> None:
        """A process stopped for a whole TTL finds its lease unproven when it wakes."""
        clock = Clock()
        validity = LeaseValidity(6.0, clock)
        validity.renewed(clock.now)
        assert validity.valid()
        clock.now += 6.0  # SIGSTOP ... SIGCONT
        assert not validity.valid()


class TestLeaseClock:
    def test_it_never_goes_back_and_ticks_with_real_time(self) -> None:
        """The clock is monotonic and keeps pace with the monotonic clock."""
        a, m0 = lease_clock(), time.monotonic()
        deadline = m0 + 0.05
        while time.monotonic() < deadline:
            pass  # busy-wait 50 ms on purpose: measuring a clock, not synchronising
        b, m1 = lease_clock(), time.monotonic()
        assert b >= a
        assert abs((b - a) - (m1 - m0)) < 0.01

"""Retry policy: capped exponential backoff with bounded jitter (SPEC 6)."""

from __future__ import annotations

import itertools
import random

import pytest

from agent.core.retry import attempts_exhausted, backoff, retry_delay


class TestBackoff:
    def test_without_jitter_doubles_to_the_cap(self) -> None:
        """With jitter 0 the delays are 1, 2, 4, ... and stay at the cap."""
        delays = list(itertools.islice(backoff(jitter=0), 9))
        assert delays == [1, 2, 4, 8, 16, 32, 60, 60, 60]

    def test_jitter_stays_within_bounds(self) -> None:
        """Each jittered delay lies in [base * (1 - jitter), base] and never above the cap."""
        rng = random.Random(1234)
        bases = list(itertools.islice(backoff(jitter=0), 40))
        delays = list(itertools.islice(backoff(jitter=0.2, rng=rng), 40))
        for base, delay in zip(bases, delays, strict=True):
            assert base * 0.8 <= delay <= base <= 60

    def test_jitter_actually_spreads(self) -> None:
        """Two agents with different random sources do not reconnect in lockstep."""
        a = list(itertools.islice(backoff(rng=random.Random(1)), 5))
        b = list(itertools.islice(backoff(rng=random.Random(2)), 5))
        assert a != b

    def test_seeded_rng_is_reproducible(self) -> None:
        """The same seed gives the same delays (tests can pin them)."""
        a = list(itertools.islice(backoff(rng=random.Random(7)), 10))
        b = list(itertools.islice(backoff(rng=random.Random(7)), 10))
        assert a == b

    def test_long_runs_do_not_overflow(self) -> None:
        """Thousands of steps stay at the cap instead of overflowing a float."""
        gen = backoff(jitter=0)
        last = next(itertools.islice(gen, 5000, None))
        assert last == 60

    def test_custom_parameters(self) -> None:
        """initial, factor and cap are honoured."""
        assert list(itertools.islice(backoff(0.1, 3.0, 1.0, 0), 4)) == pytest.approx(
            [0.1, 0.3, 0.9, 1.0]
        )

    @pytest.mark.parametrize(
        "kwargs",
        [{"initial": 0}, {"cap": -1}, {"factor": 0.5}, {"jitter": 1.5}, {"jitter": -0.1}],
    )
    def test_invalid_parameters_raise(self, kwargs: dict[str, float]) -> None:
        """Nonsense parameters are refused at once, not on first use."""
        with pytest.raises(ValueError):
            next(backoff(**kwargs))  # type: ignore[arg-type]


class TestRetryDelay:
    def test_no_failure_needs_no_wait(self) -> None:
        """Before any transient failure there is nothing to wait for."""
        assert retry_delay(0) == 0.0

    def test_matches_backoff_sequence(self) -> None:
        """After N failures the delay is initial * 2**(N-1), capped (about 1 s doubling to 60 s)."""
        assert [retry_delay(n, jitter=0) for n in range(1, 9)] == [1, 2, 4, 8, 16, 32, 60, 60]

    def test_huge_attempt_counts_are_capped(self) -> None:
        """A message retried forever keeps a 60 s delay, no overflow."""
        assert retry_delay(10**6, jitter=0) == 60

    def test_jitter_bounds(self) -> None:
        """Jittered delays stay within [0.8 * base, base] for jitter 0.2."""
        rng = random.Random(99)
        for n in range(1, 20):
            base = retry_delay(n, jitter=0)
            assert base * 0.8 <= retry_delay(n, rng=rng) <= base

    def test_negative_attempt_raises(self) -> None:
        """A negative failure count is a caller bug."""
        with pytest.raises(ValueError):
            retry_delay(-1)


class TestAttemptsExhausted:
    def test_zero_means_forever(self) -> None:
        """max_attempts 0 never runs out."""
        assert not attempts_exhausted(10**9, 0)

    def test_limit_reached(self) -> None:
        """With max_attempts 3, attempts 1-2 leave room and 3 is the last."""
        assert [attempts_exhausted(n, 3) for n in (0, 1, 2, 3, 4)] == [
            False,
            False,
            False,
            True,
            True,
        ]

    def test_negative_limit_raises(self) -> None:
        """A negative max_attempts is a configuration bug, refused."""
        with pytest.raises(ValueError):
            attempts_exhausted(1, -1)

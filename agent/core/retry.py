"""Retry policy: capped exponential backoff with jitter (docs/queue.md#retry-and-backoff).

Pure, in the websockets style: whether and when to retry are plain functions
and a generator of delays, so the asyncio callers (upstream reconnects, the
dispatcher's transient retries) stay thin and the policy is tested without a
loop or a clock.

Jitter is *subtractive*: a delay is drawn uniformly from
``[base * (1 - jitter), base]``. It never exceeds ``cap`` (an operator reading
"cap = 60 s" can rely on it) and still spreads many agents reconnecting to a
restarted server over a window instead of one thundering instant.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

__all__ = ["attempts_exhausted", "backoff", "retry_delay"]


def _check(initial: float, factor: float, cap: float, jitter: float) -> None:
    if initial <= 0 or cap <= 0:
        raise ValueError("initial and cap must be > 0")
    if factor < 1:
        raise ValueError("factor must be >= 1")
    if not 0 <= jitter <= 1:
        raise ValueError("jitter must be within [0, 1]")


def _base(n: int, initial: float, factor: float, cap: float) -> float:
    """Un-jittered delay after ``n`` (>= 0) growth steps, computed without float overflow."""
    if initial >= cap:
        return cap
    if factor == 1 or n == 0:
        return initial
    # initial * factor**n >= cap  <=>  n >= log(cap / initial) / log(factor)
    if n >= math.log(cap / initial) / math.log(factor):
        return cap
    return min(cap, initial * factor**n)


def _jittered(base: float, jitter: float, rng: random.Random | None) -> float:
    if jitter == 0:
        return base
    # Timing jitter, not security: the module-level PRNG is fine here.
    draw = (rng or random).random()
    return base * (1.0 - jitter * draw)


def backoff(
    initial: float = 1.0,
    factor: float = 2.0,
    cap: float = 60.0,
    jitter: float = 0.2,
    rng: random.Random | None = None,
) -> Iterator[float]:
    """Yield delays forever: initial, initial*factor, ... capped at ``cap``, each jittered down."""
    _check(initial, factor, cap, jitter)
    n = 0
    while True:
        yield _jittered(_base(n, initial, factor, cap), jitter, rng)
        n += 1


def retry_delay(
    attempt: int,
    *,
    initial: float = 1.0,
    cap: float = 60.0,
    jitter: float = 0.2,
    factor: float = 2.0,
    rng: random.Random | None = None,
) -> float:
    """Delay before attempt N+1 after ``attempt`` = N transient failures (about 1 s doubling to 60 s).

    ``attempt`` 0 (nothing failed yet) needs no wait.
    """
    _check(initial, factor, cap, jitter)
    if attempt < 0:
        raise ValueError("attempt must be >= 0")
    if attempt == 0:
        return 0.0
    return _jittered(_base(attempt - 1, initial, factor, cap), jitter, rng)


def attempts_exhausted(attempts: int, max_attempts: int) -> bool:
    """True once ``attempts`` sends used up ``max_attempts``; 0 means retry forever (docs/queue.md#giving-up)."""
    if max_attempts < 0:
        raise ValueError("max_attempts must be >= 0")
    return max_attempts > 0 and attempts >= max_attempts

"""One asyncio idiom the daemon needs in several places, written once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def unless(
    aw: Awaitable[T], event: asyncio.Event, *, timeout: float | None = None
) -> asyncio.Future[T] | None:
    """Await ``aw`` until it finishes, ``event`` is set, or ``timeout`` passes.

    Returns the finished future (the caller reads ``result()``), or None when
    the event or the timeout came first — ``aw`` is then cancelled and has
    finished unwinding before this returns. Our own cancellation propagates.
    """
    task = asyncio.ensure_future(aw)
    waiter = asyncio.ensure_future(event.wait())
    finished = False
    try:
        await asyncio.wait({task, waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finished = task.done()
    finally:
        waiter.cancel()
        if not finished:
            task.cancel()
            await asyncio.wait({task})
            if not task.cancelled():
                task.exception()  # retrieved: it ended while being abandoned
    return task if finished else None

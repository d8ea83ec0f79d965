"""One asyncio idiom the daemon needs in several places, written once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

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


async def cancel_and_wait(*tasks: asyncio.Future[Any] | None) -> None:
    """Cancel ``tasks`` and wait until each has finished unwinding.

    Their own CancelledError (or a late error) is collected here, never
    raised; a cancellation of *our* caller still propagates (STYLE: never
    swallow CancelledError), which a bare ``suppress(CancelledError)`` around
    ``await task`` would do.
    """
    pending = [task for task in tasks if task is not None]
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)

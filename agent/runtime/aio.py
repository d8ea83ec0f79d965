"""The asyncio idioms the daemon needs in several places, written once.

Not ``asyncio.wait_for`` for waits that a TaskGroup or a shutdown may cancel:
before Python 3.12 it runs the awaited thing as a task of its own, and when
that task finishes in the same loop turn as a cancellation of the waiter, it
returns the result and the cancellation is lost (CPython gh-86296, fixed in
3.12 by rebuilding ``wait_for`` on ``asyncio.timeout``). A worker that loses
its cancellation that way keeps running while its TaskGroup waits for it:
here, a lease tenure that never ends. ``wait_event`` awaits in the caller's
own task under ``asyncio.timeout``, which counts cancellations and never
swallows one that is not its own.
"""

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


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait until ``event`` is set or ``timeout`` seconds pass; True when it is set.

    A cancellation of the caller always propagates, also when it comes in the
    same loop turn as the event (see the module docstring).
    """
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return event.is_set()
    return True

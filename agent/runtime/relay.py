"""Application-ACK relay: from a settled row to the connection that owes it.

The process that holds the sender's connection relays the server's ACK once
the row is settled in the database (docs/acks.md#relayed-application-acks):
through an in-process signal when it also holds the lease, by polling the
row otherwise (upgrade overlap, where another process dispatches). Both paths run here: a waiter gets the
in-process signal at once, and one shared poller reads every waiting row in
one query as a fallback.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from agent.errors import StorageError
from agent.runtime.aio import cancel_and_wait
from agent.storage.store import SqliteStore
from agent.storage.writer import Reader

log = structlog.get_logger(__name__)


class AckRelay:
    """Futures keyed by row id, resolved by the dispatcher or by polling."""

    def __init__(self, reader: Reader | None, *, poll_interval: float = 0.5) -> None:
        self._reader = reader
        self._poll_interval = poll_interval
        self._waiters: dict[str, list[asyncio.Future[bytes]]] = {}
        self._poller: asyncio.Task[None] | None = None

    def settled(self, message_id: str, app_ack: bytes) -> None:
        """The dispatcher committed this row's application ACK (same event loop)."""
        for fut in self._waiters.pop(message_id, []):
            if not fut.done():
                fut.set_result(app_ack)

    async def wait(self, message_id: str, timeout: float | None) -> bytes | None:
        """The row's application ACK, or None when it did not come within ``timeout`` (None: no limit)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bytes] = loop.create_future()
        self._waiters.setdefault(message_id, []).append(fut)
        self._ensure_poller()
        try:
            # asyncio.timeout, not wait_for: a cancelled waiter must stay cancelled
            # (see agent/runtime/aio.py on Python 3.11).
            async with asyncio.timeout(timeout):
                return await asyncio.shield(fut)
        except TimeoutError:
            return None
        finally:
            waiting = self._waiters.get(message_id)
            if waiting is not None:
                with contextlib.suppress(ValueError):
                    waiting.remove(fut)
                if not waiting:
                    del self._waiters[message_id]
            if not fut.done():
                fut.cancel()

    def _ensure_poller(self) -> None:
        if self._reader is not None and (self._poller is None or self._poller.done()):
            self._poller = asyncio.get_running_loop().create_task(self._poll(), name="ack-relay-poller")

    async def _poll(self) -> None:
        assert self._reader is not None
        while self._waiters:
            await asyncio.sleep(self._poll_interval)
            ids = list(self._waiters)[:500]
            if not ids:
                continue
            try:
                found = await self._reader.call(SqliteStore.settled_app_acks, ids)
            except StorageError as exc:
                log.warning("ack_relay_poll_failed", error=str(exc))
                continue
            for message_id, app_ack in found.items():
                self.settled(message_id, app_ack)

    async def close(self) -> None:
        await cancel_and_wait(self._poller)

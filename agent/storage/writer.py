"""One writer thread, group commit; one reader thread for polling and stats.

The same on every backend (the store's dialect does what differs). SQLite is
synchronous and allows one writer at a time; on PostgreSQL each write
transaction takes one lock the same way, and group commit shares a commit
(and its WAL flush) among several senders just as well. The event loop never
waits on it: callers ``await writer.call(SqliteStore.method, …)``; the thread
takes every job waiting, runs them in one write transaction (each in its own
SAVEPOINT so a failing job does not sink the batch) and resolves the futures
only after ``COMMIT`` returned — so an accept ACK can never precede its commit
(docs/queue.md#the-promise). If COMMIT fails, every job of the batch fails.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

import structlog

from agent.errors import AgentError, StorageError
from agent.storage.store import SqliteStore

T = TypeVar("T")
P = ParamSpec("P")
log = structlog.get_logger(__name__)


@dataclass
class _Job:
    fn: Callable[[SqliteStore], Any]
    future: concurrent.futures.Future[Any]


_STOP = object()


def _bind(
    method: Callable[Concatenate[SqliteStore, P], T], *args: P.args, **kwargs: P.kwargs
) -> Callable[[SqliteStore], T]:
    """``method`` with its arguments, waiting for the store as its first one."""
    if not args and not kwargs:
        return method  # no more parameters: it takes the store only

    def job(store: SqliteStore) -> T:
        return method(store, *args, **kwargs)

    return job


class Writer:
    """Runs store operations on one thread, grouping them into shared commits."""

    def __init__(self, store: SqliteStore, *, max_batch: int = 512, name: str = "queue-writer") -> None:
        self.store = store
        self.max_batch = max_batch
        self._jobs: queue.SimpleQueue[_Job | object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._closed = False
        self._deferred: list[_Job] = []
        self._deferred_lock = threading.Lock()
        self.defer_flush_interval = 0.5
        self.batches = 0
        self.last_write = time.monotonic()  # of the last batch that changed a row

    def idle_for(self) -> float:
        """Seconds since a batch last changed a row (a refused intake changes none)."""
        return time.monotonic() - self.last_write

    def start(self) -> None:
        self._thread.start()

    def submit(
        self, method: Callable[Concatenate[SqliteStore, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> concurrent.futures.Future[T]:
        """Thread-safe: queue ``method(store, *args)`` for the next batch (``submit(SqliteStore.probe_write)``)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self._closed:
            future.set_exception(StorageError("the queue writer is closed"))
            return future
        self._jobs.put(_Job(_bind(method, *args, **kwargs), future))
        return future

    def defer(
        self, method: Callable[Concatenate[SqliteStore, P], object], *args: P.args, **kwargs: P.kwargs
    ) -> None:
        """Thread-safe: run ``fn`` with the next batch, without causing a commit of its own.

        For bookkeeping that may be lost in a crash (``ack_outcome``): it rides
        along with the next intake or dispatch commit, or is flushed within
        ``defer_flush_interval`` when the queue is quiet. Giving it a commit of
        its own would cost one fsync per message and slow every sender.
        """
        if self._closed:
            return
        with self._deferred_lock:
            self._deferred.append(_Job(_bind(method, *args, **kwargs), concurrent.futures.Future()))

    def _take_deferred(self) -> list[_Job]:
        with self._deferred_lock:
            taken, self._deferred = self._deferred, []
        return taken

    async def call(
        self, method: Callable[Concatenate[SqliteStore, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """Run one store method in the next committed batch: ``await writer.call(SqliteStore.claim, …)``.

        The form to use: a reader can grep for the store method it runs.
        """
        return await asyncio.wrap_future(self.submit(method, *args, **kwargs))

    def close(self, timeout: float = 10.0) -> None:
        """Finish every queued job, then stop the thread and close the connection."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.store.close()

    # -- the thread ----------------------------------------------------------

    def _loop(self) -> None:
        stopping = False
        while not stopping:
            try:
                first = self._jobs.get(timeout=self.defer_flush_interval)
            except queue.Empty:
                deferred = self._take_deferred()
                if deferred:
                    self._run_batch_safely(deferred)
                continue
            batch = self._take_deferred()
            nxt: _Job | object = first
            while True:
                if isinstance(nxt, _Job):
                    batch.append(nxt)
                else:  # _STOP: finish this batch (deferred jobs included), then end
                    stopping = True
                    break
                if len(batch) >= self.max_batch:
                    break
                try:
                    nxt = self._jobs.get_nowait()
                except queue.Empty:
                    break
            if batch:
                self._run_batch_safely(batch)

    def _run_batch_safely(self, jobs: list[_Job]) -> None:
        try:
            self._run_batch(jobs)
        except Exception as exc:  # noqa: BLE001 - the thread must outlive any one batch
            # A caller waiting on a future that is never resolved would
            # hang its connection for good; fail what is still pending.
            self._resolve_pending(jobs, StorageError(f"queue writer failed: {exc!r}"))

    def _run_batch(self, batch: list[_Job]) -> None:
        store = self.store
        dialect = store.dialect
        try:
            # On a database server the connection may have been lost since the
            # last batch: the store opens it again first (or fails at once).
            conn = store.begin_write()
        except StorageError as exc:
            self._fail_all(batch, exc)
            return
        except dialect.Error as exc:
            self._fail_all(batch, dialect.storage_error(exc))
            return
        # Intake measures free disk space once per batch, not on a timer: a
        # burst cannot outrun the check and eat the reserve dispatch needs.
        self.store.begin_batch()
        changes = dialect.changes(conn)
        outcomes: list[tuple[bool, Any]] = []
        for index, job in enumerate(batch):
            savepoint = f"job{index}"
            try:
                dialect.savepoint(conn, savepoint)
                result = job.fn(store)
                dialect.release(conn, savepoint)
                outcomes.append((True, result))
            except Exception as exc:  # noqa: BLE001 - every job error is reported to its caller
                dialect.rollback_to(conn, savepoint)
                if isinstance(exc, dialect.Error):
                    exc = dialect.storage_error(exc)
                outcomes.append((False, exc))
                if isinstance(exc, StorageError) and not dialect.in_transaction(conn):
                    # The whole transaction is gone (SQLite rolled it back after
                    # a disk I/O error; the server connection was lost): nothing
                    # of this batch is committed.
                    self._fail_all(batch, exc)
                    return
        try:
            dialect.commit(conn)
        except dialect.Error as exc:
            dialect.rollback(conn)
            self._fail_all(batch, dialect.storage_error(exc))
            return
        self.batches += 1
        if dialect.changes(conn) != changes:
            self.last_write = time.monotonic()
        for job, (ok, value) in zip(batch, outcomes, strict=True):
            if job.future.set_running_or_notify_cancel():
                if ok:
                    job.future.set_result(value)
                else:
                    job.future.set_exception(value)

    def _fail_all(self, batch: list[_Job], error: AgentError) -> None:
        # Callers first: a failing log stream (EPIPE, full disk) must not
        # leave them waiting.
        self._resolve_pending(batch, error)
        log.error("queue_commit_failed", error=str(error), jobs=len(batch))

    @staticmethod
    def _resolve_pending(batch: list[_Job], error: AgentError) -> None:
        for job in batch:
            future = job.future
            if future.done():
                continue
            if future.running() or future.set_running_or_notify_cancel():
                future.set_exception(error)


class Reader:
    """A second connection on its own thread for reads that must not queue behind writes."""

    def __init__(self, store: SqliteStore) -> None:
        self.store = store
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="queue-reader")
        self._lock = threading.Lock()

    def call_blocking(
        self, method: Callable[Concatenate[SqliteStore, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """Read from any thread, blocking it (the admin server's thread, the CLI)."""
        store = self.store
        with self._lock:
            try:
                store.connection()  # a connection lost since the last read is opened again
                return method(store, *args, **kwargs)
            except store.dialect.Error as exc:
                raise store.dialect.storage_error(exc) from exc

    async def call(
        self, method: Callable[Concatenate[SqliteStore, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """Run one store read on the reader thread: ``await reader.call(SqliteStore.channel_head, name)``."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._blocking, _bind(method, *args, **kwargs))

    def _blocking(self, fn: Callable[[SqliteStore], T]) -> T:
        return self.call_blocking(fn)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.store.close()

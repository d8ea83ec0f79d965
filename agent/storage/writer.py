"""One writer thread, group commit; one reader thread for polling and stats.

The same on every backend (the store's dialect does what differs). SQLite is
synchronous and allows one writer at a time; on PostgreSQL each write
transaction takes one lock the same way, and group commit shares a commit
(and its WAL flush) among several senders just as well. The event loop never
waits on it: callers ``await writer.call(SqliteStore.method, …)``; the thread
takes every job waiting (the batch grows with the load: whatever queued up
while the previous commit was on the disk), runs them in one write
transaction and answers only after ``COMMIT`` returned — so an accept ACK can
never precede its commit (docs/queue.md#the-promise). If COMMIT fails, every
job of the batch fails.

A batch runs first without any SAVEPOINT (each costs two statements and a
copy of every page it changes): its ``ack_outcome`` bookkeeping in one
statement, every other job in turn, and every intake group at once
(``SqliteStore.intake_groups``: one statement per kind for the whole batch).
Jobs fail rarely (a lost lease, an operator's change in between), so if
anything in it raises, the transaction is rolled back and the batch taken
again the careful way: each job in its own SAVEPOINT so a failing job does
not sink the batch; the intake groups together under one, and only if that
fails one by one, each in its own, so the failing one is found and its
neighbours still commit. A job is a store call and nothing else, so running
it again after a rollback is running it once.

Answers go back to the event loop in one ``call_soon_threadsafe`` per loop
per batch, not one per job: a thread hop costs a wake-up of the loop. The
other way, the intake groups of one loop turn (every sender's frame read in
it) are handed to the thread together at the start of the next turn, not
one by one: one wake-up of the thread, and one batch for them all.

On SQLite the writer also runs the WAL checkpoints, after answering a batch
(agent/storage/checkpoints.py), so no batch's ACKs wait for one; SQLite's
own, inside a COMMIT, is left as a backstop.

Jobs other than intake that arrive while a batch runs its statements still
join it, up to its COMMIT (late joiners): a dispatch settle waits for the
commit under way rather than the next whole batch, which roughly halves the
time a strict channel's message spends between its answer and its settle
while intake keeps the writer busy. Intake groups arriving then wait for the
next batch as before (they are sized by the load at its start). A caller
that will submit a job within moments says so first (:meth:`Writer.expect`:
the dispatcher does, for a transmit whose answer comes quickly); while such
jobs are announced, a batch about to commit waits up to ``HOLD_SECONDS`` (and
no longer than a batch's own work takes) for them, so every channel's settle
rides the commit under way.

About 600 lines on purpose: the writer and its small reader twin share
the job plumbing (binding, answering on the caller's loop) and are read together.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

import structlog

from agent.errors import AgentError, StorageError
from agent.storage import checkpoints
from agent.storage.rows import IntakeItem, IntakeResult
from agent.storage.sqlite import WAL_SIZE_LIMIT
from agent.storage.store import SqliteStore

T = TypeVar("T")
P = ParamSpec("P")
log = structlog.get_logger(__name__)

#: The longest a batch about to commit waits for jobs announced with Writer.expect().
#: About one answer's round trip from a server on the local network: a settle
#: that misses a commit waits for the whole next batch (several milliseconds
#: under intake load) instead.
HOLD_SECONDS = 0.002

#: Called on the event loop with a job's result, or None and the error.
IntakeDone = Callable[[list[IntakeResult] | None, BaseException | None], None]


@dataclass(slots=True, eq=False)
class _Job:
    """A store call; answered through ``future`` (any thread) or ``waiter`` on ``loop``."""

    fn: Callable[[SqliteStore], Any]
    future: concurrent.futures.Future[Any] | None = None
    loop: asyncio.AbstractEventLoop | None = None
    waiter: asyncio.Future[Any] | None = None
    ok: bool = False
    value: Any = None
    answered: bool = False


@dataclass(slots=True, eq=False)
class _IntakeJob:
    """One intake group (all or none), answered by ``done`` on ``loop``."""

    items: Sequence[IntakeItem]
    loop: asyncio.AbstractEventLoop
    done: IntakeDone
    ok: bool = False
    value: Any = None
    answered: bool = False


_AnyJob = _Job | _IntakeJob
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


def _one_group(items: Sequence[IntakeItem]) -> Callable[[SqliteStore], list[IntakeResult]]:
    def run(store: SqliteStore) -> list[IntakeResult]:
        return store.intake_groups((items,))[0]

    return run


def _deliver(jobs: list[_AnyJob]) -> None:
    """On the event loop: every answer of one batch for this loop."""
    for job in jobs:
        try:
            if isinstance(job, _IntakeJob):
                if job.ok:
                    job.done(job.value, None)
                else:
                    job.done(None, job.value)
            else:
                waiter = job.waiter
                if waiter is None or waiter.done():
                    continue  # the caller stopped waiting (cancelled)
                if job.ok:
                    waiter.set_result(job.value)
                else:
                    waiter.set_exception(job.value)
        except Exception as exc:  # noqa: BLE001 - one callback's bug must not cost the others their answer
            if job.loop is not None:
                job.loop.call_exception_handler({"message": "queue writer answer failed", "exception": exc})


class Writer:
    """Runs store operations on one thread, grouping them into shared commits."""

    def __init__(self, store: SqliteStore, *, max_batch: int = 512, name: str = "queue-writer") -> None:
        self.store = store
        self.max_batch = max_batch
        self._jobs: queue.SimpleQueue[_AnyJob | object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._closed = False
        #: Taken from the queue while a batch ran (intake groups, the stop
        #: marker): they start the next batch, in the order they came.
        self._carried: list[_AnyJob | object] = []
        self._deferred: list[_Job] = []
        #: Intake groups of the loop turn under way, per loop (touched on that loop only).
        self._pending_intake: dict[asyncio.AbstractEventLoop, list[_IntakeJob]] = {}
        #: Whether the stop marker is queued: jobs after it would never run.
        self._stop_queued = False
        self._stop_lock = threading.Lock()
        self._outcomes: list[tuple[str, str]] = []
        self._deferred_lock = threading.Lock()
        self.defer_flush_interval = 0.5
        self.hold = HOLD_SECONDS
        #: The hold is at least this long (0: as the batches' work says; tests
        #: widen it so a slow or loaded machine cannot make an answer miss it).
        self.min_hold = 0.0
        #: Moving average of a batch's own work (statements and COMMIT, not the
        #: hold): a job that misses a commit waits about that long for the next,
        #: so the hold is never longer (a fast disk and an idle writer: short).
        self._batch_seconds = 0.0
        #: Jobs announced with expect() and not submitted yet (written on the event loop only).
        self._expected = 0
        self.batches = 0
        self.last_write = time.monotonic()  # of the last batch that changed a row
        #: (time.monotonic(), error) while the latest intake answered failed, else None:
        #: /readyz's write probe is one small row and may still fit where messages do not.
        self.intake_failing: tuple[float, str] | None = None
        #: When to checkpoint the WAL (None: the database server does its own).
        self._pacer = checkpoints.CheckpointPacer(wal_limit=WAL_SIZE_LIMIT) if store.dialect.file_maintenance else None
        self._wal = store.db_path.with_name(store.db_path.name + "-wal")
        self._checkpoint_failed_at = -float("inf")

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
        self._jobs.put(_Job(_bind(method, *args, **kwargs), future=future))
        return future

    def intake(
        self, items: Sequence[IntakeItem], done: IntakeDone, loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        """From the event loop: commit ``items`` as one group (all or none) in the next batch.

        ``done(results, None)`` or ``done(None, error)`` is called on this
        loop after the batch's COMMIT returned (the hot path: no future, and
        one loop wake-up for every group of the batch). ``loop``: the running
        loop, when the caller has it at hand (``get_running_loop`` costs a
        getpid system call per message on glibc).
        """
        if loop is None:
            loop = asyncio.get_running_loop()
        if self._closed:
            loop.call_soon(done, None, StorageError("the queue writer is closed"))
            return
        pending = self._pending_intake.get(loop)
        if pending is None:
            # The first group of this loop turn: handed over at the start of the next turn.
            pending = self._pending_intake[loop] = []
            loop.call_soon(self._hand_over_intake, loop)
        pending.append(_IntakeJob(items, loop, done))

    def _hand_over_intake(self, loop: asyncio.AbstractEventLoop) -> None:
        """On ``loop``: its groups of the last loop turn to the writer thread, together.

        One hand-over per loop turn, not one per group: a group queued at once
        wakes the thread for it alone, and the thread then takes the GIL back
        and forth with the loop that is still reading the other senders' frames
        (futex wake-ups and context switches were a tenth of the process's CPU
        at 16 connections); and the batch it starts holds that one group while
        the others wait for its COMMIT. Together they start one batch.
        """
        pending = self._pending_intake.pop(loop, [])
        with self._stop_lock:
            if not self._stop_queued:
                put = self._jobs.put
                for job in pending:
                    put(job)
                return
        for job in pending:  # close() came first: the thread takes no more jobs
            loop.call_soon(job.done, None, StorageError("the queue writer is closed"))

    def defer(
        self, method: Callable[Concatenate[SqliteStore, P], object], *args: P.args, **kwargs: P.kwargs
    ) -> None:
        """Thread-safe: run ``fn`` with the next batch, without causing a commit of its own.

        For bookkeeping that may be lost in a crash: it rides along with the
        next intake or dispatch commit, or is flushed within
        ``defer_flush_interval`` when the queue is quiet. Giving it a commit of
        its own would cost one fsync per message and slow every sender.
        """
        if self._closed:
            return
        with self._deferred_lock:
            self._deferred.append(_Job(_bind(method, *args, **kwargs)))

    def defer_ack_outcome(self, message_id: str, outcome: str) -> None:
        """Thread-safe: ``SqliteStore.set_ack_outcome`` deferred (see :meth:`defer`), one statement per batch."""
        if self._closed:
            return
        with self._deferred_lock:
            self._outcomes.append((message_id, outcome))

    def _take_deferred(self) -> tuple[list[_Job], list[tuple[str, str]]]:
        with self._deferred_lock:
            taken, self._deferred = self._deferred, []
            outcomes, self._outcomes = self._outcomes, []
        return taken, outcomes

    def expect(self) -> None:
        """From the event loop: a job follows within moments (then :meth:`expected_done`, before submitting it).

        A hint, never a promise: a batch about to commit waits at most
        ``hold`` seconds for announced jobs, and none when nothing is announced.
        """
        self._expected += 1

    def expected_done(self) -> None:
        """From the event loop: the job announced with :meth:`expect` is submitted next, or will not come."""
        self._expected -= 1

    async def call(
        self, method: Callable[Concatenate[SqliteStore, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """Run one store method in the next committed batch: ``await writer.call(SqliteStore.claim, …)``.

        The form to use: a reader can grep for the store method it runs.
        """
        return await self._await(_bind(method, *args, **kwargs))

    async def _await(self, fn: Callable[[SqliteStore], T]) -> T:
        if self._closed:
            raise StorageError("the queue writer is closed")
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[T] = loop.create_future()
        self._jobs.put(_Job(fn, loop=loop, waiter=waiter))
        return await waiter

    def close(self, timeout: float = 10.0) -> None:
        """Finish every queued job, then stop the thread and close the connection."""
        if self._closed:
            return
        self._closed = True
        running = asyncio._get_running_loop()
        if running is not None and running in self._pending_intake:
            # Closed from that loop before its turn ended: its groups still go first.
            self._hand_over_intake(running)
        with self._stop_lock:
            self._stop_queued = True
            self._jobs.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.store.close()

    # -- the thread ----------------------------------------------------------

    def _next_job(self, timeout: float | None) -> _AnyJob | object:
        """The oldest job carried over from the last batch, else the queue's (raises queue.Empty)."""
        if self._carried:
            return self._carried.pop(0)
        if timeout is None:
            return self._jobs.get_nowait()
        return self._jobs.get(timeout=timeout)

    def _loop(self) -> None:
        stopping = False
        while not stopping:
            try:
                first = self._next_job(self.defer_flush_interval)
            except queue.Empty:
                deferred, outcomes = self._take_deferred()
                if deferred or outcomes:
                    self._run_batch_safely([], deferred, outcomes)
                continue
            batch: list[_AnyJob] = []
            nxt: _AnyJob | object = first
            while True:
                if isinstance(nxt, _Job | _IntakeJob):
                    batch.append(nxt)
                else:  # _STOP: finish this batch (deferred jobs included), then end
                    stopping = True
                    break
                if len(batch) >= self.max_batch:
                    break
                try:
                    nxt = self._next_job(None)
                except queue.Empty:
                    break
            deferred, outcomes = self._take_deferred()
            if batch or deferred or outcomes:
                self._run_batch_safely(batch, deferred, outcomes, stopping=stopping)

    def _run_batch_safely(self, batch: list[_AnyJob], deferred: list[_Job],
                          outcomes: list[tuple[str, str]], *, stopping: bool = False) -> None:
        try:
            self._run_batch(batch, deferred, outcomes, stopping=stopping)
        except Exception as exc:  # noqa: BLE001 - the thread must outlive any one batch
            # A caller waiting for an answer that never comes would hang its
            # connection for good; fail what is still unanswered.
            self._answer(batch, StorageError(f"queue writer failed: {exc!r}"))

    def _begin(self, batch: list[_AnyJob]) -> Any:  # noqa: ANN401 - the dialect's connection
        """BEGIN the batch's write transaction; None (every job failed) when it cannot start."""
        store = self.store
        dialect = store.dialect
        try:
            # On a database server the connection may have been lost since the
            # last batch: the store opens it again first (or fails at once).
            conn = store.begin_write()
        except StorageError as exc:
            self._fail_all(batch, exc)
            return None
        except dialect.Error as exc:
            self._fail_all(batch, dialect.storage_error(exc))
            return None
        # Intake's room is checked afresh for each batch (within the bounds of
        # agent/storage/maintenance.py: Space), each intake charged against it.
        store.begin_batch()
        return conn

    def _run_plain(self, batch: list[_AnyJob], deferred: list[_Job], outcomes: list[tuple[str, str]]) -> None:
        """The whole batch without savepoints, in the careful way's order: any error raises."""
        store = self.store
        if outcomes:
            store.set_ack_outcomes(outcomes)
        for later in deferred:
            later.fn(store)
        intakes: list[_IntakeJob] = []
        for job in batch:
            if isinstance(job, _IntakeJob):
                intakes.append(job)
            else:
                job.value = job.fn(store)
                job.ok = True
        if intakes:
            for job, results in zip(intakes, store.intake_groups([job.items for job in intakes]), strict=True):
                job.ok, job.value = True, results

    def _run_batch(self, batch: list[_AnyJob], deferred: list[_Job], outcomes: list[tuple[str, str]],
                   *, stopping: bool = False) -> None:
        dialect = self.store.dialect
        started = time.monotonic()
        conn = self._begin(batch)
        if conn is None:
            return
        changes = dialect.changes(conn)
        # Without savepoints first (the module docstring). Should anything
        # fail, the whole transaction is undone and the batch — late joiners
        # included — taken again below, each part in its own savepoint, so
        # the failing one spares the rest.
        try:
            self._run_plain(batch, deferred, outcomes)
            waited = 0.0 if stopping else self._run_late(conn, batch, plain=True)
        except Exception:  # noqa: BLE001 - any failure: the careful way finds whose it is
            dialect.rollback(conn)
            conn = self._begin(batch)
            if conn is None:
                return
            changes = dialect.changes(conn)
        else:
            self._commit(conn, batch, changes, started + waited)
            return
        waited = 0.0
        try:
            if outcomes:
                # Bookkeeping, validated up front; a failure costs only it.
                self._in_savepoint(conn, "outcomes", lambda s: s.set_ack_outcomes(outcomes))
            for later in deferred:
                self._in_savepoint(conn, "deferred", later.fn)
            intakes: list[_IntakeJob] = []
            for index, job in enumerate(batch):
                if isinstance(job, _IntakeJob):
                    intakes.append(job)
                else:
                    job.ok, job.value = self._in_savepoint(conn, f"job{index}", job.fn)
            if intakes:
                self._run_intakes(conn, intakes)
            if not stopping:
                waited = self._run_late(conn, batch)
        except _TransactionLost as lost:
            self._fail_all(batch, lost.error)
            return
        self._commit(conn, batch, changes, started + waited)

    def _commit(self, conn: Any, batch: list[_AnyJob], changes: int,  # noqa: ANN401 - the dialect's connection
                since: float) -> None:
        """COMMIT, then answer every job (all failed when COMMIT failed).

        ``since``: when the batch began, moved on by the time it held for
        announced jobs (the rest is its own work, which bounds the next hold).
        """
        dialect = self.store.dialect
        try:
            dialect.commit(conn)
        except dialect.Error as exc:
            dialect.rollback(conn)
            self._fail_all(batch, dialect.storage_error(exc))
            return
        self.batches += 1
        self._batch_seconds += 0.2 * (time.monotonic() - since - self._batch_seconds)
        if dialect.changes(conn) != changes:
            self.last_write = time.monotonic()
        self._answer(batch)
        if self._pacer is not None and (self._pacer.committed() or self._pacer.wal_too_long(self._wal_bytes())):
            self._checkpoint()

    def _wal_bytes(self) -> int:
        """The WAL file's size (one stat per batch); 0 when it cannot be read."""
        try:
            return os.stat(self._wal).st_size
        except OSError:
            return 0

    def _checkpoint(self) -> None:
        """The WAL checkpoint the pacer says is due, now that the batch has its answers."""
        assert self._pacer is not None
        try:
            frames = checkpoints.passive_checkpoint(self.store)
        except self.store.dialect.Error as exc:
            # The batches themselves go on (a failing disk fails their COMMITs
            # and says so); SQLite's own checkpoint remains as the backstop.
            frames = -1
            now = time.monotonic()
            if now - self._checkpoint_failed_at >= 60.0:
                self._checkpoint_failed_at = now
                log.warning("wal_checkpoint_failed", error=str(self.store.dialect.storage_error(exc)))
        self._pacer.checkpointed(frames)

    def _in_savepoint(self, conn: Any, name: str,  # noqa: ANN401 - the dialect's connection
                      fn: Callable[[SqliteStore], Any]) -> tuple[bool, Any]:
        """``fn(store)`` in a savepoint: (True, result), or (False, error) with its work undone."""
        store = self.store
        dialect = store.dialect
        try:
            dialect.savepoint(conn, name)
            result = fn(store)
            dialect.release(conn, name)
        except Exception as exc:
            dialect.rollback_to(conn, name)
            if isinstance(exc, dialect.Error):
                exc = dialect.storage_error(exc)
            if isinstance(exc, StorageError) and not dialect.in_transaction(conn):
                # The whole transaction is gone (SQLite rolled it back after
                # a disk I/O error; the server connection was lost): nothing
                # of this batch is committed.
                raise _TransactionLost(exc) from exc
            return False, exc
        return True, result

    def _run_late(self, conn: Any, batch: list[_AnyJob],  # noqa: ANN401 - the dialect's connection
                  *, plain: bool = False) -> float:
        """Run the non-intake jobs queued since the batch began in it too (see the module docstring).

        ``plain``: without a savepoint, as the rest of a plain batch; a
        failure raises and the whole batch is taken again the careful way.

        While jobs are announced (:meth:`expect`), wait for them up to
        ``hold`` seconds in all, and never longer than a batch's own work has
        been taking: a job that misses this commit waits about that long for
        the next. Intake groups taken meanwhile are carried, in order, to the
        next batch; a job passing one commits no later than it would have,
        and no caller waits on one job before submitting another to the same
        commit. Returns the seconds spent waiting.
        """
        deadline: float | None = None
        waited = 0.0
        while len(batch) < self.max_batch:
            try:
                if self._expected > 0 and self.hold > 0:
                    now = time.monotonic()
                    if deadline is None:
                        deadline = now + max(self.min_hold, min(self.hold, self._batch_seconds))
                    if deadline > now:
                        try:
                            job = self._jobs.get(timeout=deadline - now)
                        finally:
                            waited += time.monotonic() - now
                    else:
                        job = self._jobs.get_nowait()
                else:
                    job = self._jobs.get_nowait()
            except queue.Empty:
                return waited
            if not isinstance(job, _Job):
                self._carried.append(job)  # an intake group, or the stop marker: no more
                if not isinstance(job, _IntakeJob):
                    return waited
                continue
            batch.append(job)
            if plain:
                job.value = job.fn(self.store)
                job.ok = True
            else:
                job.ok, job.value = self._in_savepoint(conn, f"job{len(batch)}", job.fn)
        return waited

    def _run_intakes(self, conn: Any, jobs: list[_IntakeJob]) -> None:  # noqa: ANN401 - the dialect's connection
        """Every intake group of the batch at once; one by one only if that fails."""
        groups = [job.items for job in jobs]
        ok, value = self._in_savepoint(conn, "intake", lambda s: s.intake_groups(groups))
        if ok:
            for job, results in zip(jobs, value, strict=True):
                job.ok, job.value = True, results
            return
        for index, job in enumerate(jobs):
            job.ok, job.value = self._in_savepoint(conn, f"intake{index}", _one_group(job.items))

    def _answer(self, batch: list[_AnyJob], error: AgentError | None = None) -> None:
        """Answer every job not answered yet (all with ``error`` when given), one hop per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[_AnyJob]] = {}
        for job in batch:
            if job.answered:
                continue
            job.answered = True
            if error is not None:
                job.ok, job.value = False, error
            if isinstance(job, _IntakeJob):
                self.intake_failing = None if job.ok else (time.monotonic(), str(job.value))
            if isinstance(job, _Job) and job.future is not None:
                future = job.future
                if future.set_running_or_notify_cancel():
                    if job.ok:
                        future.set_result(job.value)
                    else:
                        future.set_exception(job.value)
            elif job.loop is not None:
                by_loop.setdefault(job.loop, []).append(job)
        for loop, jobs in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, jobs)
            except RuntimeError:
                pass  # the loop is closed: nobody waits for these any more

    def _fail_all(self, batch: list[_AnyJob], error: AgentError) -> None:
        # Callers first: a failing log stream (EPIPE, full disk) must not
        # leave them waiting.
        self._answer(batch, error)
        log.error("queue_commit_failed", error=str(error), jobs=len(batch))


class _TransactionLost(Exception):
    """The database ended the batch's transaction: every job of it fails with ``error``."""

    def __init__(self, error: StorageError) -> None:
        super().__init__(str(error))
        self.error = error


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
                conn = store.connection()  # a connection lost since the last read is opened again
                with store.dialect.guarded(conn):  # a server that froze fails the read, not hangs it
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

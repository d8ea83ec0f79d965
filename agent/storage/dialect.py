"""What a database backend must provide to run the queue: the ``Dialect`` seam.

The store (agent/storage/store_base.py and its parts) holds everything that
is the same on every backend — dedupe, seq, the fenced transitions, stats —
and asks its dialect for what differs: how a write transaction starts and
locks (SQLite's ``BEGIN IMMEDIATE``; PostgreSQL's ``BEGIN`` plus one
transaction-scoped lock), the clock the lease runs on (this host's, or the
database server's when several hosts share it), what a driver error means,
how a lost connection is opened again, and what ``queue stats`` says about
the database. Upserts, types and placeholders live in each dialect's SQL
files (``queue/<dialect>/``), under the same query names.

Two implementations: :class:`agent.storage.sqlite.SqliteDialect` and
:class:`agent.storage.postgres.PostgresDialect`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Protocol

from agent.errors import StorageError

__all__ = ["Dialect", "Failure", "TransactionBlocks"]


class Failure(enum.Enum):
    """What a driver error means for the caller, whatever the backend."""

    LOCKED = "locked"  # another writer held the lock past its timeout: try again
    DISK_FULL = "disk_full"
    READ_ONLY = "read_only"  # a read-only file, or a database that takes no writes (a standby)
    CONNECTION_LOST = "connection_lost"  # I/O error, file gone, server gone or restarted
    OTHER = "other"


class TransactionBlocks:
    """``write_transaction`` and ``nested`` from a dialect's own primitives: one definition for both.

    A dialect supplies ``begin_write``, ``commit``, ``rollback``, ``savepoint``,
    ``release`` and ``rollback_to``; how a block begins and ends is the same on
    every backend.
    """

    def begin_write(self, conn: Any) -> None:  # noqa: ANN401 - the driver's connection
        raise NotImplementedError

    def commit(self, conn: Any) -> None:  # noqa: ANN401
        raise NotImplementedError

    def rollback(self, conn: Any) -> None:  # noqa: ANN401
        raise NotImplementedError

    def savepoint(self, conn: Any, name: str) -> None:  # noqa: ANN401
        raise NotImplementedError

    def release(self, conn: Any, name: str) -> None:  # noqa: ANN401
        raise NotImplementedError

    def rollback_to(self, conn: Any, name: str) -> None:  # noqa: ANN401
        raise NotImplementedError

    @contextmanager
    def write_transaction(self, conn: Any) -> Iterator[None]:  # noqa: ANN401
        """One write transaction: begin, commit, or roll back on any exception.

        Driver errors come out as they are; the caller classifies them.
        """
        self.begin_write(conn)
        try:
            yield
        except BaseException:
            self.rollback(conn)
            raise
        try:
            self.commit(conn)
        except BaseException:
            self.rollback(conn)
            raise

    @contextmanager
    def nested(self, conn: Any, name: str) -> Iterator[None]:  # noqa: ANN401
        """A savepoint: all of the block or none of it, inside the caller's transaction."""
        self.savepoint(conn, name)
        try:
            yield
        except BaseException:
            self.rollback_to(conn, name)
            raise
        self.release(conn, name)


class Dialect(Protocol):
    """The backend-specific half of the queue (see the module docstring)."""

    @property
    def name(self) -> str:
        """The folder of this dialect's SQL under ``queue/`` (``sqlite``, ``postgresql``)."""

    @property
    def Error(self) -> type[Exception]:  # the DB-API name of the driver's base error
        """The exception every driver call may raise."""

    @property
    def row_factory(self) -> Any:  # noqa: ANN401 - the driver's row factory
        """Result rows readable by column name (agent/storage/rows.py builds dataclasses of them)."""

    @property
    def file_maintenance(self) -> bool:
        """Whether the SQLite file maintenance (free pages, WAL checkpoints, PRAGMA optimize)
        applies; a database server does its own."""

    # -- transactions ----------------------------------------------------------
    def begin_write(self, conn: Any) -> None: ...  # noqa: ANN401 - the driver's connection
    def commit(self, conn: Any) -> None: ...  # noqa: ANN401
    def rollback(self, conn: Any) -> None: ...  # noqa: ANN401
    def savepoint(self, conn: Any, name: str) -> None: ...  # noqa: ANN401
    def release(self, conn: Any, name: str) -> None: ...  # noqa: ANN401
    def rollback_to(self, conn: Any, name: str) -> None: ...  # noqa: ANN401
    def write_transaction(self, conn: Any) -> AbstractContextManager[None]: ...  # noqa: ANN401
    def nested(self, conn: Any, name: str) -> AbstractContextManager[None]: ...  # noqa: ANN401
    def read_only(self, conn: Any) -> None: ...  # noqa: ANN401
    def in_transaction(self, conn: Any) -> bool: ...  # noqa: ANN401
    def changes(self, conn: Any) -> int: ...  # noqa: ANN401

    # -- connections -------------------------------------------------------------
    def connection_usable(self, conn: Any) -> bool: ...  # noqa: ANN401
    def guarded(self, conn: Any) -> AbstractContextManager[None]: ...  # noqa: ANN401 - a read under a deadline
    def reconnect(self, conn: Any) -> Any: ...  # noqa: ANN401

    # -- clock, values, errors, stats --------------------------------------------
    def lease_now(self, conn: Any, clock: Callable[[], float]) -> float: ...  # noqa: ANN401
    def blob(self, value: bytes | memoryview) -> bytes: ...
    def classify(self, exc: BaseException) -> Failure: ...
    def is_locked(self, exc: BaseException) -> bool: ...
    def storage_error(self, exc: BaseException, prefix: str = "") -> StorageError: ...
    def db_stats(self, conn: Any, db_path: Path) -> dict[str, Any]: ...  # noqa: ANN401

"""What every part of the store shares: the connection, the named queries, the dialect.

``Store`` (agent/storage/store.py) is this base plus three parts split by
concern — intake, dispatch and lease, operator and stats. The same class
runs on SQLite and on PostgreSQL: what differs is its dialect
(agent/storage/dialect.py) and the dialect's SQL files. Its methods run
*inside* a transaction their caller opened: the writer thread groups many
into one commit; :meth:`StoreBase.transaction` is the one helper for
single-shot callers (operator commands, tests).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from agent.core.states import (
    IN_FLIGHT,
    LIVE,
    PURGEABLE,
    REDRIVABLE,
    RETAINED,
    SETTLED,
    Event,
    State,
)
from agent.storage.dialect import Dialect, Failure
from agent.storage.maintenance import Space
from agent.storage.rows import ResultRow, build
from agent.storage.sqlite import SqliteDialect

R = TypeVar("R")

#: Rows per multi-row statement (:meth:`StoreBase._run_multirow`): at 20 parameters a row at most,
#: far below either driver's limit on parameters, and a batch of any size in a few statements.
MULTIROW_ROWS = 100


#: The named query that implements each row transition, by the event it is.
#: tests/unit/test_states.py checks each one's ``WHERE … state`` guard equals
#: the event's sources and its ``SET state`` is among the event's targets.
TRANSITION_QUERIES: dict[str, Event] = {
    "claim": Event.CLAIM,
    "send": Event.SEND,
    "claim_and_send": Event.CLAIM_AND_SEND,
    "resend": Event.RESEND,
    "settle": Event.SETTLE,
    "requeue": Event.RETRY,
    "fail_live": Event.GIVE_UP,
    "recover_claimed": Event.RECOVER,
    "op_redrive_one": Event.REDRIVE,
    "op_redrive_batch": Event.REDRIVE,
    "op_set_aside": Event.SET_ASIDE,
}

#: The named queries that select or delete rows by a group of states, by the
#: group (agent/core/states.py); tests/unit/test_states.py checks the SQL's
#: ``state IN (…)`` equals it, and that no other query filters on a state literal.
GROUP_QUERIES: dict[str, frozenset[State]] = {
    "channel_head": frozenset(LIVE),
    "live_by_channel": frozenset(LIVE),
    "recent_failures": frozenset(REDRIVABLE),
    "purge_terminal_older_than": frozenset(RETAINED),
    "purge_oldest_terminal": frozenset(RETAINED),
    "op_settled_by_channel": frozenset(PURGEABLE),
    "op_count_purgeable": frozenset(PURGEABLE),
    "op_purge_batch": frozenset(PURGEABLE),
    "status_head": frozenset(LIVE),
    "status_last_settled": frozenset(SETTLED),
    "status_live_depth": frozenset(LIVE),
    "partition_heads": frozenset(LIVE),
    "partition_claimable": frozenset(LIVE),
    "partition_busy": IN_FLIGHT,
    "partition_unkeyed": frozenset(LIVE),
    "partition_paused": frozenset(LIVE),
    "partition_retrying": frozenset(LIVE),
    "claimed_ids": IN_FLIGHT,
    # its live half (the settled half names the live states only as "NOT IN")
    "count_by_state": frozenset(LIVE),
    "op_select_live_state": frozenset(LIVE),
    "op_count_live_state": frozenset(LIVE),
    "op_export_live_ids": frozenset(LIVE),
}


class StoreBase:
    """The connection, its queries and dialect, and the helpers every query goes through."""

    def __init__(
        self,
        conn: Any,  # noqa: ANN401 - the dialect's connection (sqlite3 or psycopg)
        queries: dict[str, str],
        *,
        db_path: Path,
        dedupe_window: float = 7 * 86400,
        retention: float = 30 * 86400,
        max_db_bytes: int = 0,
        min_free_disk_bytes: int = 0,
        clock: Callable[[], float] = time.time,
        dialect: Dialect | None = None,
    ) -> None:
        self.conn = conn
        self.q = queries
        self._multirow: dict[tuple[str, int], str] = {}
        self._key_secret: str | None = None  # OperatorQueries.key_hash_secret, once read
        self._own_secret: str | None = None  # its stand-in while the database has none
        self.db_path = db_path
        self.dedupe_window = dedupe_window
        self.retention = retention
        self.clock = clock
        self.dialect: Dialect = dialect if dialect is not None else SqliteDialect()
        #: Intake's room below the disk floor and the size cap (agent/storage/maintenance.py).
        self.space = Space(max_db_bytes=max_db_bytes, min_free_disk_bytes=min_free_disk_bytes)

    # -- transactions -------------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator[Any]:
        """One write transaction for single-shot callers; driver errors become StorageError.

        Yields the store itself. ``DatabaseLocked`` when another process held
        the write lock beyond ``busy_timeout``.
        """
        dialect = self.dialect
        try:
            self.begin_write()
        except dialect.Error as exc:
            raise dialect.storage_error(exc, "queue database error: ") from exc
        try:
            self.begin_batch()
            yield self
        except BaseException as exc:
            dialect.rollback(self.conn)
            if isinstance(exc, dialect.Error):
                raise dialect.storage_error(exc, "queue database error: ") from exc
            raise
        try:
            dialect.commit(self.conn)
        except dialect.Error as exc:
            dialect.rollback(self.conn)
            raise dialect.storage_error(exc, "queue database error: ") from exc

    def connection(self) -> Any:  # noqa: ANN401 - the dialect's connection
        """The connection, opened again first when the dialect lost it (a database server restart).

        Raises StorageError while the database cannot be reached (the dialect
        spaces its attempts out, so a caller gets that answer at once).
        """
        if not self.dialect.connection_usable(self.conn):
            self.conn = self.dialect.reconnect(self.conn)
        return self.conn

    def begin_write(self) -> Any:  # noqa: ANN401 - the dialect's connection
        """Start a write transaction on a working connection; that connection.

        A connection found lost only by this BEGIN (the server restarted since
        the last transaction) is opened again and the BEGIN tried once more:
        nothing had been done on it yet.
        """
        dialect = self.dialect
        conn = self.connection()
        try:
            dialect.begin_write(conn)
        except dialect.Error as exc:
            if dialect.classify(exc) is not Failure.CONNECTION_LOST or dialect.connection_usable(conn):
                raise
            conn = self.connection()
            dialect.begin_write(conn)
        return conn

    def begin_batch(self) -> None:
        """A commit batch starts (after BEGIN): the next intake measures the disk afresh."""
        self.space.begin_batch()

    def close(self) -> None:
        """Close the connection (None: a database server never reached); never raises."""
        if self.conn is None:
            return
        try:
            self.conn.close()
        except self.dialect.Error:
            pass

    # -- running named queries ------------------------------------------------

    def _exec(self, name: str, **params: Any) -> Any:  # noqa: ANN401 - the driver's cursor
        return self.conn.execute(self.q[name], params)

    def _multirow_sql(self, name: str, n: int) -> str:
        """Query ``name`` for ``n`` rows: ``{rows}`` replaced by ``n`` copies of query ``name_row``.

        One statement for a batch's rows is one step of the database (one
        release of the GIL, one server round trip) where ``executemany`` takes
        one per row. The texts are cached per size; the drivers cache their
        prepared statements by text.
        """
        key = (name, n)
        sql = self._multirow.get(key)
        if sql is None:
            sql = self.q[name].replace("{rows}", ", ".join([self.q[name + "_row"]] * n))
            self._multirow[key] = sql
        return sql

    def _multirow_statements(self, name: str, rows: Sequence[Sequence[Any]], tail: Sequence[Any] = (),
                             head: Sequence[Any] = ()) -> Iterator[tuple[str, list[Any]]]:
        """(sql, parameters) of query ``name`` for ``rows``, at most ``MULTIROW_ROWS`` rows a statement.

        Parameters are positional: ``head``, the rows' in order, ``tail``.
        """
        for start in range(0, len(rows), MULTIROW_ROWS):
            chunk = rows[start : start + MULTIROW_ROWS]
            params = list(head)
            params.extend(value for row in chunk for value in row)
            params.extend(tail)
            yield self._multirow_sql(name, len(chunk)), params

    def _run_multirow(self, name: str, rows: Sequence[Sequence[Any]], tail: Sequence[Any] = (),
                      head: Sequence[Any] = ()) -> int:
        """Query ``name`` for ``rows`` (see :meth:`_multirow_statements`): rows written."""
        return sum(int(self.conn.execute(sql, params).rowcount)
                   for sql, params in self._multirow_statements(name, rows, tail, head))

    def _fetch_multirow(self, name: str, rows: Sequence[Sequence[Any]], tail: Sequence[Any] = ()) -> list[ResultRow]:
        """The rows query ``name`` returns for ``rows`` (see :meth:`_multirow_statements`), by column name."""
        found: list[ResultRow] = []
        for sql, params in self._multirow_statements(name, rows, tail):
            cur = self.conn.cursor()
            cur.row_factory = self.dialect.row_factory
            found.extend(cur.execute(sql, params).fetchall())
        return found

    def _scalar(self, name: str, **params: Any) -> Any:  # noqa: ANN401 - one column of any type
        """The first column of the first row, or None when there is no row."""
        found = self.conn.execute(self.q[name], params).fetchone()
        return None if found is None else found[0]

    def _fetch_one(self, name: str, **params: Any) -> ResultRow | None:
        cur = self.conn.cursor()
        cur.row_factory = self.dialect.row_factory
        found: ResultRow | None = cur.execute(self.q[name], params).fetchone()
        return found

    def _fetch_all(self, name: str, **params: Any) -> list[ResultRow]:
        cur = self.conn.cursor()
        cur.row_factory = self.dialect.row_factory
        found: list[ResultRow] = cur.execute(self.q[name], params).fetchall()
        return found

    def _row(self, cls: type[R], name: str, **params: Any) -> R | None:
        """One row of query ``name`` as ``cls``, built by column name."""
        found = self._fetch_one(name, **params)
        return None if found is None else build(cls, found)

    def _rows(self, cls: type[R], name: str, **params: Any) -> list[R]:
        return [build(cls, r) for r in self._fetch_all(name, **params)]

    @staticmethod
    def _query_for(event: Event, name: str) -> str:
        """``name``, after checking it is the query that implements ``event``."""
        if TRANSITION_QUERIES.get(name) is not event:
            raise AssertionError(f"query {name} does not implement {event.name}")
        return name

    def _lease_now(self) -> float:
        """The time the lease is measured on (the dialect's clock)."""
        return self.dialect.lease_now(self.conn, self.clock)

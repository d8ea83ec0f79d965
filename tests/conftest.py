"""Fixtures shared by every test directory: a real PostgreSQL server for the second queue backend.

The cluster (tests/pgserver.py: initdb/pg_ctl as an unprivileged user,
loopback only) starts once per session, the first time a test asks for it,
so a run that touches no PostgreSQL test never starts one. Each test gets a
schema of its own in a shared database (``pg_database``), or a database of
its own (``pg_own_database``), dropped afterwards. Without the server binaries or
psycopg the PostgreSQL tests fail saying what to install (``.ci/run``
installs both), rather than passing by skipping.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import pytest
from pgserver import PgDatabase, PostgresServer, unavailable_reason


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    """The session's PostgreSQL server (started on first use, destroyed at the end)."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.fail(f"the PostgreSQL backend's tests need a PostgreSQL server: {reason}")
    server = PostgresServer()
    try:
        server.start()
        yield server
    finally:
        server.destroy()


_schemas = itertools.count(1)


@pytest.fixture(scope="session")
def _pg_shared_database(pg_server: PostgresServer) -> str:
    """One database for the tests that need only a schema of their own (creating a database
    per test costs about a second with fsync on)."""
    return pg_server.fresh_database("shared")


@pytest.fixture
def pg_database(pg_server: PostgresServer, _pg_shared_database: str) -> Iterator[PgDatabase]:
    """A fresh, empty schema for this test (the agent's tables go there); dropped afterwards."""
    if not pg_server.running:  # a test that stopped the server failed before starting it again
        pg_server.start()
    schema = f"t{next(_schemas)}"
    with pg_server.connect(_pg_shared_database) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    try:
        yield PgDatabase(pg_server, _pg_shared_database, schema)
    finally:
        if not pg_server.running:
            pg_server.start()
        with contextlib.suppress(Exception), pg_server.connect(_pg_shared_database) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture
def pg_own_database(pg_server: PostgresServer) -> Iterator[PgDatabase]:
    """A whole database for this test alone (for settings made per database); dropped afterwards."""
    if not pg_server.running:
        pg_server.start()
    name = pg_server.fresh_database()
    try:
        yield PgDatabase(pg_server, name)
    finally:
        if not pg_server.running:
            pg_server.start()
        with contextlib.suppress(Exception), pg_server.connect() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

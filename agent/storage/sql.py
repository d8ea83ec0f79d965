"""Loading the queue's SQL: named queries and migrations, one folder per dialect.

SQL is data (procrastinate's layout): ``queue/<dialect>/migrations/NNNN_*.sql``
and ``queue/<dialect>/*.sql`` with ``-- name: x`` blocks, shipped as the package
data ``agent._sql`` through the committed symlink ``agent/_sql -> ../queue``.
Two dialects: ``sqlite/`` and ``postgresql/``, defining the same query names
(tests/unit/test_dialect_queries.py checks it).
"""

from __future__ import annotations

import re
from importlib import resources
from importlib.resources.abc import Traversable

#: The dialects, by the name of their folder.
SQLITE = "sqlite"
POSTGRESQL = "postgresql"

_NAME_LINE = re.compile(r"^--\s*name:\s*([a-z0-9_]+)\s*$", re.MULTILINE)
_MIGRATION_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")


def sql_root(dialect: str = SQLITE) -> Traversable:
    """The folder holding ``dialect``'s SQL (``queue/<dialect>`` in the source tree)."""
    return resources.files("agent._sql") / dialect


def load_queries(dialect: str = SQLITE) -> dict[str, str]:
    """Named queries from every ``queue/<dialect>/*.sql``: each block starts with ``-- name: x``."""
    queries: dict[str, str] = {}
    root = sql_root(dialect)
    files = sorted((e for e in root.iterdir() if e.name.endswith(".sql")), key=lambda e: e.name)
    for entry in files:
        parts = _NAME_LINE.split(entry.read_text(encoding="utf-8"))
        # parts = [preamble, name1, body1, name2, body2, ...]
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            if name in queries:
                raise RuntimeError(f"{entry.name} defines query {name!r} a second time")
            queries[name] = body.strip()
    return queries


def load_migrations(dialect: str = SQLITE) -> list[tuple[int, str]]:
    """(version, sql) for every migration file of ``dialect``, in order."""
    found: list[tuple[int, str]] = []
    for entry in (sql_root(dialect) / "migrations").iterdir():
        match = _MIGRATION_NAME.match(entry.name)
        if match:
            found.append((int(match.group(1)), entry.read_text(encoding="utf-8")))
    found.sort()
    return found

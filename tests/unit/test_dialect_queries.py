"""Both dialects' SQL: the same named queries, parameters, guards and schema rules (docs/queue.md).

The store runs one set of query names on either backend, so each name must
exist in ``queue/sqlite/`` and ``queue/postgresql/`` alike, take the same
parameters, and guard (``WHERE … state``) and set (``SET state = …``) the same
states; tests/unit/test_states.py checks SQLite's against the event table, so
equal guards here carry that check over to PostgreSQL. Pure file reading: no
database is opened.
"""

from __future__ import annotations

import re

import pytest

from agent.core import states
from agent.storage.sql import POSTGRESQL, SQLITE, load_migrations, load_queries

SQLITE_PARAM = re.compile(r"(?<![:\w]):([a-z0-9_]+)\b")
PG_PARAM = re.compile(r"%\(([a-z0-9_]+)\)s")
#: Positional placeholders (the multi-row queries: agent/storage/store_base.py, _multirow_sql).
SQLITE_POSITIONAL = re.compile(r"\?")
PG_POSITIONAL = re.compile(r"%s")


def without_comments(raw: str) -> str:
    return "\n".join(line for line in raw.splitlines() if not line.lstrip().startswith("--"))


def params(dialect: str, sql: str) -> set[str]:
    pattern = SQLITE_PARAM if dialect == SQLITE else PG_PARAM
    return set(pattern.findall(without_comments(sql)))


def guards(sql: str) -> tuple[set[str], set[str]]:
    """(states a WHERE names, states a SET assigns) — parameters written as one placeholder."""
    sql = PG_PARAM.sub(r":\1", without_comments(sql))
    where = sql[sql.index("WHERE"):] if "WHERE" in sql else ""
    guarded = set(re.findall(r"\bstate = '([a-z]+)'", where))
    for listed in re.findall(r"\bstate IN \(([^)]*)\)", where):
        guarded.update(re.findall(r"'([a-z]+)'", listed))
    assigned = set(re.findall(r"SET state = '([a-z]+)'", sql))
    return guarded, assigned


SQLITE_QUERIES = load_queries(SQLITE)
PG_QUERIES = load_queries(POSTGRESQL)


class TestSameQueries:
    def test_both_dialects_define_the_same_names(self) -> None:
        """Every named query exists in both folders: a store method cannot miss one on either backend."""
        assert set(PG_QUERIES) == set(SQLITE_QUERIES)

    @pytest.mark.parametrize("name", sorted(SQLITE_QUERIES))
    def test_same_parameters(self, name: str) -> None:
        """The store passes one set of parameters per query: each dialect's SQL uses exactly it."""
        assert params(POSTGRESQL, PG_QUERIES[name]) == params(SQLITE, SQLITE_QUERIES[name])

    @pytest.mark.parametrize("name", sorted(SQLITE_QUERIES))
    def test_same_state_guards_and_targets(self, name: str) -> None:
        """WHERE … state and SET state = … name the same states in both dialects."""
        assert guards(PG_QUERIES[name]) == guards(SQLITE_QUERIES[name])

    def test_the_fence_is_in_every_dispatch_write(self) -> None:
        """Each fenced transition checks the lease holder and epoch in its own statement, on PostgreSQL too."""
        for name in ("claim", "send", "claim_and_send", "resend", "settle", "requeue", "fail_live",
                     "recover_claimed"):
            sql = without_comments(PG_QUERIES[name])
            assert "EXISTS (SELECT 1 FROM lease WHERE name = 'dispatch' AND holder = %(holder)s " \
                   "AND epoch = %(epoch)s)" in sql, name

    def test_no_percent_sign_outside_placeholders(self) -> None:
        """psycopg reads every % as a placeholder (comments included): a stray one breaks the query."""
        for name, sql in PG_QUERIES.items():
            assert "%" not in PG_POSITIONAL.sub("", PG_PARAM.sub("", sql)), name

    @pytest.mark.parametrize("name", sorted(SQLITE_QUERIES))
    def test_same_positional_parameters(self, name: str) -> None:
        """A query bound by position takes as many values in both dialects (and none is named too)."""
        lite = len(SQLITE_POSITIONAL.findall(without_comments(SQLITE_QUERIES[name])))
        assert len(PG_POSITIONAL.findall(without_comments(PG_QUERIES[name]))) == lite
        if lite:
            assert not params(SQLITE, SQLITE_QUERIES[name]), name


class TestSchema:
    @staticmethod
    def schema(dialect: str) -> str:
        return "\n".join(sql for _n, sql in load_migrations(dialect))

    def check_list(self, dialect: str, column: str) -> set[str]:
        match = re.search(rf"\b{column}\b[^,]*?CHECK \({column} IN\s*\(([^)]*)\)\)", self.schema(dialect),
                          re.DOTALL)
        assert match, f"no CHECK on {column}"
        return set(re.findall(r"'([a-z_]+)'", match.group(1)))

    @pytest.mark.parametrize("dialect", [SQLITE, POSTGRESQL])
    def test_state_checks_equal_the_frozen_set(self, dialect: str) -> None:
        """messages.state and ack_outcome CHECKs hold exactly agent.core.states' sets, in both schemas."""
        assert self.check_list(dialect, "state") == set(states.ALL)
        assert self.check_list(dialect, "ack_outcome") == set(states.ACK_OUTCOMES)

    def test_same_migration_numbers(self) -> None:
        """Schema versions mean the same step on both backends."""
        assert [n for n, _ in load_migrations(POSTGRESQL)] == [n for n, _ in load_migrations(SQLITE)]

    def test_same_tables_and_columns(self) -> None:
        """The tables and their columns match (PostgreSQL adds only rowid, SQLite's implicit one)."""

        def columns(dialect: str) -> dict[str, set[str]]:
            found: dict[str, set[str]] = {}
            for table, body in re.findall(r"CREATE TABLE (\w+) \((.*?)\n\)", self.schema(dialect), re.DOTALL):
                names = {m.group(1) for m in re.finditer(r"^\s+([a-z_]+)\s+[A-Za-z]", body, re.MULTILINE)}
                found[table] = names - {"PRIMARY", "CHECK"}
            return found

        pg = columns(POSTGRESQL)
        pg["messages"].discard("rowid")
        assert pg == columns(SQLITE)

    def test_live_head_index_covers_the_live_group(self) -> None:
        """The partial index the channel head uses is on exactly the live states, on PostgreSQL too."""
        index = re.search(r"CREATE INDEX messages_live_head .*?;", self.schema(POSTGRESQL), re.DOTALL)
        assert index is not None
        assert guards(index.group(0))[0] == states.LIVE

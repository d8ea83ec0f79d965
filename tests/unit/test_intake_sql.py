"""Intake's one-statement-per-batch SQL: positional parameters in the order the store binds them.

agent/storage/store_intake.py binds a batch's rows positionally (one
multi-row statement per kind, agent/storage/store_base.py: _multirow_sql), so
a column added to, dropped from or moved in the SQL of either dialect must
fail here rather than shift a value into the wrong column.
"""

from __future__ import annotations

import re

import pytest

from agent.storage.sql import POSTGRESQL, SQLITE, load_queries
from agent.storage.store_intake import DEDUPE_COLUMNS, INTAKE_COLUMNS

#: Query -> (the store's column order for its row's parameters, columns the row sets to a constant).
MULTIROW_INSERTS = {
    "insert_messages": (INTAKE_COLUMNS, {"attempts": "0", "next_attempt_at": "0"}),
    "dedupe_insert_keys": (DEDUPE_COLUMNS, {"app_ack": "NULL"}),
}
PLACEHOLDER = {SQLITE: "?", POSTGRESQL: "%s"}


def columns_and_values(queries: dict[str, str], name: str) -> list[tuple[str, str]]:
    """(column, the row's value for it) for a multi-row INSERT, in order."""
    head = re.search(r"INSERT INTO \w+ \(([^)]*)\)\s*VALUES \{rows\}", queries[name])
    assert head is not None, queries[name]
    columns = [c.strip() for c in head.group(1).split(",")]
    row = queries[f"{name}_row"].strip()
    assert row.startswith("(") and row.endswith(")"), row
    values = [v.strip() for v in row[1:-1].split(",")]
    assert len(columns) == len(values), (columns, values)
    return list(zip(columns, values, strict=True))


@pytest.mark.parametrize("dialect", [SQLITE, POSTGRESQL])
@pytest.mark.parametrize("name", sorted(MULTIROW_INSERTS))
def test_row_parameters_follow_the_stores_column_order(dialect: str, name: str) -> None:
    order, constants = MULTIROW_INSERTS[name]
    pairs = columns_and_values(load_queries(dialect), name)
    bound = [column for column, value in pairs if value == PLACEHOLDER[dialect]]
    assert tuple(bound) == order
    assert {column: value for column, value in pairs if value != PLACEHOLDER[dialect]} == constants


@pytest.mark.parametrize("dialect", [SQLITE, POSTGRESQL])
def test_each_multirow_query_has_one_rows_marker_and_a_row(dialect: str) -> None:
    queries = load_queries(dialect)
    multirow = {name for name, sql in queries.items() if "{rows}" in sql}
    assert multirow == {"insert_messages", "dedupe_insert_keys", "dedupe_lookup_keys", "set_ack_outcomes"}
    for name in multirow:
        assert queries[name].count("{rows}") == 1 and f"{name}_row" in queries

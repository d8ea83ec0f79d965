"""The store is the one SQL gateway, and the state module the one place that names a state.

Both by reading the source (``ast``, so comments and docstrings do not count):
no string literal outside ``agent/storage/`` holds SQL, nothing outside it
imports ``sqlite3``, and no module but ``agent/core/states.py`` spells a row
state or ack outcome as a string (they use its members).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from agent.core.states import AckOutcome, State

AGENT = Path(__file__).resolve().parents[2] / "agent"
STORAGE = AGENT / "storage"

#: SQL as this code base writes it: upper-case keywords in their statement shapes.
SQL = re.compile(
    r"\bSELECT\b.*\bFROM\b|\bINSERT\s+INTO\b|\bUPDATE\s+\w+\s+SET\b|\bDELETE\s+FROM\b"
    r"|\bCREATE\s+(?:TABLE|INDEX|UNIQUE)\b|\bPRAGMA\s+\w+|\bBEGIN(?:\s+IMMEDIATE)?\s*$"
    r"|^\s*(?:COMMIT|ROLLBACK|SAVEPOINT|RELEASE)\b|\bWHERE\s+\w+\s*(?:=|IN\b)",
    re.DOTALL | re.MULTILINE,
)

#: The one module that spells the states; every other module under agent/ uses its members.
STATE_MODULE = AGENT / "core" / "states.py"
STATE_NAMES = {s.value for s in State} | {o.value for o in AckOutcome}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the Constant nodes that are docstrings."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def string_literals(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string literal in ``path`` but docstrings; an f-string as one text."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    skip = _docstrings(tree)
    out: list[tuple[int, str]] = []
    inside_fstring: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            parts = []
            for value in node.values:
                inside_fstring.add(id(value))
                parts.append(value.value if isinstance(value, ast.Constant) else "{}")
            out.append((node.lineno, "".join(str(p) for p in parts)))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in skip and id(node) not in inside_fstring):
            out.append((node.lineno, node.value))
    return out


def python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


#: Every module of the tree but the state module (new modules are covered without a list).
STATE_CLEAN = [p for p in python_files(AGENT) if p != STATE_MODULE]


class TestOneSqlGateway:
    def test_the_pattern_finds_sql(self) -> None:
        """The detector itself: each statement shape the store uses is caught, prose is not."""
        for sql in ("SELECT id FROM messages", "INSERT INTO meta (key) VALUES (?)",
                    "UPDATE messages SET state = ?", "DELETE FROM messages WHERE id = ?",
                    "PRAGMA optimize", "BEGIN IMMEDIATE", "COMMIT", "ROLLBACK TO job1",
                    "CREATE TABLE t (x)", "x FROM messages WHERE state IN ('queued')"):
            assert SQL.search(sql), sql
        for prose in ("select the rows from the queue", "update the lease", "begin again",
                      "the queue database is locked"):
            assert not SQL.search(prose), prose

    def test_no_sql_outside_storage(self) -> None:
        """No string literal outside agent/storage/ holds SQL: every query is a store method."""
        offenders = [
            f"{path.relative_to(AGENT.parent)}:{line}: {text[:60]!r}"
            for path in python_files(AGENT) if STORAGE not in path.parents
            for line, text in string_literals(path) if SQL.search(text)
        ]
        assert offenders == []

    def test_no_sqlite3_outside_storage(self) -> None:
        """Only agent/storage/ imports the database driver."""
        offenders = []
        for path in python_files(AGENT):
            if STORAGE in path.parents:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(n.split(".")[0] == "sqlite3" for n in names):
                    offenders.append(f"{path.relative_to(AGENT.parent)}:{node.lineno}")  # type: ignore[attr-defined]
        assert offenders == []


class TestStatesByName:
    @pytest.mark.parametrize("path", STATE_CLEAN, ids=lambda p: str(p.relative_to(AGENT.parent)))
    def test_no_state_literal(self, path: Path) -> None:
        """The module names row states and ack outcomes through agent.core.states, never as a string."""
        offenders = [(line, text) for line, text in string_literals(path) if text in STATE_NAMES]
        assert offenders == []

    def test_every_module_is_checked(self) -> None:
        """The list is the whole tree, so a new module cannot slip past the rule."""
        assert len(STATE_CLEAN) == len(python_files(AGENT)) - 1
        assert {AGENT / "runtime" / "metrics.py", AGENT / "core" / "protocol.py",
                AGENT / "runtime" / "dispatcher.py", AGENT / "runtime" / "mllp_server.py"} <= set(STATE_CLEAN)

    def test_the_check_sees_a_literal(self, tmp_path: Path) -> None:
        """The detector itself: a bare state string is caught, a docstring and prose are not."""
        sample = tmp_path / "sample.py"
        sample.write_text('"""queued."""\nA = "queued"\nB = "a queued row"\nC = f"{A}"\n')
        assert [t for _, t in string_literals(sample) if t in STATE_NAMES] == ["queued"]

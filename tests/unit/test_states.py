"""The frozen state set and its event table, against the schema and the SQL that moves rows (docs/queue.md#transitions)."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import pytest

from agent.core import states
from agent.core.states import Event
from agent.storage import sqlite as db
from agent.storage.store_base import GROUP_QUERIES, TRANSITION_QUERIES


def schema_sql() -> str:
    return "\n".join(sql for _number, sql in db.load_migrations())


def check_list(column: str) -> set[str]:
    """The values of ``CHECK (<column> IN (...))`` in the migrations."""
    match = re.search(rf"\b{column}\b[^,]*?CHECK \({column} IN\s*\(([^)]*)\)\)", schema_sql(), re.DOTALL)
    assert match, f"no CHECK on {column}"
    return set(re.findall(r"'([a-z_]+)'", match.group(1)))


def without_comments(raw: str) -> str:
    return "\n".join(line for line in raw.splitlines() if not line.lstrip().startswith("--"))


def guarded_states(sql: str) -> set[str]:
    """The state literals of a query's ``WHERE`` (``state = 'x'``, ``state IN ('x', …)``)."""
    if "WHERE" not in sql:
        return set()
    where = sql[sql.index("WHERE"):]
    found: set[str] = set(re.findall(r"\bstate = '([a-z]+)'", where))
    for listed in re.findall(r"\bstate IN \(([^)]*)\)", where):
        found.update(re.findall(r"'([a-z]+)'", listed))
    return found


def state_updates() -> dict[str, tuple[set[str], set[str]]]:
    """Named queries that set ``state``: name -> (target states, guarded source states)."""
    found: dict[str, tuple[set[str], set[str]]] = {}
    for name, raw in db.load_queries().items():
        sql = without_comments(raw)
        if not re.match(r"\s*UPDATE messages\b", sql):
            continue
        target = re.search(r"SET state = (?:'([a-z]+)'|:state)", sql)
        if target is None:
            continue
        targets = {target.group(1)} if target.group(1) else set()
        found[name] = (targets, guarded_states(sql))
    return found


class TestStateSet:
    def test_schema_check_equals_the_frozen_set(self) -> None:
        """The messages.state CHECK holds exactly agent.core.states.ALL."""
        assert check_list("state") == set(states.ALL)

    def test_ack_outcome_check_equals_the_code(self) -> None:
        """The messages.ack_outcome CHECK holds exactly agent.core.states.ACK_OUTCOMES."""
        assert check_list("ack_outcome") == set(states.ACK_OUTCOMES)

    def test_database_refuses_an_unknown_state(self, tmp_path: Path) -> None:
        """An INSERT with a state outside the set fails in SQLite itself."""
        conn = db.open_database(tmp_path / "q.db", "states-test", db.DatabaseOptions(), 0.0)
        try:
            with pytest.raises(sqlite3.IntegrityError):
                conn.execute(
                    "INSERT INTO messages (id, channel, state, remote, body, body_sha256, received_at, updated_at)"
                    " VALUES ('x', 'adt', 'lost', 'r', x'00', 'h', 0, 0)"
                )
        finally:
            conn.close()

    def test_the_set_is_the_specs_and_frozen(self) -> None:
        """The seven SPEC 6 states, in lifecycle order, with live and settled groups disjoint."""
        assert states.ALL == ("queued", "claimed", "inflight", "processed", "rejected", "failed", "nacked")
        assert {"queued", "claimed", "inflight"} == states.LIVE
        assert {"processed", "rejected", "failed"} == states.SETTLED
        assert not states.LIVE & states.SETTLED


class TestTransitions:
    def test_table_covers_every_state_and_only_known_ones(self) -> None:
        """Every state has an entry, and every target is a known state."""
        assert set(states.TRANSITIONS) == set(states.ALL)
        for targets in states.TRANSITIONS.values():
            assert targets <= set(states.ALL)

    @pytest.mark.parametrize(
        ("old", "new"),
        [("queued", "claimed"), ("claimed", "inflight"), ("claimed", "queued"), ("inflight", "processed"),
         ("inflight", "rejected"), ("inflight", "failed"), ("inflight", "queued"), ("inflight", "inflight"),
         ("failed", "queued"), ("rejected", "queued"), ("queued", "failed"), ("queued", "rejected"),
         ("queued", "inflight")],
    )
    def test_legal_moves(self, old: str, new: str) -> None:
        """The moves docs/queue.md describes are in the table, each by a named event."""
        assert new in states.TRANSITIONS[states.State(old)]
        assert any(old in e.sources and new in e.targets for e in states.Event)

    @pytest.mark.parametrize(
        ("old", "new"),
        [("queued", "processed"), ("processed", "queued"), ("nacked", "queued"),
         ("claimed", "processed"), ("processed", "failed"), ("queued", "nacked"), ("inflight", "nacked"),
         ("bogus", "queued")],
    )
    def test_illegal_moves_are_in_no_event(self, old: str, new: str) -> None:
        """Anything else is in no event of the table (the store's guarded SQL refuses it)."""
        assert not any(old in e.sources and new in e.targets for e in states.Event)

    def test_nacked_and_processed_are_final(self) -> None:
        """Audit rows and processed rows never move; nothing moves into nacked (it is only inserted)."""
        assert states.TRANSITIONS["nacked"] == frozenset()
        assert states.TRANSITIONS["processed"] == frozenset()
        assert all("nacked" not in targets for targets in states.TRANSITIONS.values())

    def test_only_operator_redrive_leaves_failed_or_rejected(self) -> None:
        """failed and rejected go back to queued only (operator re-drive), never straight to the server."""
        assert states.TRANSITIONS["failed"] == {"queued"}
        assert states.TRANSITIONS["rejected"] == {"queued"}


class TestSqlFollowsTheTable:
    def test_every_state_update_is_guarded(self) -> None:
        """Every named query that sets a state names the states it moves from (guarded UPDATE)."""
        updates = state_updates()
        assert updates, "no state-changing queries found"
        for name, (_targets, sources) in updates.items():
            assert sources, f"query {name} sets state without a state guard"
            assert sources <= set(states.ALL), (name, sources)

    def test_every_literal_move_is_in_the_table(self) -> None:
        """Each (guarded source, literal target) pair of the SQL is a legal transition."""
        for name, (targets, sources) in state_updates().items():
            for old in sources:
                for new in targets:
                    assert new in states.TRANSITIONS[old], f"query {name}: {old} -> {new} is not in TRANSITIONS"

    def test_parameterised_targets_are_legal_from_every_guarded_source(self) -> None:
        """settle (:state in SETTLED) and fail_live (:state failed/rejected) are legal from each state they guard on."""
        allowed_targets = {"settle": states.SETTLED, "fail_live": frozenset({"failed", "rejected"})}
        updates = state_updates()
        parameterised = {name for name, (targets, _sources) in updates.items() if not targets}
        assert parameterised == set(allowed_targets)
        for name in parameterised:
            for old in updates[name][1]:
                assert allowed_targets[name] <= states.TRANSITIONS[old], (name, old)

    def test_operator_redrive_queries_are_seen(self) -> None:
        """Both operator re-drive queries are checked too (comments before the UPDATE are skipped)."""
        updates = state_updates()
        for name in ("op_redrive_one", "op_redrive_batch", "op_set_aside", "claim", "send", "resend",
                     "requeue", "recover_claimed"):
            assert name in updates, name


class TestEachQueryIsItsEvent:
    """Every transition query is named after its event, and its guard is the event's sources."""

    def test_every_state_changing_query_names_its_event(self) -> None:
        """No UPDATE that sets a state exists without an entry in TRANSITION_QUERIES."""
        assert set(state_updates()) == set(TRANSITION_QUERIES)

    @pytest.mark.parametrize("name", sorted(TRANSITION_QUERIES))
    def test_guard_equals_the_events_sources(self, name: str) -> None:
        """The query's WHERE … state guard names exactly the states its event moves rows from."""
        _targets, sources = state_updates()[name]
        assert sources == TRANSITION_QUERIES[name].sources

    @pytest.mark.parametrize("name", sorted(TRANSITION_QUERIES))
    def test_target_is_one_of_the_events(self, name: str) -> None:
        """A literal SET state is among the event's targets; a :state parameter is checked by the store."""
        targets, _sources = state_updates()[name]
        assert targets <= TRANSITION_QUERIES[name].targets
        if not targets:  # settle and fail_live: the store refuses any state outside the event's targets
            assert name in ("settle", "fail_live")

    def test_every_event_that_moves_a_row_has_its_query(self) -> None:
        """Each event with sources is implemented by a query (the operator's set-aside included)."""
        moving = {e for e in Event if e.sources}
        assert set(TRANSITION_QUERIES.values()) == moving

    def test_the_store_refuses_a_query_under_another_event(self) -> None:
        """A transition run under the wrong event is our bug, caught before any SQL runs."""
        from agent.storage.store_base import StoreBase

        assert StoreBase._query_for(Event.CLAIM, "claim") == "claim"
        with pytest.raises(AssertionError, match="does not implement"):
            StoreBase._query_for(Event.SETTLE, "claim")


class TestStateGroupsInSql:
    """Queries that filter on several states use exactly a group of agent.core.states."""

    def test_every_state_filter_is_a_named_group(self) -> None:
        """Outside the transitions, each query with state literals in its WHERE is listed with its group."""
        filtering = {
            name for name, raw in db.load_queries().items()
            if name not in TRANSITION_QUERIES and guarded_states(without_comments(raw))
        }
        assert filtering == set(GROUP_QUERIES)

    @pytest.mark.parametrize("name", sorted(GROUP_QUERIES))
    def test_filter_equals_its_group(self, name: str) -> None:
        """The query's state IN (…) is the group, state for state."""
        assert guarded_states(without_comments(db.load_queries()[name])) == GROUP_QUERIES[name]

    def test_live_head_index_covers_the_live_group(self) -> None:
        """The partial index the channel head uses is on exactly the live states (else it goes unused)."""
        index = re.search(r"CREATE INDEX messages_live_head .*?;", schema_sql(), re.DOTALL)
        assert index is not None
        assert guarded_states(index.group(0)) == states.LIVE

    def test_the_settled_index_is_named_by_the_complement_of_live(self) -> None:
        """``state NOT IN (…)`` appears only as the settled index's condition: exactly the live states.

        The guard parser above reads ``state IN``/``state =`` only; this term
        may narrow a query to the rows that are no longer live and nothing
        else, so the index of those rows (SQLite uses a partial index only for
        a query that names its condition) can never hide a live row.
        """
        index = re.search(r"CREATE INDEX IF NOT EXISTS messages_settled_updated .*?;", schema_sql(), re.DOTALL)
        assert index is not None
        terms = re.findall(r"\bstate NOT IN \(([^)]*)\)", index.group(0))
        assert [set(re.findall(r"'([a-z]+)'", t)) for t in terms] == [states.LIVE]
        used = 0
        for name, raw in db.load_queries().items():
            for listed in re.findall(r"\bstate NOT IN \(([^)]*)\)", without_comments(raw)):
                assert set(re.findall(r"'([a-z]+)'", listed)) == states.LIVE, name
                used += 1
        assert used >= 10

"""Intake: queue a message (or find it a duplicate), keep an audit row, record ACK outcomes.

docs/queue.md#intake and #dedupe: a message is committed before its accept
ACK is sent; the dedupe key is (channel, MSH-3, MSH-4, MSH-10) and identical
bytes on a known key replay the original answer instead of queueing again.
Keys are checked against the table *and* within the transaction, so two
copies in one commit batch (or one group) make one row.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from agent.core.states import ACK_OUTCOMES, AckOutcome, Event, State
from agent.errors import StorageError
from agent.storage import maintenance
from agent.storage.row_ids import RowIds
from agent.storage.rows import AuditItem, IntakeItem, IntakeResult, ResultRow
from agent.storage.store_base import StoreBase

#: The ACK mode an audit row is stored with (it never gets an application ACK).
_AUDIT_ACK_MODE = "commit"
(_INTAKE_STATE,) = Event.INTAKE.targets
(_AUDIT_STATE,) = Event.AUDIT.targets


#: The columns of insert_messages_row's parameters, in order (positional: one statement binds
#: a whole batch; tests/unit/test_intake_sql.py holds this to the query's column list).
INTAKE_COLUMNS = (
    "id", "channel", "seq", "state", "remote", "sending_app", "sending_facility", "control_id",
    "message_type", "encoding", "body", "body_sha256", "ack_mode", "accept_ack_type",
    "application_ack_type", "ack_sent", "ack_outcome", "received_at", "updated_at", "partition_key",
)
#: The same for dedupe_insert_keys_row (app_ack is always NULL there).
DEDUPE_COLUMNS = (
    "channel", "sending_app", "sending_facility", "control_id", "body_sha256", "message_id", "ack_mode",
    "commit_ack", "expires_at",
)

#: A dedupe key: (channel, MSH-3, MSH-4, MSH-10).
DedupeKey = tuple[str, str, str, str]


@dataclass(slots=True)
class _Keyed:
    """An item with its dedupe key and body hash, computed once."""

    item: IntakeItem
    key: DedupeKey
    sha: str


@dataclass(slots=True)
class _New:
    """A message this run inserts: its row's id, and where its result goes."""

    keyed: _Keyed
    group: int
    index: int
    message_id: str = ""
    seq: int = 0


#: Where new rows' ids come from (agent/storage/row_ids.py: they grow, so the id index appends).
_ROW_IDS = RowIds()


class IntakeQueries(StoreBase):
    """The intake half of the store."""

    def intake(self, item: IntakeItem) -> IntakeResult:
        """Queue one message, or find it is a duplicate or a conflict (a group of one)."""
        return self.intake_groups(((item,),))[0][0]

    def intake_batch(self, items: Sequence[IntakeItem]) -> list[IntakeResult]:
        """Queue a group of messages all or none: one result per item, in order.

        Duplicates and conflicts (against the table or an earlier item of the
        group) are answered whatever the room; the new items are refused
        together (``backpressure``) when their total does not fit, and a
        failure while inserting rolls the whole group back.
        """
        if not items:
            return []
        with self.dialect.nested(self.conn, "intake_group"):
            return self.intake_groups((items,))[0]

    def intake_groups(self, groups: Sequence[Sequence[IntakeItem]]) -> list[list[IntakeResult]]:
        """Queue several groups at once (the writer's commit batch): per group, ``intake_batch``'s answer.

        The same answers as taking the groups one after another, in fewer
        statements: the run's keys are looked up in the table in one
        statement, against the earlier items of the run they are resolved
        here; each channel's seq advances once for the run; the rows and
        their dedupe keys are one statement per kind. All or nothing: a
        failure leaves the caller's savepoint to roll back (the writer then
        takes the groups one by one).
        """
        now = self.clock()
        keyed_groups = [[self._keyed(item) for item in items] for items in groups]
        live = self._live_keys(keyed_groups, now)
        taken: dict[DedupeKey, _New] = {}  # keys this run inserts
        inserts: list[_New] = []
        out: list[list[IntakeResult | None]] = []
        for g, keyed in enumerate(keyed_groups):
            results: list[IntakeResult | None] = [self._known(k, taken, live) for k in keyed]
            out.append(results)
            new = [i for i, r in enumerate(results) if r is None]
            if not new:
                continue
            cost = maintenance.group_cost(self, [self._cost_bytes(keyed[i].item) for i in new])
            if maintenance.over_limits(self, now, cost):
                for i in new:
                    results[i] = IntakeResult(outcome="backpressure", message_id="", ack_mode=keyed[i].item.ack_mode,
                                              refused_for=self.space.refused_for)
                continue
            for i in new:
                k = keyed[i]
                # An earlier item of this group may have the same key: answered from it.
                earlier = self._known(k, taken, None) if k.item.control_id else None
                if earlier is not None:
                    results[i] = earlier
                    continue
                entry = _New(k, g, i, self._new_id())
                inserts.append(entry)
                if k.item.control_id:
                    taken[k.key] = entry
        if inserts:
            self._insert_rows(inserts, now, out)
        return [[r for r in results if r is not None] for results in out]

    @staticmethod
    def _new_id() -> str:
        """A message's id: the transmit UUID (docs/protocol.md: fixed for life)."""
        return _ROW_IDS()

    @staticmethod
    def _keyed(item: IntakeItem) -> _Keyed:
        return _Keyed(item, (item.channel, item.sending_app, item.sending_facility, item.control_id),
                      hashlib.sha256(item.body).hexdigest())

    @staticmethod
    def _cost_bytes(item: IntakeItem) -> int:
        return len(item.body) + len(item.commit_ack or b"")

    def _live_keys(self, keyed_groups: list[list[_Keyed]], now: float) -> dict[DedupeKey, ResultRow]:
        """The table's live dedupe keys among the run's, by key (one search of the key each)."""
        keys = list(dict.fromkeys(k.key for keyed in keyed_groups for k in keyed if k.item.control_id))
        if not keys:
            return {}
        return {(r["channel"], r["sending_app"], r["sending_facility"], r["control_id"]): r
                for r in self._fetch_multirow("dedupe_lookup_keys", keys, (now,))}

    def _known(self, k: _Keyed, taken: dict[DedupeKey, _New],
               live: dict[DedupeKey, ResultRow] | None) -> IntakeResult | None:
        """The answer for a key this run inserts or the table knows (``live``; None: this run's only).

        A duplicate or a conflict; None for a new message.
        """
        if not k.item.control_id:
            return None
        first = taken.get(k.key)
        if first is not None:
            # As the table would answer once ``first`` is in it.
            if first.keyed.sha != k.sha:
                return IntakeResult(outcome="conflict", message_id=first.message_id, ack_mode=k.item.ack_mode)
            item = first.keyed.item
            return IntakeResult(outcome="duplicate", message_id=first.message_id, ack_mode=item.ack_mode,
                                commit_ack=item.commit_ack, prior_state=_INTAKE_STATE)
        prior = live.get(k.key) if live else None
        return None if prior is None else self._replay(k, prior)

    def _replay(self, k: _Keyed, prior: ResultRow) -> IntakeResult:
        """The table's answer for a known key: a duplicate (the original answer) or a conflict."""
        if prior["body_sha256"] != k.sha:
            return IntakeResult(outcome="conflict", message_id=prior["message_id"], ack_mode=k.item.ack_mode)
        app_ack = prior["app_ack"]
        row = self._fetch_one("dedupe_prior_row", id=prior["message_id"])
        if app_ack is None and row is not None:
            app_ack = row["app_ack"]
        return IntakeResult(
            outcome="duplicate",
            message_id=prior["message_id"],
            ack_mode=prior["ack_mode"],
            commit_ack=prior["commit_ack"],
            app_ack=app_ack,
            prior_state=State(row["state"]) if row is not None else None,
        )

    def _insert_rows(self, inserts: list[_New], now: float, out: list[list[IntakeResult | None]]) -> None:
        """Event.INTAKE for the run: ``queued`` rows with their channels' next seqs, and their dedupe keys."""
        per_channel: dict[str, list[_New]] = {}
        for entry in inserts:
            per_channel.setdefault(entry.keyed.item.channel, []).append(entry)
        for channel, entries in per_channel.items():
            # One advance per channel: the run's rows take the seqs up to it, in order.
            last = int(self._scalar("next_seqs", channel=channel, n=len(entries)))
            for offset, entry in enumerate(entries, start=last - len(entries) + 1):
                entry.seq = offset
        rows = []
        keys = []
        expires_at = now + self.dedupe_window
        pending = AckOutcome.PENDING
        for entry in inserts:
            k = entry.keyed
            item = k.item
            # INTAKE_COLUMNS' order.
            rows.append((entry.message_id, item.channel, entry.seq, _INTAKE_STATE, item.remote, item.sending_app,
                         item.sending_facility, item.control_id, item.message_type, item.encoding, item.body,
                         k.sha, item.ack_mode, item.accept_ack_type, item.application_ack_type,
                         item.commit_ack, pending, item.received_at, item.received_at, item.partition_key))
            if item.control_id:
                # DEDUPE_COLUMNS' order.
                keys.append((*k.key, k.sha, entry.message_id, item.ack_mode, item.commit_ack, expires_at))
            out[entry.group][entry.index] = IntakeResult(
                outcome="accepted", message_id=entry.message_id, seq=entry.seq, ack_mode=item.ack_mode)
        self._run_multirow("insert_messages", rows)
        # An expired key of the same name is replaced; a live one never is.
        if keys and self._run_multirow("dedupe_insert_keys", keys, (now,)) != len(keys):
            # A key's unique constraint met a live key the lookup did not
            # see (another process's intake): never a second row for it.
            raise StorageError("dedupe key taken by a concurrent intake; resend")

    def record_audit(self, item: AuditItem) -> str:
        """Event.AUDIT: insert a ``nacked`` audit row; it never counts as a dedupe prior.

        Audit rows are intake too: when purging cannot make room below the disk
        floor or at the size cap they are not kept (StorageError), so they never
        eat the reserve dispatch needs.
        """
        cost = maintenance.intake_cost(self, len(item.body) + len(item.ack_sent or b""))
        if maintenance.over_limits(self, self.clock(), cost):
            raise StorageError("audit row not kept: no room below the queue's disk and size limits")
        message_id = self._new_id()
        self._exec(
            "insert_message",
            id=message_id,
            channel=item.channel,
            seq=None,
            state=_AUDIT_STATE,
            remote=item.remote,
            sending_app=item.sending_app,
            sending_facility=item.sending_facility,
            control_id=item.control_id,
            message_type=item.message_type,
            encoding=None,
            body=item.body,
            body_sha256=hashlib.sha256(item.body).hexdigest(),
            ack_mode=_AUDIT_ACK_MODE,
            accept_ack_type="",
            application_ack_type="",
            ack_sent=item.ack_sent,
            ack_outcome=AckOutcome.DELIVERED if item.ack_sent else AckOutcome.NOT_OWED,
            error_code=item.error_code,
            error_text=item.error_text,
            now=item.received_at,
            partition_key=None,
        )
        return message_id

    def set_ack_outcome(self, message_id: str, outcome: str) -> bool:
        """Whether the source got its final ACK (docs/queue.md#ack-outcome); True when it changed."""
        if outcome not in ACK_OUTCOMES:
            raise ValueError(f"unknown ack_outcome {outcome!r}")
        return int(self._exec("set_ack_outcome", id=message_id, outcome=outcome).rowcount) == 1

    def set_ack_outcomes(self, pairs: Sequence[tuple[str, str]]) -> int:
        """``set_ack_outcome`` for many rows, one statement per outcome (the writer's batch); rows changed."""
        for _message_id, outcome in pairs:
            if outcome not in ACK_OUTCOMES:
                raise ValueError(f"unknown ack_outcome {outcome!r}")
        # A row named twice ends with its last outcome, as if each were set in turn.
        by_outcome: dict[str, list[tuple[str]]] = {}
        for message_id, outcome in dict(pairs).items():
            by_outcome.setdefault(outcome, []).append((message_id,))
        return sum(self._run_multirow("set_ack_outcomes", ids, (outcome,), (outcome,))
                   for outcome, ids in by_outcome.items())

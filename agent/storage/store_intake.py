"""Intake: queue a message (or find it a duplicate), keep an audit row, record ACK outcomes.

docs/queue.md#intake and #dedupe: a message is committed before its accept
ACK is sent; the dedupe key is (channel, MSH-3, MSH-4, MSH-10) and identical
bytes on a known key replay the original answer instead of queueing again.
Keys are checked against the table *and* within the transaction, so two
copies in one commit batch (or one group) make one row.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from agent.core.states import ACK_OUTCOMES, AckOutcome, Event, State
from agent.errors import StorageError
from agent.storage import maintenance
from agent.storage.rows import AuditItem, IntakeItem, IntakeResult
from agent.storage.store_base import StoreBase

#: The ACK mode an audit row is stored with (it never gets an application ACK).
_AUDIT_ACK_MODE = "commit"
(_INTAKE_STATE,) = Event.INTAKE.targets
(_AUDIT_STATE,) = Event.AUDIT.targets


@dataclass(slots=True)
class _Keyed:
    """An item with its dedupe key and body hash, computed once."""

    item: IntakeItem
    key: dict[str, str]
    sha: str


class IntakeQueries(StoreBase):
    """The intake half of the store."""

    def intake(self, item: IntakeItem) -> IntakeResult:
        """Queue one message, or find it is a duplicate or a conflict (a group of one)."""
        now = self.clock()
        k = self._keyed(item)
        known = self._replay(k, now)
        if known is not None:
            return known
        if maintenance.over_limits(self, now, self._cost(item)):
            return IntakeResult(outcome="backpressure", message_id="", ack_mode=item.ack_mode)
        return self._insert(k, now)

    def intake_batch(self, items: Sequence[IntakeItem]) -> list[IntakeResult]:
        """Queue a group of messages all or none: one result per item, in order.

        Duplicates and conflicts (against the table or an earlier item of the
        group) are answered whatever the room; the new items are refused
        together (``backpressure``) when their total does not fit, and a
        failure while inserting rolls the whole group back.
        """
        if len(items) == 1:
            return [self.intake(items[0])]
        now = self.clock()
        keyed = [self._keyed(item) for item in items]
        results: list[IntakeResult | None] = [self._replay(k, now) for k in keyed]
        new = [i for i, r in enumerate(results) if r is None]
        if new:
            cost = sum(self._cost(keyed[i].item) for i in new)
            if maintenance.over_limits(self, now, cost):
                for i in new:
                    results[i] = IntakeResult(outcome="backpressure", message_id="", ack_mode=items[i].ack_mode)
            else:
                with self.dialect.nested(self.conn, "intake_group"):
                    seen: set[tuple[str, ...]] = set()
                    for i in new:
                        k = keyed[i]
                        key = tuple(k.key.values())
                        # An earlier item of this group may have the same key:
                        # it is in the table now, so ask the table again.
                        again = self._replay(k, now) if k.item.control_id and key in seen else None
                        results[i] = again or self._insert(k, now)
                        seen.add(key)
        return [r for r in results if r is not None]

    def _keyed(self, item: IntakeItem) -> _Keyed:
        key = {
            "channel": item.channel,
            "sending_app": item.sending_app,
            "sending_facility": item.sending_facility,
            "control_id": item.control_id,
        }
        return _Keyed(item, key, hashlib.sha256(item.body).hexdigest())

    @staticmethod
    def _cost_bytes(item: IntakeItem) -> int:
        return len(item.body) + len(item.commit_ack or b"")

    def _cost(self, item: IntakeItem) -> int:
        return maintenance.intake_cost(self, self._cost_bytes(item))

    def _replay(self, k: _Keyed, now: float) -> IntakeResult | None:
        """The answer for a known key (duplicate or conflict), or None for a new message."""
        if not k.item.control_id:
            return None
        prior = self._fetch_one("dedupe_lookup", now=now, **k.key)
        if prior is None:
            return None
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

    def _insert(self, k: _Keyed, now: float) -> IntakeResult:
        """Event.INTAKE: a new ``queued`` row with the channel's next seq, and its dedupe key."""
        item = k.item
        message_id = str(uuid.uuid4())
        seq = int(self._scalar("next_seq", channel=item.channel))
        # The hot path: parameters as one dict, built once.
        self.conn.execute(self.q["insert_message"], {
            "id": message_id,
            "channel": item.channel,
            "seq": seq,
            "state": _INTAKE_STATE,
            "remote": item.remote,
            "sending_app": item.sending_app,
            "sending_facility": item.sending_facility,
            "control_id": item.control_id,
            "message_type": item.message_type,
            "encoding": item.encoding,
            "body": item.body,
            "body_sha256": k.sha,
            "ack_mode": item.ack_mode,
            "accept_ack_type": item.accept_ack_type,
            "application_ack_type": item.application_ack_type,
            "ack_sent": item.commit_ack,
            "ack_outcome": AckOutcome.PENDING,
            "error_code": None,
            "error_text": None,
            "now": item.received_at,
            "partition_key": item.partition_key,
        })
        if item.control_id:
            keyed = self.conn.execute(self.q["dedupe_upsert"], {
                **k.key,
                "body_sha256": k.sha,
                "message_id": message_id,
                "ack_mode": item.ack_mode,
                "commit_ack": item.commit_ack,
                "expires_at": now + self.dedupe_window,
                "now": now,
            })
            if keyed.rowcount != 1:
                # The key's unique constraint met a live key the lookup did not
                # see (another process's intake): never a second row for it.
                raise StorageError("dedupe key taken by a concurrent intake; resend")
        return IntakeResult(outcome="accepted", message_id=message_id, seq=seq, ack_mode=item.ack_mode)

    def record_audit(self, item: AuditItem) -> str:
        """Event.AUDIT: insert a ``nacked`` audit row; it never counts as a dedupe prior.

        Audit rows are intake too: when purging cannot make room below the disk
        floor or at the size cap they are not kept (StorageError), so they never
        eat the reserve dispatch needs.
        """
        cost = maintenance.intake_cost(self, len(item.body) + len(item.ack_sent or b""))
        if maintenance.over_limits(self, self.clock(), cost):
            raise StorageError("audit row not kept: no room below the queue's disk and size limits")
        message_id = str(uuid.uuid4())
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

"""Reads for stats, the status page and the relay, and the operator's queries.

The operator commands (``hl7-agent queue …``, ``channel …``) run on the same
file as a running daemon: every write here is one short guarded statement
over at most a batch of rows, inside a transaction the caller keeps short
(``store.transaction()`` per batch). The guards are in the SQL
(``queue/sqlite/operator.sql``) whatever the caller passed: a re-drive moves
only ``failed``/``rejected`` rows, a set-aside only ``queued`` ones, a purge
deletes only terminal rows, and no operator query deletes a dedupe key
(docs/queue.md#operator-actions). Each command that changes something also
writes an ``operator_actions`` entry in the same transaction, which a daemon
later logs (the audit trail; docs/operations.md).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Collection, Sequence
from typing import Any

from agent.core.states import ALL, DEPTH, LIVE, Event
from agent.core.timefmt import rfc3339
from agent.storage import maintenance, schema
from agent.storage.liveness import holder_provably_dead
from agent.storage.rows import (
    ChannelActivity,
    LastSettled,
    ListedRow,
    LiveCount,
    OperatorAction,
    RecentFailure,
    RedriveOutcome,
    RowFilter,
    RowPlace,
    SetAsideOutcome,
    StateCount,
    StatusHead,
    StoredRow,
)
from agent.storage.store_partitions import PartitionQueries, blocked_entry

#: Above every seq (SQLite integers are 64-bit): "before the end" for a channel with no head.
_NO_SEQ = 2**63 - 1


#: ``meta`` keys holding an outbound channel's connection state: ``outbound:<channel>``.
OUTBOUND_META_PREFIX = "outbound:"


class OperatorQueries(PartitionQueries):
    """Stats, health, relay polling and the operator's reads and writes."""

    # -- daemon-side reads -------------------------------------------------------

    def stats(self, configured_channels: list[str] | None = None,
              partitioned: Collection[str] | None = None) -> dict[str, Any]:
        """The ``queue stats --json`` object (docs/operations.md; docs/queue-stats.schema.json).

        ``partitioned``: the channels configured with ``partition_key`` (None:
        all). A key paused while a channel was partitioned blocks nothing once
        it is not, so it is not reported as blocked (an alert on it would be false).
        """
        now = self.clock()
        by_state: dict[str, int] = dict.fromkeys(ALL, 0)
        for state, n in self._exec("count_by_state"):
            by_state[state] = int(n)
        channels: dict[str, dict[str, Any]] = {}

        def channel_entry(name: str) -> dict[str, Any]:
            return channels.setdefault(
                name, {**dict.fromkeys(DEPTH, 0), "oldest_queued_age_s": None, "paused": False}
            )

        for name in configured_channels or []:
            channel_entry(name)
        for flags in self.channel_flags():
            channel_entry(flags.channel)["paused"] = flags.paused
        for live in self._rows(LiveCount, "live_by_channel"):
            entry = channel_entry(live.channel)
            entry[live.state] = int(live.n)
            if live.oldest is not None:
                entry["oldest_queued_age_s"] = round(max(0.0, now - float(live.oldest)), 3)
        for blocked in self.blocked_partitions(now):
            if partitioned is not None and blocked.channel not in partitioned:
                continue
            channel_entry(blocked.channel).setdefault("blocked_partitions", []).append(
                blocked_entry(blocked, now, self.key_hash_secret()))
        row = self.lease_row()
        lease_obj = None
        if (row is not None and row.holder is not None and row.expires_at is not None
                and float(row.expires_at) > self._lease_now()
                # null while no process holds it: a holder provably dead (kill -9
                # on this host) holds nothing, whatever its expiry says.
                and not holder_provably_dead(row.holder_pid, row.holder_boot, row.holder_pidns,
                                             row.holder_start)):
            lease_obj = {"holder": row.holder, "epoch": int(row.epoch),
                         "expires_at": rfc3339(float(row.expires_at))}
        return {
            "states": by_state,
            "channels": dict(sorted(channels.items())),
            "lease": lease_obj,
            "db": self.dialect.db_stats(self.conn, self.db_path),
        }

    def recent_failures(self, limit: int) -> list[RecentFailure]:
        """The newest failed or rejected rows, for the status page."""
        return self._rows(RecentFailure, "recent_failures", limit=limit)

    def settled_app_acks(self, ids: Sequence[str]) -> dict[str, bytes]:
        """Of these rows, those whose application ACK is known: id → ACK bytes (the relay's poll)."""
        blob = self.dialect.blob
        return {str(r[0]): blob(r[1]) for r in self._exec("settled_app_acks", ids=json.dumps(list(ids)))}

    def probe_write(self) -> None:
        """A tiny write: /readyz proves the database takes writes — and intake would accept."""
        self._exec("probe_write", now=repr(self.clock()))
        maintenance.check_room(self)

    # -- the status page -----------------------------------------------------------

    def channel_activity(self, channels: Sequence[str]) -> list[ChannelActivity]:
        """Per channel: its head (without body), when it last received and delivered, its pause.

        A few index probes per channel, whatever the queue holds: the page is
        refreshed every few seconds on the reader the dispatcher uses too.
        """
        flags = {f.channel: f for f in self.channel_flags()}
        out: list[ChannelActivity] = []
        for name in channels:
            head = self._row(StatusHead, "status_head", channel=name)
            received = self._scalar("status_last_received", channel=name)
            # Every row before the head in delivery order is settled: the one just before it
            # went last (a re-driven head: the one before it, delivered before the re-drive).
            before = head.seq if head is not None else _NO_SEQ
            settled = self._row(LastSettled, "status_last_settled", channel=name, before=before)
            flag = flags.get(name)
            out.append(ChannelActivity(
                channel=name,
                head=head,
                last_received_at=None if received is None else float(received),
                last_settled=settled,
                paused=bool(flag and flag.paused),
                paused_at=flag.paused_at if flag and flag.paused else None,
                paused_reason=flag.paused_reason if flag and flag.paused else None,
            ))
        return out

    def live_depth(self) -> int:
        """Rows waiting or being dispatched, every channel: the page's depth history samples it."""
        return int(self._scalar("status_live_depth"))

    def server_acks(self, ids: Sequence[str]) -> dict[str, str]:
        """id → the server's ACK text, for those of these rows the server answered with one."""
        return {str(r[0]): str(r[1]) for r in self._exec("status_server_acks", ids=json.dumps(list(ids)))}

    # -- operator reads ------------------------------------------------------------

    def meta(self) -> dict[str, str]:
        """The ``meta`` table: agent_id, schema_version, queue_id, …"""
        return {str(k): str(v) for k, v in self._exec("meta_all")}

    def key_hash_secret(self) -> str:
        """The secret of agent.core.partition.key_hash, read once.

        A database no agent of this version has opened for writing yet has
        none (a read-only command on an older queue; a database server that
        was away when the daemon started): a secret of this process's own
        meanwhile, never kept, so its hashes still give nothing away.
        """
        if self._key_secret is None:
            found = self.meta().get(schema.KEY_HASH_SECRET)
            if not found:
                if self._own_secret is None:
                    self._own_secret = secrets.token_hex(16)
                return self._own_secret
            self._key_secret = found
        return self._key_secret

    def record_outbound(self, channel: str, state_json: str) -> None:
        """An outbound channel's connection state (JSON), for ``queue stats`` in another process."""
        self._exec("meta_upsert", key=f"{OUTBOUND_META_PREFIX}{channel}", value=state_json)

    def settled_by_channel(self) -> list[StateCount]:
        """Counts of terminal rows (settled and audit) per channel and state."""
        return self._rows(StateCount, "op_settled_by_channel")

    def list_rows(self, where: RowFilter) -> list[ListedRow]:
        """``queue list``: newest first (received_at DESC), bodies only when asked for."""
        return self._rows(
            ListedRow, "op_list", state=where.state, channel=where.channel, since=where.since,
            control_id=where.control_id, limit=where.limit or -1, show_body=1 if where.show_body else 0,
        )

    def row(self, message_id: str) -> StoredRow | None:
        """Every column of one row."""
        return self._row(StoredRow, "row_by_id", id=message_id)

    def row_place(self, message_id: str) -> RowPlace | None:
        return self._row(RowPlace, "op_row_place", id=message_id)

    def resolve_id_prefix(self, text: str, min_prefix: int, limit: int = 2) -> list[str]:
        """``[text]`` when it is a row's id; else up to ``limit`` ids it starts (none if shorter than ``min_prefix``)."""
        if self.row_place(text) is not None:
            return [text]
        if len(text) < min_prefix:
            return []
        return [str(r[0]) for r in self._exec("op_ids_by_prefix", prefix=text, limit=limit)]

    def rows_in_state(self, state: str, channel: str | None) -> list[ListedRow]:
        """Every row in ``state`` (of ``channel``), in delivery order, without bodies."""
        name = "op_select_live_state" if state in LIVE else "op_select_state"
        return self._rows(ListedRow, name, state=state, channel=channel)

    def count_state(self, state: str, channel: str | None) -> int:
        name = "op_count_live_state" if state in LIVE else "op_count_state"
        return int(self._scalar(name, state=state, channel=channel))

    def last_rowid(self) -> int:
        """The newest row's rowid: a re-drive by state stops there (rows it re-queues come back later)."""
        return int(self._scalar("op_max_rowid"))

    def count_purgeable(self, state: str, channel: str | None, cutoff: float) -> int:
        return int(self._scalar("op_count_purgeable", state=state, channel=channel, cutoff=cutoff))

    def export_ids(self, state: str, channel: str | None) -> list[str]:
        """Ids in ``state`` in delivery order: by channel, then seq; audit rows last by time."""
        name = "op_export_live_ids" if state in LIVE else "op_export_ids"
        return [str(r[0]) for r in self._exec(name, state=state, channel=channel)]

    def export_bodies(self, ids: Sequence[str]) -> dict[str, bytes]:
        """id → stored bytes of those rows that still exist."""
        blob = self.dialect.blob
        return {str(r[0]): blob(r[1]) for r in self._exec("op_bodies", ids=json.dumps(list(ids)))}

    # -- operator writes -----------------------------------------------------------

    def redrive_ids(self, ids: Sequence[str], now: float, *, dry_run: bool = False) -> list[RedriveOutcome]:
        """Event.REDRIVE by id (``queue retry ID…``): what happened to each, in order.

        Same id (a replaying server dedupes), due now, ``max_attempts``
        counted afresh from here (redrive_base). ``dry_run`` only looks.
        """
        name = self._query_for(Event.REDRIVE, "op_redrive_one")
        out: list[RedriveOutcome] = []
        for message_id in ids:
            place = self.row_place(message_id)
            if place is None:
                out.append(RedriveOutcome(message_id, "missing"))
                continue
            if place.state not in Event.REDRIVE.sources:
                out.append(RedriveOutcome(message_id, "refused", place.state, place.channel))
                continue
            if dry_run:
                out.append(RedriveOutcome(message_id, "would_move", place.state, place.channel))
                continue
            # The guard is in the UPDATE; count what it did.
            moved = int(self._exec(name, id=message_id, now=now).rowcount) == 1
            out.append(RedriveOutcome(message_id, "moved" if moved else "changed", place.state, place.channel))
        return out

    def redrive_state(self, state: str, channel: str | None, *, up_to_rowid: int, limit: int,
                      now: float) -> list[str]:
        """Event.REDRIVE of at most ``limit`` rows in ``state``: the channel of each row moved."""
        name = self._query_for(Event.REDRIVE, "op_redrive_batch")
        cur = self._exec(name, state=state, channel=channel, max_rowid=up_to_rowid, limit=limit, now=now)
        return [str(r[0]) for r in cur.fetchall()]

    def set_aside(self, ids: Sequence[str], now: float, *, error_code: str, error_text: str,
                  app_acks: dict[str, bytes] | None = None) -> list[SetAsideOutcome]:
        """Event.SET_ASIDE by id (``queue fail ID…``): queued → failed; what happened to each, in order.

        The guarded UPDATE decides (only a row queued at that instant moves:
        a claim and a set-aside never both win); the row is read afterwards
        only to say why one did not move. ``app_acks``: the application ACK
        owed to a waiting sender, by id, kept with the row and its dedupe key.
        """
        name = self._query_for(Event.SET_ASIDE, "op_set_aside")
        acks = app_acks or {}
        out: list[SetAsideOutcome] = []
        for message_id in ids:
            app_ack = acks.get(message_id)
            moved = int(self._exec(name, id=message_id, now=now, error_code=error_code,
                                   error_text=error_text, app_ack=app_ack).rowcount) == 1
            place = self.row_place(message_id)
            if place is None:
                out.append(SetAsideOutcome(message_id, "missing"))
                continue
            if moved and app_ack is not None:
                self._exec("dedupe_set_app_ack", message_id=message_id, app_ack=app_ack)
            out.append(SetAsideOutcome(message_id, "moved" if moved else "refused", place.state,
                                       place.channel, place.seq))
        return out

    def purge(self, state: str, channel: str | None, cutoff: float, limit: int) -> int:
        """Delete at most ``limit`` terminal rows in ``state`` last updated before ``cutoff``."""
        return int(self._exec("op_purge_batch", state=state, channel=channel, cutoff=cutoff,
                              limit=limit).rowcount)

    # -- the operator's audit trail ----------------------------------------------------

    def record_operator_action(
        self, action: str, *, os_user: str, pid: int, now: float, rows: int, detail: dict[str, Any],
        channel: str | None = None, reason: str | None = None, done: bool = True,
    ) -> int:
        """A new ``operator_actions`` entry, in the caller's transaction (the one that made the change).

        ``done=False`` for the first batch of a command that goes on in more
        transactions (:meth:`update_operator_action` then keeps it current).
        """
        return int(self._scalar(
            "op_action_insert", action=action, os_user=os_user, pid=pid, channel=channel,
            reason=reason, rows=rows, detail=json.dumps(detail, sort_keys=True),
            status="done" if done else "running", now=now,
        ))

    def update_operator_action(self, entry_id: int, *, now: float, rows: int, detail: dict[str, Any],
                               status: str = "running", channel: str | None = None) -> None:
        """The entry after one more batch (``status`` ``done`` with the last, ``interrupted`` if cut short)."""
        self._exec("op_action_update", id=entry_id, now=now, rows=rows,
                   detail=json.dumps(detail, sort_keys=True), status=status, channel=channel)

    def operator_actions_due(self, stale_before: float) -> bool:
        """Whether an entry waits to be logged: finished, or running but silent since ``stale_before``."""
        return self._scalar("operator_actions_due", stale_before=stale_before) is not None

    def take_operator_actions(self, stale_before: float) -> list[OperatorAction]:
        """The entries due for the log, marked logged in this transaction (so each is logged once).

        Entries logged longer ago than ``retention`` are forgotten meanwhile.
        """
        now = self.clock()
        taken = self._rows(OperatorAction, "operator_actions_take", now=now, stale_before=stale_before)
        self._exec("operator_actions_forget", cutoff=now - self.retention)
        return sorted(taken, key=lambda entry: entry.id)

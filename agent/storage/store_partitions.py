"""Partitioned channels in the store: the heads of each key, the per-key claim, key pauses.

docs/queue.md#partitioned-channels. A key's turn is its lowest-seq live row;
while a row of the key is claimed or inflight no other row of it is claimed;
a key paused by ``on_reject = "pause"`` waits until ``channel resume``. The
rule lives in the SQL (queue/<dialect>/queries.sql, ``partition_*``), so
every backend carries it; the claim checks it again under the write lock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agent.core.partition import key_hash
from agent.core.timefmt import rfc3339
from agent.storage.rows import HeadRow
from agent.storage.store_dispatch import DispatchQueries

__all__ = ["BlockedPartition", "PartitionQueries", "UnkeyedRow", "blocked_entry"]


@dataclass(frozen=True)
class UnkeyedRow:
    """A live row of a partitioned channel whose key is not stored (an older agent took it in)."""

    id: str
    body: bytes
    encoding: str


@dataclass(frozen=True)
class BlockedPartition:
    """A key that cannot go on by itself: its head waits for a retry, or the key is paused.

    ``partition_key`` is patient data: show :func:`agent.core.partition.key_hash` of it
    (keyed with the queue's secret).
    ``id`` is None for a paused key with no live row left.
    """

    channel: str
    partition_key: str
    why: str  # "retrying" or "paused"
    id: str | None
    seq: int | None
    received_at: float | None
    attempts: int
    depth: int  # live rows of the key
    next_attempt_at: float | None = None
    error_code: str | None = None
    server_status: int | None = None
    paused_at: float | None = None
    reason: str | None = None


class PartitionQueries(DispatchQueries):
    """The partitioned half of dispatch (the strict one is ``channel_head``)."""

    def partition_heads(self, channel: str, now: float, limit: int) -> list[HeadRow]:
        """Up to ``limit`` claimable heads of ``channel`` (queued, due, their key's turn), by seq."""
        return self._rows(HeadRow, "partition_heads", channel=channel, now=now, limit=limit)

    def partition_busy(self, channel: str) -> list[HeadRow]:
        """The channel's claimed and inflight rows, by seq."""
        return self._rows(HeadRow, "partition_busy", channel=channel)

    def claim_partition_head(self, holder: str, epoch: int, message_id: str) -> bool:
        """Event.CLAIM for a partitioned row, only when it is its key's turn (checked in this commit)."""
        if self._scalar("partition_claimable", id=message_id) is None:
            self._check_fence(holder, epoch)
            return False
        return self.claim(holder, epoch, message_id)

    def unkeyed_rows(self, channel: str, limit: int = 500) -> list[UnkeyedRow]:
        return self._rows(UnkeyedRow, "partition_unkeyed", channel=channel, limit=limit)

    def set_partition_keys(self, keys: Sequence[tuple[str, str]]) -> int:
        """Store computed keys, (id, key) pairs, for rows that have none; the number stored."""
        done = 0
        for message_id, key in keys:
            done += int(self._exec("partition_set_key", id=message_id, partition_key=key).rowcount)
        return done

    def key_unkeyed(self, channel: str, key_of: Callable[[bytes, str], str], limit: int = 500) -> int:
        """Compute and store the keys of ``channel``'s unkeyed live rows (in one commit)."""
        rows = self.unkeyed_rows(channel, limit)
        return self.set_partition_keys([(r.id, key_of(r.body, r.encoding)) for r in rows])

    def pause_partition(self, channel: str, key: str, reason: str) -> None:
        """``on_reject = "pause"`` on a partitioned channel: this key waits until ``channel resume``."""
        self._exec("partition_pause", channel=channel, partition_key=key, now=self.clock(), reason=reason)

    def row_partition(self, message_id: str) -> tuple[str | None, str | None]:
        """A row's partition key (None: it has none) and, when that key is paused, the reason."""
        found = self._fetch_one("row_partition", id=message_id)
        return (None, None) if found is None else (found["partition_key"], found["paused_reason"])

    def blocked_partitions(self, now: float, limit: int = 100) -> list[BlockedPartition]:
        """Paused keys, then keys whose head waits for a retry (soonest first)."""
        found: list[BlockedPartition] = []
        for r in self._fetch_all("partition_paused"):
            found.append(BlockedPartition(
                channel=r["channel"], partition_key=r["partition_key"], why="paused", id=r["id"],
                seq=r["seq"], received_at=r["received_at"], attempts=int(r["attempts"] or 0),
                depth=int(r["depth"]), paused_at=r["paused_at"], reason=r["reason"],
            ))
        paused = {(b.channel, b.partition_key) for b in found}
        for r in self._fetch_all("partition_retrying", now=now, limit=limit):
            if (r["channel"], r["partition_key"]) in paused:
                continue
            found.append(BlockedPartition(
                channel=r["channel"], partition_key=r["partition_key"], why="retrying", id=r["id"],
                seq=r["seq"], received_at=r["received_at"], attempts=int(r["attempts"]),
                depth=int(r["depth"]), next_attempt_at=r["next_attempt_at"], error_code=r["error_code"],
                server_status=r["server_status"],
            ))
        return found[:limit]


def blocked_entry(b: BlockedPartition, now: float, secret: str) -> dict[str, Any]:
    """A blocked partition in ``queue stats --json`` (docs/queue-stats.schema.json): never the key itself.

    ``secret``: the queue's (OperatorQueries.key_hash_secret).
    """
    return {
        "key_hash": key_hash(b.partition_key, secret),
        "why": b.why,
        "head_id": b.id,
        "head_seq": b.seq,
        "head_age_s": round(max(0.0, now - b.received_at), 3) if b.received_at is not None else None,
        "depth": b.depth,
        "attempts": b.attempts,
        "next_attempt_in_s": (round(max(0.0, b.next_attempt_at - now), 3)
                              if b.next_attempt_at is not None else None),
        "error_code": b.error_code,
        "server_status": b.server_status,
        "paused_at": rfc3339(b.paused_at) if b.paused_at is not None else None,
        "paused_reason": b.reason,
    }

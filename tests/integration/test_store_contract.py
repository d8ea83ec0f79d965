"""The queue store contract (SPEC 6): what any backend must do — intake, claim, settle, lease, stats.

Written against the ``harness`` fixture, which yields a store, a clock the
test moves, and a way to run one transaction: SQLite in ``tmp_path``, and
PostgreSQL on the real server the session starts (tests/conftest.py), each
test on a database of its own; the same tests pass unchanged on both.
Lease expiry is simulated by moving the store's clock, never by waiting: on
PostgreSQL the lease runs on the server's clock, to which the harness adds
how far the test moved its clock (the dialect's one test seam).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import pytest
from storetest import FakeClock, open_store

from agent.errors import LeaseLost, StorageError
from agent.storage.store import IntakeItem, LeaseHolder, SqliteStore, holder_provably_dead
from agent.storage.store_base import MULTIROW_ROWS

T = TypeVar("T")
TTL = 30.0


@dataclass
class Harness:
    store: SqliteStore
    clock: FakeClock

    def tx(self, fn: Callable[[SqliteStore], T]) -> T:
        """Run ``fn`` in one write transaction, as the writer thread would."""
        with self.store.transaction() as s:
            return fn(s)

    def row(self, message_id: str) -> dict[str, Any]:
        found = self.store.row(message_id)
        assert found is not None
        return asdict(found)


@pytest.fixture(params=["sqlite", "postgresql"])
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    """A fresh, migrated store per test; parametrised by backend."""
    clock = FakeClock()
    with open_store(request.param, request, tmp_path, "contract-agent", clock) as store:
        yield Harness(store, clock)


def item(control_id: str, channel: str = "adt", *, body: bytes | None = None, app: str = "LAB") -> IntakeItem:
    text = body or (
        f"MSH|^~\\&|{app}|NORTH|EHR|CENTRAL|20260101120000||ADT^A01|{control_id}|P|2.5.1\rPID|1||9\r"
    ).encode()
    return IntakeItem(
        channel=channel, remote="10.0.0.1:4000", sending_app=app, sending_facility="NORTH",
        control_id=control_id, message_type="ADT^A01", body=text, encoding="utf-8",
        ack_mode="commit", commit_ack=b"MSH|^~\\&|ACK\rMSA|AA|" + control_id.encode() + b"\r",
    )


def holder(name: str, pid: int | None = None, **overrides: Any) -> LeaseHolder:
    """A lease holder identity; by default this (live) test process under another name."""
    me = LeaseHolder.for_this_process("contract-agent")
    return replace(me, holder=name, pid=me.pid if pid is None else pid, **overrides)


def acquire(h: Harness, who: LeaseHolder, ttl: float = TTL) -> int:
    epoch = h.tx(lambda s: s.try_acquire_lease(who, ttl))
    assert epoch is not None, f"{who.holder} could not take the lease"
    return epoch


def queue_n(h: Harness, n: int, channel: str = "adt", prefix: str = "M") -> list[str]:
    ids = []
    for i in range(n):
        result = h.tx(lambda s, i=i: s.intake(item(f"{prefix}{channel}{i}", channel)))
        assert result.outcome == "accepted"
        ids.append(result.message_id)
    return ids


def send(h: Harness, who: str, epoch: int, message_id: str) -> int:
    """claim + mark_inflight: the attempt number now in flight."""
    head = h.store.channel_head(h.row(message_id)["channel"])
    assert head is not None and head.id == message_id
    if head.state == "queued":
        assert h.tx(lambda s: s.claim(who, epoch, message_id))
    return h.tx(lambda s: s.mark_inflight(who, epoch, message_id, "claimed", head.attempts))


def dead_pid() -> int:
    """The PID of a process that has exited and been reaped."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          check=True, capture_output=True, text=True)
    return int(proc.stdout)


class TestIntake:
    def test_accepted_rows_get_consecutive_seq_per_channel(self, harness: Harness) -> None:
        """Each channel numbers its queued rows 1, 2, 3 ... independently."""
        a = queue_n(harness, 3, "adt")
        b = queue_n(harness, 2, "lab")
        assert [harness.row(i)["seq"] for i in a] == [1, 2, 3]
        assert [harness.row(i)["seq"] for i in b] == [1, 2]
        assert {harness.row(i)["state"] for i in a + b} == {"queued"}

    def test_identical_retransmit_is_a_duplicate_without_a_new_row(self, harness: Harness) -> None:
        """The same key and bytes return the original id and its commit ACK, and add no row."""
        first = harness.tx(lambda s: s.intake(item("X1")))
        again = harness.tx(lambda s: s.intake(item("X1")))
        assert again.outcome == "duplicate"
        assert again.message_id == first.message_id
        assert again.commit_ack == item("X1").commit_ack
        assert harness.store.stats()["states"]["queued"] == 1

    def test_same_control_id_other_body_is_a_conflict(self, harness: Harness) -> None:
        """MSH-10 reused with another body is refused, and no row is queued for it."""
        harness.tx(lambda s: s.intake(item("X1")))
        other = harness.tx(lambda s: s.intake(item("X1", body=b"MSH|^~\\&|LAB|NORTH|||||ADT^A01|X1|P|2.5\rPID|2\r")))
        assert other.outcome == "conflict"
        assert harness.store.stats()["states"]["queued"] == 1

    def test_duplicates_are_caught_within_one_transaction(self, harness: Harness) -> None:
        """Two identical messages in the same commit batch make one row."""
        results = harness.tx(lambda s: [s.intake(item("B1")), s.intake(item("B1"))])
        assert [r.outcome for r in results] == ["accepted", "duplicate"]


    def test_a_batch_larger_than_one_statement_answers_every_item(self, harness: Harness) -> None:
        """A commit batch spans several multi-row statements (MULTIROW_ROWS rows each): every row,
        seq and key is written once, and a second batch of the same keys finds each of them.

        Half the keys come back with other bytes (conflicts), and the batch
        holds in-run duplicates, keys the table knows and new keys across the
        statement boundaries, on two channels.
        """
        n = 2 * MULTIROW_ROWS + 37
        first = harness.tx(lambda s: s.intake_groups([[item(f"K{i}", "adt" if i % 4 else "lab")]
                                                      for i in range(n)]))
        assert [r.outcome for (r,) in first] == ["accepted"] * n
        seqs = {"adt": [], "lab": []}
        for i, (r,) in enumerate(first):
            seqs["adt" if i % 4 else "lab"].append(r.seq)
        assert {c: v == list(range(1, len(v) + 1)) for c, v in seqs.items()} == {"adt": True, "lab": True}

        def again(i: int) -> IntakeItem:
            other = f"MSH|^~\\&|LAB|NORTH|||||ADT^A01|K{i}|P|2.5\rPID|{i}\r".encode()
            return item(f"K{i}", "adt" if i % 4 else "lab", body=other if i % 2 else None)

        groups = [[again(i)] for i in range(n)] + [[item(f"N{i}")] for i in range(MULTIROW_ROWS)]
        groups += [[item("N0")]]  # the run's own key, earlier in the same batch
        second = harness.tx(lambda s: s.intake_groups(groups))
        outcomes = [r.outcome for (r,) in second]
        assert outcomes[:n] == ["conflict" if i % 2 else "duplicate" for i in range(n)]
        assert [r.message_id for (r,) in second[:n:2]] == [r.message_id for (r,) in first[::2]]
        assert outcomes[n:] == ["accepted"] * MULTIROW_ROWS + ["duplicate"]
        assert second[-1][0].message_id == second[n][0].message_id
        assert harness.store.stats()["states"]["queued"] == n + MULTIROW_ROWS
        assert len({r.message_id for (r,) in first}) == n

    def test_ack_outcomes_of_a_batch_end_with_each_rows_last(self, harness: Harness) -> None:
        """set_ack_outcomes across several statements; a row named twice keeps its last outcome."""
        ids = queue_n(harness, MULTIROW_ROWS + 5)
        pairs = [(m, "delivered") for m in ids] + [(ids[0], "undelivered")]
        changed = harness.tx(lambda s: s.set_ack_outcomes(pairs))
        assert changed == len(ids)
        assert [harness.row(m)["ack_outcome"] for m in ids] == ["undelivered"] + ["delivered"] * (len(ids) - 1)
        assert harness.tx(lambda s: s.set_ack_outcomes(pairs)) == 0  # nothing left to change
        with pytest.raises(ValueError, match="unknown ack_outcome"):
            harness.tx(lambda s: s.set_ack_outcomes([(ids[1], "lost")]))


class TestKeyHashSecret:
    def test_made_with_the_database_and_read_alike_by_every_connection(self, harness: Harness) -> None:
        """Every process and host on one database must name a partition key alike."""
        secret = harness.store.key_hash_secret()
        assert len(secret) == 32 and harness.store.meta()["key_hash_secret"] == secret
        other = SqliteStore(harness.store.conn, harness.store.q, db_path=harness.store.db_path,
                            dialect=harness.store.dialect)
        assert other.key_hash_secret() == secret

    def test_a_database_without_one_gets_a_stand_in_never_kept(self, harness: Harness) -> None:
        """An older queue read before this version opened it for writing: a secret of the process's
        own, the same within it; the database's own one as soon as it has one."""
        harness.tx(lambda s: s._exec("meta_upsert", key="key_hash_secret", value=""))
        fresh = SqliteStore(harness.store.conn, harness.store.q, db_path=harness.store.db_path,
                            dialect=harness.store.dialect)
        stand_in = fresh.key_hash_secret()
        assert len(stand_in) == 32 and fresh.key_hash_secret() == stand_in
        harness.tx(lambda s: s._exec("meta_upsert", key="key_hash_secret", value="ab" * 16))
        assert fresh.key_hash_secret() == "ab" * 16


class TestFifoHead:
    def test_head_is_the_lowest_live_seq_of_its_channel(self, harness: Harness) -> None:
        """The head moves to the next seq only once the previous row settled."""
        ids = queue_n(harness, 3)
        epoch = acquire(harness, holder("h1"))
        assert harness.store.channel_head("adt").id == ids[0]  # type: ignore[union-attr]
        attempt = send(harness, "h1", epoch, ids[0])
        assert harness.store.channel_head("adt").id == ids[0]  # type: ignore[union-attr]
        assert harness.tx(lambda s: s.settle("h1", epoch, ids[0], attempt, "processed",
                                             server_status=200, server_ack=None))
        assert harness.store.channel_head("adt").id == ids[1]  # type: ignore[union-attr]

    def test_a_row_in_backoff_keeps_blocking_its_channel(self, harness: Harness) -> None:
        """A requeued row stays the head and cannot be claimed before next_attempt_at."""
        ids = queue_n(harness, 2)
        epoch = acquire(harness, holder("h1"))
        attempt = send(harness, "h1", epoch, ids[0])
        due = harness.clock.now + 5
        assert harness.tx(lambda s: s.requeue("h1", epoch, ids[0], attempt, due, server_status=503))
        head = harness.store.channel_head("adt")
        assert head is not None and head.id == ids[0] and head.next_attempt_at == due
        assert not harness.tx(lambda s: s.claim("h1", epoch, ids[0]))
        harness.clock.advance(5)
        assert harness.tx(lambda s: s.claim("h1", epoch, ids[0]))

    def test_channels_have_independent_heads(self, harness: Harness) -> None:
        """An inflight head on one channel does not hide another channel's head."""
        a = queue_n(harness, 2, "adt")
        b = queue_n(harness, 2, "lab")
        epoch = acquire(harness, holder("h1"))
        send(harness, "h1", epoch, a[0])
        assert harness.store.channel_head("lab").id == b[0]  # type: ignore[union-attr]

    def test_empty_channel_has_no_head(self, harness: Harness) -> None:
        """A channel with no live rows has no head."""
        assert harness.store.channel_head("adt") is None


class TestFencing:
    def test_claim_needs_the_lease(self, harness: Harness) -> None:
        """Nobody claims without holding the lease at that epoch."""
        ids = queue_n(harness, 1)
        epoch = acquire(harness, holder("h1"))
        with pytest.raises(LeaseLost):
            harness.tx(lambda s: s.claim("intruder", epoch, ids[0]))
        with pytest.raises(LeaseLost):
            harness.tx(lambda s: s.claim("h1", epoch + 1, ids[0]))
        assert harness.row(ids[0])["state"] == "queued"

    def test_holder_taken_over_after_expiry_cannot_write(self, harness: Harness) -> None:
        """After its lease expired and a peer acquired it, every dispatch write of the old holder fails."""
        ids = queue_n(harness, 3)
        old = acquire(harness, holder("old"))
        attempt = send(harness, "old", old, ids[0])
        harness.clock.advance(TTL + 1)
        new = acquire(harness, holder("new"))
        assert new > old
        before = {i: harness.row(i) for i in ids}
        with pytest.raises(LeaseLost):
            harness.tx(lambda s: s.claim("old", old, ids[2]))
        with pytest.raises(LeaseLost):
            harness.tx(lambda s: s.mark_inflight("old", old, ids[0], "inflight", attempt))
        with pytest.raises(LeaseLost):
            harness.tx(lambda s: s.settle("old", old, ids[0], attempt, "processed",
                                          server_status=200, server_ack=None))
        with pytest.raises(LeaseLost):
            harness.tx(lambda s: s.requeue("old", old, ids[0], attempt, 0.0))
        with pytest.raises(LeaseLost):
            harness.tx(lambda s: s.fail_live("old", old, ids[0], attempt, "failed",
                                             error_code="x", error_text="x"))
        with pytest.raises(LeaseLost):
            harness.tx(lambda s: s.renew_lease("old", old, TTL))
        with pytest.raises(LeaseLost):
            harness.tx(lambda s: s.recover_claimed("old", old))
        assert harness.tx(lambda s: s.release_lease("old", old)) is False
        for i in ids:
            after = harness.row(i)
            assert (after["state"], after["attempts"]) == (before[i]["state"], before[i]["attempts"])
        lease = harness.store.lease()
        assert lease is not None and (lease.holder, lease.epoch) == ("new", new)

    def test_expired_but_not_taken_over_lease_still_fences_peers(self, harness: Harness) -> None:
        """Expiry alone does not hand rows to anyone: only a new acquisition moves the epoch."""
        ids = queue_n(harness, 1)
        epoch = acquire(harness, holder("h1"))
        harness.clock.advance(TTL + 1)
        with pytest.raises(LeaseLost):
            harness.tx(lambda s: s.claim("h2", epoch, ids[0]))
        assert harness.tx(lambda s: s.claim("h1", epoch, ids[0]))


class TestAttemptScopedSettles:
    def test_settle_with_an_older_attempt_changes_nothing(self, harness: Harness) -> None:
        """An answer to attempt 1 arriving while attempt 2 is in flight returns False, row unchanged."""
        ids = queue_n(harness, 1)
        epoch = acquire(harness, holder("h1"))
        first = send(harness, "h1", epoch, ids[0])
        second = harness.tx(lambda s: s.mark_inflight("h1", epoch, ids[0], "inflight", first))
        assert (first, second) == (1, 2)
        before = harness.row(ids[0])
        assert harness.tx(lambda s: s.settle("h1", epoch, ids[0], first, "processed",
                                             server_status=200, server_ack="late")) is False
        assert harness.tx(lambda s: s.requeue("h1", epoch, ids[0], first, 0.0)) is False
        assert harness.tx(lambda s: s.fail_live("h1", epoch, ids[0], first, "failed",
                                                error_code="x", error_text="x")) is False
        assert harness.row(ids[0]) == before
        assert harness.tx(lambda s: s.settle("h1", epoch, ids[0], second, "processed",
                                             server_status=200, server_ack="ok"))
        row = harness.row(ids[0])
        assert (row["state"], row["attempts"], row["server_ack"]) == ("processed", 2, "ok")

    def test_a_settled_row_cannot_be_settled_again(self, harness: Harness) -> None:
        """A second settle of the same attempt is a no-op (guarded on state)."""
        ids = queue_n(harness, 1)
        epoch = acquire(harness, holder("h1"))
        attempt = send(harness, "h1", epoch, ids[0])
        assert harness.tx(lambda s: s.settle("h1", epoch, ids[0], attempt, "rejected",
                                             server_status=400, server_ack=None))
        assert harness.tx(lambda s: s.settle("h1", epoch, ids[0], attempt, "processed",
                                             server_status=200, server_ack=None)) is False
        assert harness.row(ids[0])["state"] == "rejected"

    def test_settle_refuses_a_live_state(self, harness: Harness) -> None:
        """settle only moves into processed/rejected/failed."""
        ids = queue_n(harness, 1)
        epoch = acquire(harness, holder("h1"))
        attempt = send(harness, "h1", epoch, ids[0])
        with pytest.raises(ValueError, match="cannot settle"):
            harness.tx(lambda s: s.settle("h1", epoch, ids[0], attempt, "queued",
                                          server_status=None, server_ack=None))

    def test_mark_inflight_counts_attempts_for_life(self, harness: Harness) -> None:
        """Every send increments attempts; a retry after backoff continues the count."""
        ids = queue_n(harness, 1)
        epoch = acquire(harness, holder("h1"))
        attempt = send(harness, "h1", epoch, ids[0])
        harness.tx(lambda s: s.requeue("h1", epoch, ids[0], attempt, 0.0, server_status=503))
        assert send(harness, "h1", epoch, ids[0]) == 2


class TestSendAndResend:
    def test_a_head_read_as_queued_is_sent_once_claimed(self, harness: Harness) -> None:
        """The dispatcher passes the state it read (queued), then claims: the send is attempt 1."""
        ids = queue_n(harness, 1)
        epoch = acquire(harness, holder("h1"))
        head = harness.store.channel_head("adt")
        assert head is not None and head.state == "queued"
        assert harness.tx(lambda s: s.claim("h1", epoch, ids[0]))
        assert harness.tx(lambda s: s.mark_inflight("h1", epoch, ids[0], head.state, head.attempts)) == 1
        assert harness.row(ids[0])["state"] == "inflight"

    def test_claim_and_send_takes_a_due_queued_head_straight_to_inflight(self, harness: Harness) -> None:
        """One statement, the same row as claim then send: attempt 1, claimed and sent stamps, the epoch."""
        ids = queue_n(harness, 1)
        epoch = acquire(harness, holder("h1"))
        assert harness.tx(lambda s: s.claim_and_send("h1", epoch, ids[0], 0)) == 1
        row = harness.row(ids[0])
        assert (row["state"], row["attempts"], row["claim_epoch"]) == ("inflight", 1, epoch)
        assert row["claimed_at"] == row["sent_at"] == harness.clock.now

    def test_claim_and_send_moves_nothing_but_a_due_queued_row_at_its_attempts(self, harness: Harness) -> None:
        """Not due, already claimed, another attempt count: None, and the row is left as it was."""
        ids = queue_n(harness, 1)
        epoch = acquire(harness, holder("h1"))
        assert harness.tx(lambda s: s.claim_and_send("h1", epoch, ids[0], 3)) is None  # attempts differ
        attempt = harness.tx(lambda s: s.claim_and_send("h1", epoch, ids[0], 0))
        assert harness.tx(lambda s: s.claim_and_send("h1", epoch, ids[0], 0)) is None  # inflight now
        due = harness.clock.now + 5
        assert harness.tx(lambda s: s.requeue("h1", epoch, ids[0], attempt, due, server_status=503))
        assert harness.tx(lambda s: s.claim_and_send("h1", epoch, ids[0], 1)) is None  # in its backoff
        assert (harness.row(ids[0])["state"], harness.row(ids[0])["attempts"]) == ("queued", 1)
        harness.clock.advance(5)
        assert harness.tx(lambda s: s.claim_and_send("h1", epoch, ids[0], 1)) == 2

    def test_claim_and_send_is_fenced(self, harness: Harness) -> None:
        ids = queue_n(harness, 1)
        epoch = acquire(harness, holder("h1"))
        with pytest.raises(LeaseLost):
            harness.tx(lambda s: s.claim_and_send("intruder", epoch, ids[0], 0))
        with pytest.raises(LeaseLost):
            harness.tx(lambda s: s.claim_and_send("h1", epoch + 1, ids[0], 0))
        assert harness.row(ids[0])["state"] == "queued"

    def test_a_resend_needs_an_inflight_row(self, harness: Harness) -> None:
        """RESEND moves only inflight rows (its sources): a claimed row named as inflight is not sent."""
        ids = queue_n(harness, 1)
        epoch = acquire(harness, holder("h1"))
        assert harness.tx(lambda s: s.claim("h1", epoch, ids[0]))
        with pytest.raises(StorageError, match="was not inflight"):
            harness.tx(lambda s: s.mark_inflight("h1", epoch, ids[0], "inflight", 0))
        assert (harness.row(ids[0])["state"], harness.row(ids[0])["attempts"]) == ("claimed", 0)


class TestLease:
    def test_free_lease_is_taken_and_visible(self, harness: Harness) -> None:
        """The first holder gets epoch 1 and stats show it until it expires."""
        assert harness.store.lease() is None
        epoch = acquire(harness, holder("h1"))
        assert epoch == 1
        lease = harness.store.stats()["lease"]
        assert lease is not None and lease["holder"] == "h1" and lease["epoch"] == 1
        harness.clock.advance(TTL + 1)
        assert harness.store.stats()["lease"] is None

    def test_live_holder_is_not_replaced_before_expiry(self, harness: Harness) -> None:
        """A peer cannot take a lease whose holder runs and has not expired."""
        acquire(harness, holder("h1"))
        assert harness.tx(lambda s: s.try_acquire_lease(holder("h2"), TTL)) is None
        harness.clock.advance(TTL - 1)
        assert harness.tx(lambda s: s.try_acquire_lease(holder("h2"), TTL)) is None

    def test_renewal_keeps_the_lease_past_the_first_ttl(self, harness: Harness) -> None:
        """A heartbeat pushes the expiry: a peer still cannot take it after the original TTL."""
        epoch = acquire(harness, holder("h1"))
        harness.clock.advance(TTL - 1)
        harness.tx(lambda s: s.renew_lease("h1", epoch, TTL))
        harness.clock.advance(2)
        assert harness.tx(lambda s: s.try_acquire_lease(holder("h2"), TTL)) is None

    def test_epoch_grows_on_every_takeover(self, harness: Harness) -> None:
        """Each acquisition — expiry, release or re-acquire — yields a strictly larger epoch."""
        epochs = [acquire(harness, holder("h1"))]
        harness.clock.advance(TTL + 1)
        epochs.append(acquire(harness, holder("h2")))
        harness.tx(lambda s: s.release_lease("h2", epochs[-1]))
        epochs.append(acquire(harness, holder("h1")))
        harness.clock.advance(TTL + 1)
        epochs.append(acquire(harness, holder("h1")))
        assert epochs == sorted(set(epochs)) and len(epochs) == 4

    def test_release_lets_a_peer_take_over_at_once(self, harness: Harness) -> None:
        """After release the lease is free without waiting for the TTL."""
        epoch = acquire(harness, holder("h1"))
        assert harness.tx(lambda s: s.release_lease("h1", epoch))
        assert harness.store.lease() is None
        assert acquire(harness, holder("h2")) == epoch + 1

    def test_provably_dead_holder_is_replaced_at_once(self, harness: Harness) -> None:
        """A holder on this boot and PID namespace whose PID no longer runs loses the lease before its TTL."""
        gone = dead_pid()
        acquire(harness, holder("crashed", pid=gone, start_ticks=12345))
        epoch = harness.tx(lambda s: s.try_acquire_lease(holder("successor"), TTL))
        assert epoch == 2

    def test_holder_whose_pid_was_reused_is_replaced_at_once(self, harness: Harness) -> None:
        """Same PID but another process start time means the holder is gone."""
        me = holder("x")
        acquire(harness, holder("crashed", pid=me.pid, start_ticks=me.start_ticks + 1))
        assert harness.tx(lambda s: s.try_acquire_lease(holder("successor"), TTL)) == 2

    @pytest.mark.parametrize("elsewhere", [{"boot_id": "another-boot"}, {"pidns": "pid:[1]"}, {"boot_id": ""}],
                             ids=["other-boot", "other-pidns", "unknown-boot"])
    def test_holder_on_another_boot_or_pid_namespace_waits_for_the_ttl(
        self, harness: Harness, elsewhere: dict[str, str]
    ) -> None:
        """A dead-looking PID proves nothing on another boot or PID namespace: the TTL applies."""
        if elsewhere.get("pidns") == holder("x").pidns:
            pytest.skip("this test process runs in the initial PID namespace")
        gone = dead_pid()
        acquire(harness, holder("elsewhere", pid=gone, **elsewhere))
        assert harness.tx(lambda s: s.try_acquire_lease(holder("successor"), TTL)) is None
        harness.clock.advance(TTL + 1)
        assert harness.tx(lambda s: s.try_acquire_lease(holder("successor"), TTL)) == 2

    def test_live_holder_process_is_not_provably_dead(self) -> None:
        """This very process, with its real start time, is alive."""
        me = holder("me")
        assert not holder_provably_dead(me.pid, me.boot_id, me.pidns, me.start_ticks)
        assert holder_provably_dead(dead_pid(), me.boot_id, me.pidns, 1)

    def test_a_read_tells_a_standby_when_the_lease_is_takeable(self, harness: Harness) -> None:
        """lease_takeable (a read, no transaction) answers as try_acquire_lease would: free, expired,
        its own, or a provably dead holder's — not a live holder's before expiry."""
        me, other = holder("standby"), holder("h1")
        assert harness.store.lease_takeable(me)
        epoch = acquire(harness, other)
        assert not harness.store.lease_takeable(me)
        assert harness.store.lease_takeable(other)
        harness.clock.advance(TTL + 1)
        assert harness.store.lease_takeable(me)
        harness.tx(lambda s: s.renew_lease("h1", epoch, TTL))
        assert not harness.store.lease_takeable(me)
        harness.clock.advance(TTL + 1)
        acquire(harness, holder("crashed", pid=dead_pid(), start_ticks=1))
        assert harness.store.lease_takeable(me)

    def test_two_contenders_cannot_both_win_one_epoch(self, harness: Harness) -> None:
        """The takeover is a compare-and-set on the epoch: a stale contender fails."""
        epoch = acquire(harness, holder("h1"))
        harness.clock.advance(TTL + 1)
        # Contender A reads the row, contender B wins meanwhile; A's take must then fail.
        stale = harness.store.lease()
        assert stale is not None and stale.epoch == epoch
        acquire(harness, holder("h2"))
        taken = harness.tx(lambda s: s._scalar("lease_take", holder="h3", pid=1, boot="", pidns="", start=0,
                                            expires_at=harness.clock.now + TTL, now=harness.clock.now,
                                            seen_epoch=stale.epoch))
        assert taken is None


class TestRecovery:
    def test_recover_claimed_requeues_claimed_rows_only(self, harness: Harness) -> None:
        """After a takeover, claimed rows (provably unsent) go back to queued; inflight rows stay inflight."""
        a = queue_n(harness, 1, "adt")
        b = queue_n(harness, 1, "lab")
        old = acquire(harness, holder("old", pid=dead_pid()))
        send(harness, "old", old, a[0])
        assert harness.tx(lambda s: s.claim("old", old, b[0]))
        new = acquire(harness, holder("new"))
        assert harness.tx(lambda s: s.recover_claimed("new", new)) == 1
        assert harness.row(a[0])["state"] == "inflight"
        assert harness.row(b[0])["state"] == "queued"

    def test_inflight_row_is_resent_by_the_new_holder_with_the_next_attempt(self, harness: Harness) -> None:
        """The successor resends an inflight row (same id) as attempt 2, then settles it."""
        ids = queue_n(harness, 1)
        old = acquire(harness, holder("old", pid=dead_pid()))
        send(harness, "old", old, ids[0])
        new = acquire(harness, holder("new"))
        head = harness.store.channel_head("adt")
        assert head is not None and head.state == "inflight" and head.id == ids[0]
        attempt = harness.tx(lambda s: s.mark_inflight("new", new, ids[0], "inflight", head.attempts))
        assert attempt == 2
        assert harness.tx(lambda s: s.settle("new", new, ids[0], attempt, "processed",
                                             server_status=200, server_ack=None))

    def test_inflight_row_can_be_failed_or_requeued_by_the_new_holder(self, harness: Harness) -> None:
        """Non-replaying server: failed for review, or queued again on guaranteed-delivery channels."""
        ids = queue_n(harness, 2)
        old = acquire(harness, holder("old", pid=dead_pid()))
        send(harness, "old", old, ids[0])
        new = acquire(harness, holder("new"))
        assert harness.tx(lambda s: s.requeue("new", new, ids[0], 1, 0.0, error_code="ambiguous"))
        assert harness.row(ids[0])["state"] == "queued"
        attempt = send(harness, "new", new, ids[0])
        assert harness.tx(lambda s: s.fail_live("new", new, ids[0], attempt, "failed",
                                                error_code="ambiguous", error_text="unknown"))
        row = harness.row(ids[0])
        assert (row["state"], row["error_code"]) == ("failed", "ambiguous")
        assert harness.store.channel_head("adt").id == ids[1]  # type: ignore[union-attr]


class TestChannelsAndStats:
    def test_pause_and_resume_are_durable_flags(self, harness: Harness) -> None:
        """pause_channel sets the flag (also for a channel with no rows yet); resume clears it."""
        harness.tx(lambda s: s.pause_channel("adt", "rejected row"))
        assert harness.store.paused_channels() == {"adt"}
        queue_n(harness, 1, "adt")
        assert harness.store.paused_channels() == {"adt"}
        harness.tx(lambda s: s.resume_channel("adt"))
        assert harness.store.paused_channels() == set()

    def test_the_head_comes_with_its_channels_pause_flag(self, harness: Harness) -> None:
        """channel_head_and_pause: the head and the flag of its own channel, in one read."""
        assert harness.store.channel_head_and_pause("adt") == (None, False)
        ids = queue_n(harness, 1, "adt")
        queue_n(harness, 1, "lab")
        head, paused = harness.store.channel_head_and_pause("adt")
        assert head is not None and head.id == ids[0] and head == harness.store.channel_head("adt")
        assert paused is False
        harness.tx(lambda s: s.pause_channel("adt", "rejected row"))
        assert harness.store.channel_head_and_pause("adt")[1] is True
        assert harness.store.channel_head_and_pause("lab")[1] is False
        harness.tx(lambda s: s.resume_channel("adt"))
        assert harness.store.channel_head_and_pause("adt")[1] is False

    def test_pausing_a_fresh_channel_keeps_seq_numbering_from_one(self, harness: Harness) -> None:
        """A pause before any intake does not disturb the seq counter."""
        harness.tx(lambda s: s.pause_channel("new", "operator"))
        ids = queue_n(harness, 2, "new")
        assert [harness.row(i)["seq"] for i in ids] == [1, 2]

    def test_stats_shape_and_counts(self, harness: Harness) -> None:
        """stats() has every state, per-channel live counts and oldest age, the lease and db sizes."""
        ids = queue_n(harness, 3, "adt")
        queue_n(harness, 1, "lab")
        epoch = acquire(harness, holder("h1"))
        attempt = send(harness, "h1", epoch, ids[0])
        harness.tx(lambda s: s.settle("h1", epoch, ids[0], attempt, "processed", server_status=200,
                                      server_ack=None))
        harness.tx(lambda s: s.claim("h1", epoch, ids[1]))
        harness.tx(lambda s: s.pause_channel("lab", "x"))
        harness.clock.advance(10)
        stats = harness.store.stats(["adt", "lab", "idle"])
        assert set(stats) >= {"states", "channels", "lease", "db"}
        assert stats["states"] == {"queued": 2, "claimed": 1, "inflight": 0, "processed": 1,
                                   "rejected": 0, "failed": 0, "nacked": 0}
        adt = stats["channels"]["adt"]
        assert (adt["queued"], adt["claimed"], adt["inflight"], adt["paused"]) == (1, 1, 0, False)
        assert adt["oldest_queued_age_s"] is not None and adt["oldest_queued_age_s"] >= 0
        assert stats["channels"]["lab"]["paused"] is True
        assert stats["channels"]["idle"] == {"queued": 0, "claimed": 0, "inflight": 0,
                                             "oldest_queued_age_s": None, "paused": False}
        assert stats["lease"]["holder"] == "h1" and stats["lease"]["epoch"] == epoch
        assert stats["lease"]["expires_at"].endswith("Z")
        assert stats["db"]["size_bytes"] > 0

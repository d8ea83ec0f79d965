"""The kill -9 loop: 20 crashes at random points under load, a flaky server, and the promise holds.

The daemon runs as a subprocess on one data_dir (its queue in SQLite there, or in the
session's PostgreSQL server: the test runs on both backends); senders keep sending unique messages and
resend the same bytes on any failure until they hold an AA/CA, as interface engines do; the
dev server answers mostly 200, sometimes 503, sometimes slowly, sometimes closes the session
(after processing or before), and replays. Twenty times, at a random point, the daemon gets
SIGKILL and is started again on the same data_dir. Then everything drains, and what an
accept ACK promises is checked against the database, the server's records and the senders'.

The kill points come from ``random.Random(seed)``; the seed is printed and is set with
``KILL_LOOP_SEED=<n>`` to replay a failure. Timing (the machine's load) still varies between
runs, so a replay repeats the choices, not every interleaving.
"""

from __future__ import annotations

import itertools
import os
import random
import sqlite3
import statistics
import time
import urllib.error
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

from agent.app.devserver import Answer, default_answer
from agent.core.protocol import Transmit
from tests.agenttest import (
    ACCEPT_CODES,
    Daemon,
    DevServerThread,
    ResendingSender,
    db_rows,
    free_port,
    http_get,
    toml_config,
)

pytestmark = pytest.mark.slow

SEED_ENV = "KILL_LOOP_SEED"
#: 20 in CI; a longer soak by hand: KILL_LOOP_CYCLES=200 (the timeout grows with it).
CYCLES = int(os.environ.get("KILL_LOOP_CYCLES") or 20)
#: Short, so an answer slower than it (a resend after a response timeout) costs little time.
RESPONSE_TIMEOUT = 2.0

#: (name, channel settings, senders on it, enhanced mode)
CHANNELS: list[tuple[str, dict[str, Any], tuple[str, ...], bool]] = [
    ("adt", {"ack": "commit"}, ("lab", "ris"), False),
    ("enh", {"ack": "commit"}, ("pacs", "ecg"), True),
    # With a replaying server no row is ever ambiguous, so guaranteed_delivery must change
    # nothing here: the same promise, checked on a channel that has it set.
    ("gd", {"ack": "commit", "guaranteed_delivery": True}, ("pharm",), False),
]


class FlakyUpstream:
    """``decide`` for the dev server: mostly 200, sometimes 503, slow, or a closed session.

    Runs on the server's loop thread only, so its own seeded Random draws in arrival order.
    Session closes are spaced out (the agent's reconnect backoff doubles with each one); once
    ``calm`` is set (the drain) no more closes or answers slower than the response timeout.
    """

    CLOSE_SPACING = 2.0

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.calm = False
        self.kinds: Counter[str] = Counter()
        self._last_close = 0.0

    def _may_close(self) -> bool:
        if self.calm or time.monotonic() - self._last_close < self.CLOSE_SPACING:
            return False
        self._last_close = time.monotonic()
        return True

    async def __call__(self, t: Transmit) -> Answer:
        ok = default_answer(t)
        r = self.rng.random()
        if r < 0.08:
            kind, answer = "503", Answer(503)
        elif r < 0.16:
            kind, answer = "slow", Answer(ok.status, ok.ack, delay=self.rng.uniform(0.05, 0.4))
        elif r < 0.165 and not self.calm:
            kind, answer = "slower_than_timeout", Answer(ok.status, ok.ack, delay=RESPONSE_TIMEOUT + 0.3)
        elif r < 0.19 and self._may_close():
            kind, answer = "close_after_processing", Answer(ok.status, ok.ack, close=True)
        elif r < 0.20 and self._may_close():
            kind, answer = "close_before_processing", Answer(503, close=True)
        else:
            kind, answer = "200", ok
        self.kinds[kind] += 1
        return answer


@dataclass
class Cycle:
    mode: str  # "startup", "takeover", "dispatch" or "exchange" (see the loop)
    alive_s: float
    ready_s: float | None = None  # spawn -> /readyz 200
    dispatching_s: float | None = None  # spawn -> the lease held by this PID
    transmits: int = 0  # transmits the server received from this process
    exchange_hit: bool = False  # killed while a sender had a message unanswered
    wal_bytes: int = 0  # the WAL the kill left for the next start to recover


@dataclass
class Run:
    seed: int
    cycles: list[Cycle] = field(default_factory=list)
    final_ready_s: float | None = None
    drain_s: float = 0.0
    total_s: float = 0.0


def ready(admin_port: int) -> bool:
    try:
        status, _ = http_get(f"http://127.0.0.1:{admin_port}/readyz", timeout=1.0)
    except (urllib.error.URLError, OSError):
        return False
    return status == 200


def ro_rows(db: Path, sql: str) -> list[tuple[Any, ...]]:
    """Read the database without writing to it.

    A read-write connection that is the last one to close checkpoints the WAL and deletes it
    (SQLite, "Write-Ahead Logging"): reading between a kill and the restart that way would
    hand the next daemon a clean file instead of the hot WAL a crash leaves.
    """
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


@dataclass
class QueueReads:
    """The test's reads of the queue: SQLite's file (read-only between kills, see ro_rows),
    or a session of its own on the PostgreSQL database the daemons use."""

    db: Path
    pg: Any = None  # conftest.PgDatabase on the postgresql backend

    def between_kills(self, sql: str) -> list[tuple[Any, ...]]:
        return self.pg.rows(sql) if self.pg is not None else ro_rows(self.db, sql)

    def rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        if self.pg is not None:
            return self.pg.rows(sql.replace("?", "%s"), params)
        return db_rows(self.db, sql, params)


def lease_pid(reads: QueueReads) -> int | None:
    """PID of the live lease holder, or None."""
    try:
        found = reads.between_kills("SELECT holder_pid, expires_at FROM lease WHERE name = 'dispatch'")
    except (sqlite3.Error, psycopg.Error):  # not created yet, or busy during the first migration
        return None
    if not found or found[0][0] is None or (found[0][1] or 0) <= time.time():
        return None
    return int(found[0][0])


def poll(predicate: Any, timeout: float, interval: float = 0.01) -> bool:
    """Poll until ``predicate()`` holds or ``timeout`` passes; False then (the caller decides)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


@pytest.fixture
def senders() -> Iterator[list[ResendingSender]]:
    started: list[ResendingSender] = []
    yield started
    for s in started:
        s.stop()
    for s in started:
        s.join(30)


@pytest.mark.timeout(max(120, CYCLES * 6))
@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_kill_nine_loop_keeps_the_promise(
    tmp_path: Path, daemons: list[Daemon], senders: list[ResendingSender], backend: str,
    request: pytest.FixtureRequest,
) -> None:
    """20 x SIGKILL at random points under load: every AA/CA'd message is processed once, in order."""
    pg = request.getfixturevalue("pg_database") if backend == "postgresql" else None
    reads = QueueReads(tmp_path / "data" / "queue.db", pg)
    seed = int(os.environ.get(SEED_ENV) or random.SystemRandom().randrange(1 << 31))
    replay_hint = f"kill loop seed {seed}: replay with {SEED_ENV}={seed}"
    print(replay_hint)
    rng = random.Random(seed)
    flaky = FlakyUpstream(rng.randrange(1 << 31))
    server = DevServerThread(decide=flaky, replay=True).start()
    try:
        run = _kill_loop(tmp_path, server, flaky, rng, daemons, senders, Run(seed), reads)
        _assert_the_promise(reads, server, senders)
        _assert_clean_logs(daemons)
        _report(run, daemons, senders, server, flaky, backend)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{replay_hint}") from exc
    finally:
        for s in senders:
            s.stop()
        for d in daemons:
            d.kill()
        server.stop()


def _kill_loop(tmp_path: Path, server: DevServerThread, flaky: FlakyUpstream, rng: random.Random,
               daemons: list[Daemon], senders: list[ResendingSender], run: Run, reads: QueueReads) -> Run:
    ports = {name: free_port() for name, *_ in CHANNELS}
    admin_port = free_port()
    text = toml_config(
        tmp_path / "data",
        [{"name": name, "listen": f"127.0.0.1:{ports[name]}", **settings} for name, settings, *_ in CHANNELS],
        server_url=server.url, admin_port=admin_port,
        extra=reads.pg.queue_toml(tmp_path) if reads.pg is not None else "",
    )
    assert "response_timeout = 5\n" in text
    text = text.replace("response_timeout = 5\n", f"response_timeout = {RESPONSE_TIMEOUT}\n")
    db = tmp_path / "data" / "queue.db"
    began = time.monotonic()

    def spawn(n: int) -> tuple[Daemon, float]:
        d = Daemon(tmp_path, text, name=f"run{n:02d}").start()
        daemons.append(d)
        return d, time.monotonic()

    first, spawned = spawn(0)
    assert poll(lambda: ready(admin_port), 30), f"first daemon not ready:\n{first.log_tail()}"
    for name, _settings, names, enhanced in CHANNELS:
        for sender in names:
            s = ResendingSender(sender, ports[name], enhanced=enhanced, pace=0.1, give_up_after=60)
            senders.append(s)
            s.start()

    current = first
    for n in range(CYCLES):
        received_before = len(server.server.received)
        draw = rng.random()
        mode = ("startup" if n > 0 and draw < 0.1 else "takeover" if n > 0 and draw < 0.2
                else "exchange" if draw < 0.6 else "dispatch")
        cycle = Cycle(mode=mode, alive_s=0.0)
        if mode == "startup":
            # Killed while it comes up (imports, migration check, binding, lease).
            # The sleep *is* the random kill point, not a wait for something.
            time.sleep(max(0.0, spawned + rng.uniform(0.05, 1.0) - time.monotonic()))
        elif mode == "takeover":
            # Killed just after it took the lease: recovery of claimed rows, session opening,
            # the first resend of the inflight heads.
            pid = current.pid
            poll(lambda: lease_pid(reads) == pid, 30, interval=0.002)  # noqa: B023
            time.sleep(rng.uniform(0, 0.05))  # the random kill point
        else:
            assert poll(lambda: ready(admin_port), 30), f"cycle {n} not ready:\n{current.log_tail()}"
            cycle.ready_s = time.monotonic() - spawned
            pid = current.pid
            assert poll(lambda: lease_pid(reads) == pid, 30), f"cycle {n}: lease not taken:\n{current.log_tail()}"  # noqa: B023
            cycle.dispatching_s = time.monotonic() - spawned
            # Under load: once a random number of further transmits reached the server (polled
            # every few ms, so the kill lands anywhere in a dispatch step), or after 3 s ...
            target = len(server.server.received) + rng.randint(1, 15)
            poll(lambda: len(server.server.received) >= target, 3.0, interval=0.003)  # noqa: B023
            if mode == "exchange":
                # ... and then while a sender waits for its ACK: the frame is being read,
                # committed or answered — where a stored message can miss its ACK.
                poll(lambda: any(s.awaiting_ack.is_set() for s in senders), 2.0, interval=0.0005)
                time.sleep(rng.uniform(0, 0.004))  # the random point within that exchange
                cycle.exchange_hit = any(s.awaiting_ack.is_set() for s in senders)
        assert current.proc is not None and current.proc.poll() is None, (
            f"cycle {n}: the daemon died by itself:\n{current.log_tail()}")
        current.kill()
        cycle.alive_s = time.monotonic() - spawned
        wal = db.with_name(db.name + "-wal")
        cycle.wal_bytes = wal.stat().st_size if wal.exists() else 0
        _assert_accepted_are_stored(reads, senders, f"after kill {n + 1}")
        cycle.transmits = len(server.server.received) - received_before
        run.cycles.append(cycle)
        current, spawned = spawn(n + 1)

    assert poll(lambda: ready(admin_port), 30), f"final daemon not ready:\n{current.log_tail()}"
    run.final_ready_s = time.monotonic() - spawned
    drain_from = time.monotonic()
    for s in senders:
        s.stop()
    for s in senders:
        s.join(60)
        assert not s.is_alive(), f"sender {s.sender} did not finish its last message"
        assert s.error is None, f"sender {s.sender}: {s.error!r}"
    flaky.calm = True
    accepted = sum(len(s.accepted) for s in senders)

    def drained() -> bool:
        live = reads.rows("SELECT count(*) FROM messages WHERE state IN ('queued', 'claimed', 'inflight')")
        return live == [(0,)]

    if not poll(drained, 60, interval=0.1):
        states = reads.rows("SELECT state, count(*) FROM messages GROUP BY state")
        raise AssertionError(f"not drained: {states} for {accepted} accepted\n{current.log_tail()}")
    run.drain_s = time.monotonic() - drain_from
    assert current.stop() == 0, current.log_tail()
    run.total_s = time.monotonic() - began
    return run


def _assert_accepted_are_stored(reads: QueueReads, senders: list[ResendingSender], when: str) -> None:
    """Every AA/CA read so far came after its COMMIT: the row is there with the daemon dead.

    A sender records an accept only after reading it, so a list taken after the kill holds
    nothing the dead process did not answer.
    """
    accepted = {(s.sender.upper(), cid) for s in senders for cid in list(s.accepted)}
    stored = set(reads.between_kills("SELECT sending_app, control_id FROM messages WHERE state <> 'nacked'"))
    missing = sorted(accepted - stored)
    assert not missing, f"{when}: accepted but not stored: {missing[:20]}"


def _assert_clean_logs(daemons: list[Daemon]) -> None:
    """No daemon logged an error or a traceback: a dying task would show here first."""
    for d in daemons:
        errors = [e for e in d.events() if e.get("level") in ("error", "critical")]
        assert not errors, f"{d.log_path.name}: {errors[:5]}"
        text = d.log_path.read_text(errors="replace") if d.log_path.exists() else ""
        assert "Traceback" not in text, f"{d.log_path.name}:\n{d.log_tail()}"


def _assert_the_promise(reads: QueueReads, server: DevServerThread, senders: list[ResendingSender]) -> None:
    """The promise of an accept ACK, checked against three independent records."""
    rows = reads.rows("SELECT id, channel, sending_app, control_id, seq, state, error_code "
                      "FROM messages WHERE state <> 'nacked'")
    nacked = reads.rows("SELECT channel, control_id, error_code, error_text FROM messages "
                        "WHERE state = 'nacked'")
    by_key: dict[tuple[str, str], list[tuple[Any, ...]]] = {}
    for r in rows:
        by_key.setdefault((r[1], r[3]), []).append(r)
    channel_of = {sender: name for name, _s, names, _e in CHANNELS for sender in names}
    accepted = {(channel_of[s.sender], cid): s.sender for s in senders for cid in s.accepted}

    # 1. Every accepted message is in the database once, and nothing else is. No row may stand
    #    failed/rejected here: the server never answers 4xx (no `rejected`), max_attempts is 0
    #    (no `failed` for exhausted retries), the server replays (no `ambiguous`), messages are
    #    small and well-formed (no 207 size or 102 charset refusals), no operator acts.
    twice = {k: len(v) for k, v in by_key.items() if len(v) > 1}
    assert not twice, f"a control id has more than one row: {twice}"
    missing = sorted(set(accepted) - set(by_key))
    assert not missing, f"accepted but not in the database: {missing[:20]}"
    unasked = sorted(set(by_key) - set(accepted))
    assert not unasked, f"rows no sender holds an accept for: {unasked[:20]}"
    not_processed = [r for r in rows if r[5] != "processed"]
    assert not not_processed, f"accepted rows not processed: {not_processed[:20]}"
    assert not nacked, f"audit rows for well-formed messages: {nacked[:20]}"

    # 2. Delivered once in effect: each row's id was answered 2xx by the server; no control id
    #    reached the server under a second id (a replay of one id is fine; two ids is a duplicate).
    answered = list(server.server.answered)  # insertion order: first 2xx processing of each id
    received = list(server.server.received)
    meta = {t.id: t for t in received}
    row_ids = {r[0] for r in rows}
    assert set(answered) == row_ids, (
        f"2xx-answered ids differ from the rows: {len(set(answered) - row_ids)} unknown, "
        f"{len(row_ids - set(answered))} never processed")
    ids_per_control: dict[tuple[str, str], set[str]] = {}
    for t in received:
        ids_per_control.setdefault((t.channel, t.control_id), set()).add(t.id)
    dup = {k: v for k, v in ids_per_control.items() if len(v) > 1}
    assert not dup, f"one message reached the server under two ids: {dup}"

    # 3. Order per channel: seq gap-free 1..N; the server's first processing follows seq, and
    #    no transmit ever went back to an earlier seq; each sender's messages in its send order.
    seq_of = {r[0]: r[4] for r in rows}
    for name, *_ in CHANNELS:
        seqs = sorted(r[4] for r in rows if r[1] == name)
        assert seqs == list(range(1, len(seqs) + 1)), f"{name}: seq not gap-free"
        last_seq = reads.rows("SELECT last_seq FROM channels WHERE channel = ?", (name,))
        assert last_seq == [(len(seqs),)], f"{name}: counter {last_seq} for {len(seqs)} rows"
        first = [seq_of[i] for i in answered if meta[i].channel == name]
        if first != seqs:
            at = next(i for i, (a, b) in enumerate(zip(first, seqs, strict=False)) if a != b)
            raise AssertionError(f"{name}: first processing out of seq order at position {at}: "
                                 f"{first[max(0, at - 3):at + 4]} (seqs {seqs[max(0, at - 3):at + 4]})")
        arrivals = [t.seq for t in received if t.channel == name]
        backwards = [(a, b) for a, b in itertools.pairwise(arrivals) if b < a]
        assert not backwards, f"{name}: a transmit went back to an earlier seq: {backwards[:10]}"
    row_of = {(r[1], r[3]): r for r in rows}
    for s in senders:
        sent_seqs = [row_of[(channel_of[s.sender], cid)][4] for cid in s.accepted]
        assert sent_seqs == sorted(sent_seqs), f"{s.sender}: seq not in send order"

    # 4. No accept and then an error for the same control id; commit ACKs are accepts or
    #    "resend later" only (AR/CE with ERR-3 207), each for the message just sent.
    for s in senders:
        assert not s.stray, f"{s.sender}: commit ACKs for another control id: {s.stray[:5]}"
        accepted_at: dict[str, float] = {}
        for ack in s.acks:
            if ack.level == "commit" and ack.code in ACCEPT_CODES:
                accepted_at.setdefault(ack.control_id, ack.at)
            elif ack.level == "commit":
                assert ack.code in ("AR", "CE") and ack.error == "207", f"{s.sender}: {ack}"
            if ack.control_id in accepted_at and ack.code not in ACCEPT_CODES:
                raise AssertionError(f"{s.sender}: {ack.code} after an accept for {ack.control_id}")
        if s.enhanced:
            app_codes = Counter(a.code for a in s.acks if a.level == "application")
            assert set(app_codes) <= {"AA"}, f"{s.sender}: application ACKs {app_codes}"


def _report(run: Run, daemons: list[Daemon], senders: list[ResendingSender], server: DevServerThread,
            flaky: FlakyUpstream, backend: str = "sqlite") -> None:
    """Figures for docs/reliability.md (pytest -s shows them; -rP too)."""
    ready_times = [c.ready_s for c in run.cycles if c.ready_s is not None]
    lease_times = [c.dispatching_s for c in run.cycles if c.dispatching_s is not None]
    failures: Counter[str] = Counter()
    for s in senders:
        failures.update(s.failures)
    accepted = sum(len(s.accepted) for s in senders)

    def spread(values: list[float]) -> str:
        if not values:
            return "n/a"
        return f"min {min(values):.2f} s, median {statistics.median(values):.2f} s, max {max(values):.2f} s"

    print(f"backend {backend}; seed {run.seed}; {len(run.cycles)} kill -9 cycles "
          f"({dict(Counter(c.mode for c in run.cycles))}, "
          f"{sum(c.exchange_hit for c in run.cycles)} with a sender waiting for its ACK), "
          f"total {run.total_s:.1f} s, {run.total_s / len(run.cycles):.2f} s per cycle, drain {run.drain_s:.1f} s")
    from_dedupe = sum(1 for d in daemons for e in d.events() if e.get("event") == "retransmit_answered_from_dedupe")
    print(f"messages: {accepted} accepted (AA/CA), {sum(s.frames_written for s in senders)} frames written "
          f"by senders, {from_dedupe} retransmits answered from dedupe (stored, ACK lost to the kill), "
          f"sender failures {dict(failures)}")
    print(f"server: {len(server.server.received)} transmits received, {len(server.server.answered)} ids "
          f"processed, answers {dict(flaky.kinds)}")
    print(f"spawn -> /readyz 200: {spread(ready_times)}; spawn -> lease held: {spread(lease_times)}; "
          f"final start-up {run.final_ready_s:.2f} s")
    print(f"per killed process: alive {spread([c.alive_s for c in run.cycles])}; transmits received "
          f"median {statistics.median(c.transmits for c in run.cycles):.0f}, max {max(c.transmits for c in run.cycles)}")
    if backend == "sqlite":
        print(f"a WAL file left for the restart by {sum(1 for c in run.cycles if c.wal_bytes)} of "
              f"{len(run.cycles)} kills")

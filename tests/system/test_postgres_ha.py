"""Two agents as two hosts on one PostgreSQL queue: failover with nothing lost (docs/ha.md).

Each agent is a real daemon process with its own data_dir, MLLP port and
admin address, both configured with the same ``agent.id`` and ``queue.dsn``
(the session's real PostgreSQL server), both taking intake; one real dev
server upstream. The faults are real: a holder stopped with SIGSTOP past
the TTL and resumed, a holder killed with SIGKILL, the database server
stopped and started under load. "Another host" is another PID namespace
(``unshare --pid``): a process there cannot be proven dead from here, which
is all that tells two hosts apart to the lease. Afterwards every ACKed
message was delivered exactly once in effect, in order per channel, with
``seq`` gap-free per channel.

The figures printed (takeover and recovery times) are the ones docs/ha.md
quotes; run ``pytest -s tests/system/test_postgres_ha.py`` to see them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from agenttest import (
    REPO_ROOT,
    Daemon,
    DevServerThread,
    MllpClient,
    ResendingSender,
    ack_code,
    free_port,
    hl7_message,
    http_get,
    toml_config,
    wait_for,
)
from pgserver import PgDatabase

pytestmark = pytest.mark.slow

AGENT_ID = "ha-agent"
FAULTS = str(REPO_ROOT / "tests" / "faults")
TTL = 6.0  # tests/agenttest.py's toml_config: lease_ttl = 6, heartbeat 2, acquire interval 0.5
HEARTBEAT = 2.0
#: A lease expires TTL after its last renewal, and that renewal came up to a heartbeat before
#: the holder died or froze: a takeover after the TTL comes between these bounds after it.
AFTER_TTL = (TTL - HEARTBEAT - 0.5, TTL + 5.0)


class OtherHostDaemon(Daemon):
    """A daemon in a PID namespace of its own: to the lease, a process on another host.

    ``unshare --kill-child`` passes a SIGKILL on to the daemon; SIGSTOP and
    SIGCONT go to the daemon itself (:attr:`agent_pid`).
    """

    def start(self) -> OtherHostDaemon:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
             sys.executable, "-m", "agent", "run", "--config", str(self.config)],
            stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.dir,
        )
        log.close()
        return self

    @property
    def agent_pid(self) -> int:
        children = wait_for(lambda: Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text().split(),
                            10, what="the daemon inside the namespace")
        return int(children[0])


@dataclass
class Host:
    name: str
    daemon: Daemon
    port: int
    admin_port: int

    @property
    def pid(self) -> int:
        return self.daemon.agent_pid if isinstance(self.daemon, OtherHostDaemon) else self.daemon.pid

    def ready(self) -> int:
        try:
            return http_get(f"http://127.0.0.1:{self.admin_port}/readyz", timeout=5)[0]
        except OSError:
            return 0


def config_for(tmp_path: Path, name: str, db: PgDatabase, server_url: str, port: int, admin_port: int,
               lab_port: int) -> str:
    queue = db.queue_toml(tmp_path)
    return toml_config(tmp_path / name, [{"name": "adt", "listen": f"127.0.0.1:{port}"},
                                         {"name": "lab", "listen": f"127.0.0.1:{lab_port}"}],
                       agent_id=AGENT_ID, server_url=server_url, admin_port=admin_port, extra=queue)


@pytest.fixture
def dev() -> Iterator[DevServerThread]:
    server = DevServerThread(track_epochs=True).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def make_host(tmp_path: Path, pg_database: PgDatabase, dev: DevServerThread) -> Iterator[Any]:
    made: list[Host] = []

    def make(name: str, *, other_host: bool = False, env: dict[str, str] | None = None) -> Host:
        if other_host and shutil.which("unshare") is None:
            pytest.fail("unshare (util-linux) is needed to run a daemon as on another host")
        port, lab_port, admin_port = free_port(), free_port(), free_port()
        text = config_for(tmp_path, name, pg_database, dev.url, port, admin_port, lab_port)
        cls = OtherHostDaemon if other_host else Daemon
        host = Host(name, cls(tmp_path, text, name=name, env=env), port, admin_port)
        host.lab_port = lab_port  # type: ignore[attr-defined]
        made.append(host)
        return host

    try:
        yield make
    finally:
        for host in made:
            if host.daemon.proc is not None and host.daemon.proc.poll() is None:
                try:
                    os.kill(host.pid, signal.SIGCONT)
                except (ProcessLookupError, AssertionError):
                    pass
            host.daemon.stop()


def event_time(daemon: Daemon, name: str, **match: Any) -> float:
    """The Unix time of the last log event ``name`` (the daemon's own timestamp)."""
    found = [e for e in daemon.events() if e.get("event") == name
             and all(e.get(k) == v for k, v in match.items())]
    assert found, daemon.log_tail()
    return datetime.fromisoformat(found[-1]["timestamp"].replace("Z", "+00:00")).timestamp()


def send(port: int, control_id: str, pid: str = "1") -> bytes:
    with MllpClient(port, timeout=15) as client:
        ack = client.exchange(hl7_message(control_id, pid=pid))
    assert ack_code(ack) == "AA", ack
    return ack


def answered_ids(dev: DevServerThread) -> set[str]:
    return set(dev.server.answered)


def check_delivered_once_in_order(db: PgDatabase, dev: DevServerThread, accepted: set[str],
                                  timeout: float = 60) -> dict[str, int]:
    """Every accepted control id: one row, processed, answered by the server; first deliveries in
    seq order per channel; seq 1..n per channel. Returns the row count per channel."""

    def rows() -> list[tuple[Any, ...]]:
        return db.rows("SELECT id, channel, seq, state, control_id FROM messages WHERE seq IS NOT NULL")

    wait_for(lambda: all(r[3] == "processed" for r in rows()) and {r[4] for r in rows()} >= accepted,
             timeout, interval=0.1, what="every accepted message processed")
    found = rows()
    by_control: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    for row in found:
        by_control[str(row[4])].append(row)
    assert all(len(v) == 1 for v in by_control.values()), "a message was queued twice"
    assert accepted <= set(by_control)
    ids = {str(r[0]) for r in found}
    assert ids <= answered_ids(dev), "a processed row was never answered by the server"
    seq_of = {str(r[0]): (str(r[1]), int(r[2])) for r in found}
    per_channel: dict[str, list[int]] = defaultdict(list)
    for channel, seq in seq_of.values():
        per_channel[channel].append(seq)
    for channel, seqs in per_channel.items():
        assert sorted(seqs) == list(range(1, len(seqs) + 1)), f"{channel}: seq has gaps"
    firsts: dict[str, list[int]] = defaultdict(list)
    seen: set[str] = set()
    for t in list(dev.server.received):
        if t.id in seq_of and t.id not in seen:
            seen.add(t.id)
            firsts[t.channel].append(t.seq)
    for channel, order in firsts.items():
        assert order == sorted(order), f"{channel}: delivered out of order"
    return {c: len(s) for c, s in per_channel.items()}


def holder_of(*hosts: Host) -> Host:
    return wait_for(lambda: next((h for h in hosts if h.daemon.has_event("lease_acquired")), None), 20,
                    what="one host to take the lease")


class TestTwoHosts:
    def test_both_hosts_take_intake_one_dispatches_and_dedupe_holds_across_them(
        self, make_host: Any, pg_database: PgDatabase, dev: DevServerThread
    ) -> None:
        """Senders on both hosts, two channels; a retransmit to the other host is answered with the
        original ACK byte for byte; one host holds the lease; all delivered once, in order."""
        a, b = make_host("a"), make_host("b")
        a.daemon.start().wait_started()
        b.daemon.start().wait_started()
        holder = holder_of(a, b)
        accepted: set[str] = set()
        acks: dict[str, bytes] = {}
        for i in range(20):
            for host in (a, b):
                cid = f"{host.name.upper()}{i:03d}"
                port = host.port if i % 2 else host.lab_port  # type: ignore[attr-defined]
                acks[cid] = send(port, cid)
                accepted.add(cid)
        # The sender fails over and resends A007 (adt) to host b: the original answer, no second row.
        again = send(b.port, "A007")
        assert again == acks["A007"]
        counts = check_delivered_once_in_order(pg_database, dev, accepted)
        assert counts == {"adt": 20, "lab": 20}
        assert [h.name for h in (a, b) if h.daemon.has_event("lease_acquired")] == [holder.name]
        assert a.ready() == 200 and b.ready() == 200

    def test_a_holder_frozen_past_the_ttl_is_fenced_when_it_wakes(
        self, make_host: Any, pg_database: PgDatabase, dev: DevServerThread
    ) -> None:
        """The holder stops (SIGSTOP) between its inflight commit and its write; the other host takes
        over after the TTL, resends, goes on; the old holder, resumed, gets nothing through."""
        frozen_at = "F03"
        a = make_host("a", env={"PYTHONPATH": FAULTS, "HL7TEST_FREEZE_BEFORE_TRANSMIT": frozen_at})
        b = make_host("b")
        a.daemon.start().wait_started()
        a.daemon.wait_event("lease_acquired")
        b.daemon.start().wait_started()
        for cid in ("F01", "F02", frozen_at):
            send(a.port, cid)
        wait_for(lambda: proc_state(a.pid) == "T", 15, what="the holder to stop before its write")
        stopped_at = time.time()
        b.daemon.wait_event("lease_acquired", timeout=30)
        takeover = event_time(b.daemon, "lease_acquired") - stopped_at
        for cid in ("F04", "F05"):
            send(b.port, cid)
        wait_for(lambda: {"F04", "F05"} <= {t.control_id for t in dev.server.received
                                            if t.id in dev.server.answered}, 20, what="F04, F05 answered")
        os.kill(a.pid, signal.SIGCONT)
        wait_for(lambda: a.daemon.has_event("lease_lost") or a.daemon.has_event("dispatch_paused_epoch_refused")
                 or a.daemon.has_event("lease_validity_lapsed"), 20, what="the old holder to end its tenure")
        wait_for(lambda: dev.server.active_sessions == 1, 20, what="the old session to end")
        check_delivered_once_in_order(pg_database, dev, {f"F0{i}" for i in range(1, 6)})
        timeline = list(dev.server.timeline)
        sessions = {a2.session for a2 in timeline if a2.kind == "transmit" and a2.transmit is not None
                    and a2.transmit.control_id == "F01"}
        new_session = next(a2.session for a2 in timeline if a2.kind == "transmit" and a2.transmit is not None
                           and a2.transmit.control_id == "F04")
        new_hello = next(i for i, a2 in enumerate(timeline) if a2.kind == "hello" and a2.session == new_session)
        stale = [a2 for a2 in timeline[new_hello:] if a2.kind == "transmit" and a2.session in sessions]
        assert stale == []
        assert "F03" in {t.control_id for t in dev.server.received if t.id in dev.server.answered}
        print(f"frozen holder: the other host took over {takeover:.2f}s after the freeze (lease_ttl {TTL:g}s)")
        assert AFTER_TTL[0] < takeover < AFTER_TTL[1]

    @pytest.mark.parametrize("other_host", [False, True], ids=["same-host", "other-host"])
    def test_a_holder_killed_with_sigkill_is_replaced(
        self, make_host: Any, pg_database: PgDatabase, dev: DevServerThread, other_host: bool
    ) -> None:
        """kill -9 of the holder: a standby on the same host proves it dead and takes over at once;
        one on another host waits out the TTL. Messages sent meanwhile are delivered, once, in order."""
        a, b = make_host("a", other_host=other_host), make_host("b")
        a.daemon.start().wait_started()
        a.daemon.wait_event("lease_acquired")
        b.daemon.start().wait_started()
        accepted = set()
        for i in range(5):
            accepted.add(f"K{i}")
            send(a.port, f"K{i}")
        wait_for(lambda: len(answered_ids(dev)) >= 5, 20, what="the first five delivered")
        killed_at = time.time()
        a.daemon.kill()
        for i in range(5, 10):
            accepted.add(f"K{i}")
            send(b.port, f"K{i}")
        b.daemon.wait_event("lease_acquired", timeout=30)
        takeover = event_time(b.daemon, "lease_acquired") - killed_at
        check_delivered_once_in_order(pg_database, dev, accepted)
        where = "another host" if other_host else "the same host"
        print(f"holder killed (-9) on {where}: taken over after {takeover:.2f}s (lease_ttl {TTL:g}s)")
        if other_host:
            assert AFTER_TTL[0] < takeover < AFTER_TTL[1]
        else:
            assert takeover < AFTER_TTL[0]  # before the lease could have expired

    def test_the_database_stopped_and_started_under_load(
        self, make_host: Any, pg_database: PgDatabase, dev: DevServerThread
    ) -> None:
        """Senders on both hosts resend until accepted; the database goes away for a few seconds and
        comes back: /readyz fails meanwhile, intake resumes by itself, nothing accepted is lost."""
        a, b = make_host("a"), make_host("b")
        a.daemon.start().wait_started()
        b.daemon.start().wait_started()
        holder_of(a, b)
        senders = [ResendingSender("sa", a.port, pace=0.02), ResendingSender("sb", b.port, pace=0.02),
                   ResendingSender("sl", b.lab_port, pace=0.02)]  # type: ignore[attr-defined]
        for s in senders:
            s.start()
        try:
            wait_for(lambda: all(len(s.accepted) >= 10 for s in senders), 30, what="traffic flowing")
            pg_database.server.stop()
            try:
                wait_for(lambda: a.ready() == 503 and b.ready() == 503, 15, what="/readyz to fail on both")
                refusals = [s.failures.get("AR", 0) for s in senders]
                # A sender told "resend later" resends that message: from then on its count of
                # accepted messages may grow only when the database is back.
                wait_for(lambda: all(s.failures.get("AR", 0) > n for s, n in zip(senders, refusals, strict=True)),
                         30, what="every sender refused once")
                counts = [len(s.accepted) for s in senders]
                refusals = [s.failures.get("AR", 0) for s in senders]
                # The outage lasts until every sender was told "resend later" ten more times.
                wait_for(lambda: all(s.failures.get("AR", 0) >= n + 10 for s, n in zip(senders, refusals, strict=True)),
                         30, what="every sender refused meanwhile")
                assert [len(s.accepted) for s in senders] == counts, "a message was accepted while the database was down"
            finally:
                pg_database.server.start()
            started = time.monotonic()
            before = [len(s.accepted) for s in senders]
            wait_for(lambda: all(len(s.accepted) > n for s, n in zip(senders, before, strict=True)), 30,
                     interval=0.05, what="every sender accepted again")
            intake_back = time.monotonic() - started
            wait_for(lambda: a.ready() == 200 and b.ready() == 200, 30, interval=0.1, what="/readyz again")
            ready_back = time.monotonic() - started
            wait_for(lambda: all(len(s.accepted) >= n + 10 for s, n in zip(senders, before, strict=True)), 30,
                     what="traffic after the outage")
        finally:
            for s in senders:
                s.stop()
            for s in senders:
                s.join(60)
        for s in senders:
            assert s.error is None, s.error
        accepted = {cid for s in senders for cid in s.accepted}
        check_delivered_once_in_order(pg_database, dev, accepted, timeout=90)
        refused = sum(s.failures.get("AR", 0) for s in senders)
        print(f"database outage under load: {len(accepted)} accepted, {refused} answered AR 207 meanwhile; "
              f"intake back {intake_back:.2f}s and /readyz {ready_back:.2f}s after the server's start")
        assert refused > 0  # the senders really met the outage


def proc_state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rfind(")") + 2]

"""Is the lease holder still running? Real processes, real /proc, a real SQLite lease row.

A standby replaces a holder at once, instead of after the TTL, only when the
holder provably no longer runs on this host. These tests make the holder a
real child process and then put it in the state under test: killed and not
yet reaped (a zombie), stopped (SIGSTOP), or running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from agenttest import wait_for

from agent.storage import sqlite as db
from agent.storage.store import LeaseHolder, SqliteStore, holder_provably_dead

TTL = 300.0  # far longer than any test: only provable death can free the lease


def proc_state(pid: int) -> str:
    """Field 3 of /proc/PID/stat: R, S, T, Z ..."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rfind(")") + 2]


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    """A running child process; reaped at the end whatever state the test left it in."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqliteStore]:
    path = tmp_path / "queue.db"
    conn = db.open_database(path, "liveness-agent", db.DatabaseOptions(), 0.0)
    try:
        yield SqliteStore(conn, db.load_queries(), db_path=path)
    finally:
        conn.close()


def as_holder(proc: subprocess.Popen[bytes]) -> LeaseHolder:
    """The lease identity ``proc`` would write: this host's boot and PID namespace, its start time."""
    me = LeaseHolder.for_this_process("liveness-agent")
    stat = Path(f"/proc/{proc.pid}/stat").read_text()
    start_ticks = int(stat[stat.rfind(")") + 2 :].split()[19])
    return replace(me, holder=f"child:{proc.pid}", pid=proc.pid, start_ticks=start_ticks)


def take(store: SqliteStore, who: LeaseHolder) -> int | None:
    with store.transaction() as s:
        return s.try_acquire_lease(who, TTL)


def successor() -> LeaseHolder:
    return replace(LeaseHolder.for_this_process("liveness-agent"), holder="successor")


class TestZombieHolder:
    def test_killed_unreaped_holder_is_replaced_at_once(
        self, store: SqliteStore, child: subprocess.Popen[bytes]
    ) -> None:
        """A holder killed with SIGKILL and not yet reaped (state Z) no longer runs: a standby takes over before the TTL."""
        holder = as_holder(child)
        assert take(store, holder) == 1
        os.kill(child.pid, signal.SIGKILL)
        # Not reaped: nobody calls wait() until the fixture ends.
        wait_for(lambda: proc_state(child.pid) == "Z", 10, what="child to become a zombie")
        assert holder_provably_dead(holder.pid, holder.boot_id, holder.pidns, holder.start_ticks)
        assert take(store, successor()) == 2

    def test_stats_show_no_lease_for_a_zombie_holder(
        self, store: SqliteStore, child: subprocess.Popen[bytes]
    ) -> None:
        """queue stats: a zombie holds nothing, whatever its expiry says."""
        assert take(store, as_holder(child)) == 1
        assert store.stats()["lease"] is not None
        os.kill(child.pid, signal.SIGKILL)
        wait_for(lambda: proc_state(child.pid) == "Z", 10, what="child to become a zombie")
        assert store.stats()["lease"] is None


class TestLiveHolder:
    def test_stopped_holder_keeps_its_lease_until_the_ttl(
        self, store: SqliteStore, child: subprocess.Popen[bytes]
    ) -> None:
        """A SIGSTOPped holder (state T) may resume: it is not provably dead, so the TTL applies."""
        holder = as_holder(child)
        assert take(store, holder) == 1
        os.kill(child.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: proc_state(child.pid) == "T", 10, what="child to stop")
            assert not holder_provably_dead(holder.pid, holder.boot_id, holder.pidns, holder.start_ticks)
            assert take(store, successor()) is None
        finally:
            os.kill(child.pid, signal.SIGCONT)

    def test_running_holder_keeps_its_lease(self, store: SqliteStore, child: subprocess.Popen[bytes]) -> None:
        """A running holder with its own start time is alive."""
        holder = as_holder(child)
        assert take(store, holder) == 1
        assert not holder_provably_dead(holder.pid, holder.boot_id, holder.pidns, holder.start_ticks)
        assert take(store, successor()) is None

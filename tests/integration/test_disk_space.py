"""Disk space at the store level, on a real SQLite file: the file setup, the per-batch
reserve, and pages handed back to the filesystem (SPEC 4 backpressure, SPEC 6).

The floor tests need a filesystem whose free space nobody else changes: a small
tmpfs the test mounts (root only; skipped with the reason otherwise).
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.storage import maintenance
from agent.storage import sqlite as db
from agent.storage.store import IntakeItem, SqliteStore

MiB = 1024 * 1024


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "fs"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mnt)],
                          capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30, check=False)


def item(cid: str, size: int) -> IntakeItem:
    body = (f"MSH|^~\\&|LAB|NORTH|EHR|CENTRAL|20260101||ADT^A01|{cid}|P|2.5.1\r"
            f"PID|1||{'X' * size}\r").encode()
    return IntakeItem(channel="adt", remote="127.0.0.1:1", sending_app="LAB", sending_facility="NORTH",
                      control_id=cid, message_type="ADT^A01", body=body, encoding="utf-8",
                      ack_mode="commit", commit_ack=b"ACK")


def open_store(path: Path, **options: int) -> SqliteStore:
    conn = db.open_database(path, "unit-agent", db.DatabaseOptions(), 0.0)
    return SqliteStore(conn, db.load_queries(), db_path=path, **options)  # type: ignore[arg-type]


def pragma(store: SqliteStore, name: str) -> int:
    return int(store.conn.execute(f"PRAGMA {name}").fetchone()[0])


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_a_new_file_can_give_pages_back_and_keeps_its_wal_small(tmp_path: Path) -> None:
    """New files: incremental auto_vacuum, a WAL size limit, and FAST secure delete (not ON,
    which rewrites every freed page through the WAL)."""
    store = open_store(tmp_path / "data" / "queue.db")
    try:
        assert pragma(store, "auto_vacuum") == db.AUTO_VACUUM_INCREMENTAL
        assert pragma(store, "journal_size_limit") == db.WAL_SIZE_LIMIT
        assert pragma(store, "secure_delete") == 2  # FAST
    finally:
        store.conn.close()


def test_an_old_file_is_left_as_it_is_and_still_works(tmp_path: Path) -> None:
    """A file made before auto_vacuum is not converted (that takes a VACUUM of the whole file):
    it opens, takes messages, and release_free_pages is a no-op on it."""
    path = tmp_path / "data" / "queue.db"
    path.parent.mkdir(mode=0o700)
    legacy = sqlite3.connect(path, isolation_level=None)  # as the previous version created it
    legacy.execute("PRAGMA journal_mode = WAL")
    db.migrate(legacy, "unit-agent", 0.0)
    legacy.close()
    store = open_store(path)
    try:
        assert pragma(store, "auto_vacuum") == db.AUTO_VACUUM_NONE
        with store.transaction() as s:
            assert s.intake(item("OLD1", 100)).outcome == "accepted"
            assert maintenance.release_free_pages(s) == 0
    finally:
        store.conn.close()


def test_one_batch_cannot_take_the_disk_past_the_floor(small_fs: Path) -> None:
    """Free space is measured per commit batch and every intake of the batch is charged:
    a batch of 60 x 100 KB with 3 MiB of room above the floor accepts a few and refuses the
    rest, and the disk stays above the floor after the commit and a checkpoint."""
    path = small_fs / "data" / "queue.db"
    store = open_store(path)
    store.conn.close()
    floor = free_bytes(small_fs) - 4 * MiB - 3 * MiB  # the WAL's regular 4 MiB, then 3 MiB of room
    store = open_store(path, min_free_disk_bytes=floor)
    try:
        with store.transaction() as s:
            outcomes = [s.intake(item(f"B{n}", 100_000)).outcome for n in range(60)]
        store.conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        accepted = outcomes.count("accepted")
        assert 3 <= accepted < 30, outcomes
        assert set(outcomes[accepted:]) == {"backpressure"}, outcomes
        assert free_bytes(small_fs) >= floor, (free_bytes(small_fs), floor)
    finally:
        store.conn.close()


def test_purged_rows_go_back_to_the_filesystem(small_fs: Path) -> None:
    """Delivered rows purged for room: their pages are released and the file and the WAL
    shrink on the next checkpoint."""
    path = small_fs / "data" / "queue.db"
    store = open_store(path)
    try:
        with store.transaction() as s:
            for n in range(80):
                s.intake(item(f"P{n}", 100_000))
            s.conn.execute("UPDATE messages SET state = 'processed'")
        maintenance.checkpoint(store, "TRUNCATE")
        full = free_bytes(small_fs)
        with store.transaction() as s:
            assert maintenance.make_room(s, 0.0) == 0  # no limit crossed: nothing is purged for room
            s.conn.execute("DELETE FROM messages")
        with store.transaction() as s:
            released = maintenance.release_free_pages(s, limit=100_000)
        assert released >= 1500  # ~8 MB of bodies in 4 KiB pages
        assert maintenance.checkpoint(store, "TRUNCATE") == (0, 0, 0)
        assert path.with_name("queue.db-wal").stat().st_size == 0
        assert free_bytes(small_fs) - full >= 7 * MiB
    finally:
        store.conn.close()


def test_small_commits_share_one_free_space_measurement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One-message commits (a single sender) do not each pay for a statvfs: a measurement
    serves the batches of the next SPACE_RECHECK_SECONDS. The real statvfs runs; the test only
    counts the calls."""
    path = tmp_path / "data" / "queue.db"
    store = open_store(path, min_free_disk_bytes=MiB)
    calls: list[int] = []
    real = maintenance.free_disk_bytes

    def counted(s: SqliteStore) -> int:
        calls.append(1)
        return real(s)

    monkeypatch.setattr(maintenance, "free_disk_bytes", counted)
    try:
        started = time.monotonic()
        for n in range(200):
            with store.transaction() as s:
                assert s.intake(item(f"S{n}", 100)).outcome == "accepted"
        elapsed = time.monotonic() - started
        assert 1 <= len(calls) <= 2 + elapsed / maintenance.SPACE_RECHECK_SECONDS, (len(calls), elapsed)
    finally:
        store.conn.close()


def test_a_refusal_is_decided_on_a_measurement_of_its_own_batch(small_fs: Path) -> None:
    """A measurement an earlier batch took near the floor does not refuse a message once space
    came back in between: the batch measures again before it refuses."""
    path = small_fs / "data" / "queue.db"
    store = open_store(path)
    store.conn.close()
    floor = 4 * MiB
    store = open_store(path, min_free_disk_bytes=floor)
    hog = small_fs / "hog"
    try:
        with hog.open("wb") as f:  # leaves about 1.5 MiB above the floor (the WAL's 4 MiB promised)
            f.write(b"\0" * (free_bytes(small_fs) - floor - 4 * MiB - 1536 * 1024))
        with store.transaction() as s:
            assert s.intake(item("NEAR", 100)).outcome == "accepted"
        hog.unlink()
        with store.transaction() as s:  # ~2 MiB: more than the old measurement left
            assert s.intake(item("BIG", 1024 * 1024)).outcome == "accepted"
    finally:
        store.conn.close()

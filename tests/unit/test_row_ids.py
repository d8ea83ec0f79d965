"""Row ids (agent/storage/row_ids.py): UUIDs that grow, with distinct 8-digit prefixes.

The last test measures what the layout is for: a commit of many rows rewrites
a few pages of the id index, where random ids rewrote a page per row.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import sqlite3
import struct
import time
import uuid
from pathlib import Path

from agent.storage import sqlite as db
from agent.storage.row_ids import RowIds, format_row_id
from agent.storage.store import IntakeItem, SqliteStore

#: A WAL frame: a 24-byte header (its first 4 bytes: the page number) and the page (4 KiB here).
FRAME_HEADER, PAGE = 24, 4096


def test_ids_are_uuids_of_version_8_in_canonical_text() -> None:
    """RFC 9562 section 5.8: version 8, variant 10; lower-case hex as str(UUID) writes it."""
    ids = [RowIds()() for _ in range(50)] + [format_row_id(n, os.urandom(12).hex()) for n in range(2000)]
    parsed = [uuid.UUID(i) for i in ids]
    assert {u.version for u in parsed} == {8} and {u.variant for u in parsed} == {uuid.RFC_4122}
    assert [str(u) for u in parsed] == ids
    # the random parts: every variant nibble, every hex digit after the counter
    assert {i[19] for i in ids} == set("89ab")
    assert set("".join(i[9:] for i in ids).replace("-", "")) == set("0123456789abcdef")


def test_consecutive_ids_grow_and_differ_in_their_first_8_digits() -> None:
    source = RowIds()
    ids = [source() for _ in range(5000)]
    counters = [int(i[:8], 16) for i in ids]
    assert all((b - a) % 2**32 == 1 for a, b in itertools.pairwise(counters))
    assert len({i[:8] for i in ids}) == len(ids)
    # sorted as text = made order, unless the counter wrapped in between (1 run in 860,000)
    assert sorted(ids) == ids or max(counters) - min(counters) > 2**32 - 5000


def test_the_counter_wraps_at_32_bits() -> None:
    assert format_row_id(2**32 + 5, "0" * 24).startswith("00000005-")
    assert format_row_id(2**32 - 1, "0" * 24).startswith("ffffffff-")


def test_two_sources_start_apart() -> None:
    """Each process (each source) starts its counter at random: two never share prefixes in practice."""
    starts = {RowIds()()[:8] for _ in range(20)}
    assert len(starts) == 20


def test_a_forked_child_starts_its_own_counter_and_random_parts() -> None:
    """A child that kept its parent's counter would make ids with the parent's next prefixes."""
    source = RowIds()
    source()  # the pool of random parts is filled now, and would be copied into the child
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one id to the parent, then out without running pytest's teardown
        try:
            os.write(write, source().encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child = pipe.read()
    os.waitpid(pid, 0)
    mine = source()
    assert uuid.UUID(child).version == 8
    assert child[:8] != mine[:8] and child[9:] != mine[9:]


def test_a_commit_of_many_rows_rewrites_a_few_pages_of_the_id_index(tmp_path: Path) -> None:
    """The WAL holds one frame per page a commit changed: count those of the id index (dbstat).

    2,000 rows first, so the index has some 30 leaves; then commits of 16 rows
    from 16 senders. Random ids rewrote a leaf per row (about 15 pages per
    commit here); growing ids append to the last leaf, and when it fills SQLite
    rebalances it with its two left siblings and their parent (3 per commit).
    """
    path = tmp_path / "queue.db"
    conn = db.open_database(path, "agent-1", db.DatabaseOptions(synchronous="full"), time.time())
    store = SqliteStore(conn, db.load_queries(), db_path=path)
    sent = collections.Counter[int]()

    def commit() -> None:
        items = []
        for sender in range(16):
            sent[sender] += 1
            cid = f"S{sender}-{sent[sender]}"
            items.append([IntakeItem(
                channel="adt", remote=f"127.0.0.1:{40000 + sender}", sending_app=f"APP{sender}",
                sending_facility="FAC", control_id=cid, message_type="ADT^A01",
                body=f"MSH|^~\\&|APP{sender}|FAC|||20261201||ADT^A01|{cid}|P|2.5\rPID|1||{sender}\r".encode(),
                encoding="utf-8", ack_mode="commit", commit_ack=b"MSA|AA", received_at=time.time())])
        with store.transaction() as s:
            s.intake_groups(items)

    try:
        for _ in range(125):
            commit()
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.execute("PRAGMA wal_autocheckpoint = 0")
        commits = 20
        for _ in range(commits):
            commit()
        frames = Path(f"{path}-wal").read_bytes()[32:]  # after the WAL header
        pages = [struct.unpack(">I", frames[at : at + 4])[0] for at in range(0, len(frames), FRAME_HEADER + PAGE)]
        with contextlib.closing(sqlite3.connect(path)) as reader:
            index_pages = {no for (no,) in reader.execute(
                "SELECT pageno FROM dbstat WHERE name = 'sqlite_autoindex_messages_1'")}
    finally:
        conn.close()
    assert len(pages) > 10 * commits  # the measurement saw the commits (about 40 pages each)
    assert sum(p in index_pages for p in pages) <= 4 * commits

"""Pages per commit: the WAL frames each intake and dispatch commit writes, counted, not timed.

    .venv/bin/python bench/wal_frames.py [--rows-before 100000] [--senders 16] [--commits 300]
                                         [--ids store|uuid4]

Every page a commit changes is one WAL frame (a 24-byte header and the page)
and one pwrite; fewer pages is less to write before the fsync and less to
checkpoint later. Unlike msg/s on a shared machine this figure is exact: the
WAL's growth with the checkpoint held off, divided by the commits. On a file
already holding ``--rows-before`` rows (the indexes then have many leaves, as
on a site's queue), through the store's own write path:

- intake: commits of one message (one sender) and of ``--senders`` messages
  from as many senders (each its own group, as the writer batches them);
- dispatch: claim, mark in flight and settle of the oldest rows, each its own
  commit (frames per message for the three).

``--ids``: the store's own row ids (``store``: they grow, agent/storage/row_ids.py), or random
ones (``uuid4``, what intake used before) put in their place for the run.
Prints figures; asserts nothing. ``--smoke``: 2,000 rows, a few commits.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from pathlib import Path
from typing import Any

import harness as h

AGENT_ID = "bench-wal-frames"
FRAME = 4096 + 24  # page_size + the frame header (https://sqlite.org/fileformat2.html#walformat)


def measure(workdir: Path, rows_before: int, senders: int, commits: int, ids: str) -> dict[str, Any]:
    from agent.storage import sqlite as db
    from agent.storage.store import IntakeItem, LeaseHolder, SqliteStore
    from agent.storage.store_intake import IntakeQueries

    if ids == "uuid4":
        IntakeQueries._new_id = staticmethod(lambda: str(uuid.uuid4()))  # type: ignore[method-assign]
    path = workdir / "queue.db"
    conn = db.open_database(path, AGENT_ID, db.DatabaseOptions(synchronous="full"), time.time())
    store = SqliteStore(conn, db.load_queries(), db_path=path)
    wal = Path(f"{path}-wal")
    sent = [0] * senders

    def item(sender: int) -> IntakeItem:
        sent[sender] += 1
        cid = f"S{sender:02d}-{sent[sender]:09d}"
        body = h.ADT_TEMPLATE.format(cid=cid).encode()
        return IntakeItem(channel="adt", remote=f"127.0.0.1:{40000 + sender}", sending_app=f"APP{sender:02d}",
                          sending_facility="FAC", control_id=cid, message_type="ADT^A01", body=body,
                          encoding="utf-8", ack_mode="commit", commit_ack=b"MSH|^~\\&|ACK", received_at=time.time())

    def frames_of(step: Any, n: int) -> float:  # noqa: ANN401 - a callable run n times
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        before = wal.stat().st_size if wal.exists() else 0
        for _ in range(n):
            step()
        return (wal.stat().st_size - max(before, 32)) / FRAME / n

    try:
        done = 0
        while done < rows_before:
            with store.transaction() as s:
                for _ in range(max(1, min(10_000, rows_before - done) // senders)):
                    s.intake_groups([[item(k)] for k in range(senders)])
                    done += senders
        conn.execute("PRAGMA wal_autocheckpoint = 0")

        def intake(width: int) -> None:
            with store.transaction() as s:
                s.intake_groups([[item(k)] for k in range(width)])

        one = frames_of(lambda: intake(1), commits)
        many = frames_of(lambda: intake(senders), commits)
        me = LeaseHolder.for_this_process(AGENT_ID)
        with store.transaction() as s:
            epoch = s.try_acquire_lease(me, 600)
        if epoch is None:
            raise h.BenchError("the dispatch lease is held by another process")

        def dispatch() -> None:
            head = store.channel_head("adt")
            assert head is not None
            with store.transaction() as s:
                s.claim(me.holder, epoch, head.id)
            with store.transaction() as s:
                attempt = s.mark_inflight(me.holder, epoch, head.id, "claimed", head.attempts)
            with store.transaction() as s:
                s.settle(me.holder, epoch, head.id, attempt, "processed", server_status=200, server_ack=None)

        cycle = frames_of(dispatch, min(commits, done))
    finally:
        store.close()
    return {"rows_before": rows_before, "senders": senders, "commits": commits, "ids": ids,
            "intake_1": round(one, 2), f"intake_{senders}": round(many, 2),
            f"intake_{senders}_per_row": round(many / senders, 2), "dispatch_per_message": round(cycle, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows-before", type=int, default=100_000)
    parser.add_argument("--senders", type=int, default=16)
    parser.add_argument("--commits", type=int, default=300)
    parser.add_argument("--ids", choices=["store", "uuid4"], default="store")
    parser.add_argument("--workdir")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--smoke", action="store_true", help="2,000 rows, 20 commits")
    args = parser.parse_args()
    if args.smoke:
        args.rows_before, args.commits = 2000, 20
    with h.workdir(args.workdir, args.keep) as work:
        out = measure(work, args.rows_before, args.senders, args.commits, args.ids)
    n = args.senders
    print(f"WAL frames per commit on a {args.rows_before}-row file (ids: {args.ids}):")
    print(f"  intake, 1 message per commit      {out['intake_1']:7.2f}")
    print(f"  intake, {n} senders per commit    {out[f'intake_{n}']:7.2f}  ({out[f'intake_{n}_per_row']:.2f} per row)")
    print(f"  dispatch, claim + inflight + settle {out['dispatch_per_message']:5.2f} per message")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""The writer thread's CPU and statements per delivered message, for strict channels draining a backlog.

    .venv/bin/python bench/dispatch_cycle.py [--rows 8000] [--channels 4] [--repeat 3] [--tree=DIR]

A real queue file (``synchronous = "full"``, filled through the store's intake
path by bench/backlog.py's ``fill_queue``) and the real writer thread; the
lease taken, each channel's head claimed and marked in flight. Then, round
after round, one settle per channel is submitted at once and the next round
waits for all of them — what the strict channel workers ask of the writer
while a server that answers at once drains the backlog: each job settles its
row and, in the same commit, reads the next head with its pause flag and
claims it and marks it in flight (``channel_worker._settle_and_next``). No
sockets, no server, no event loop: what is measured is the dispatch side of
the writer, which bench/e2e.py shows as the half of dispatch's CPU.

Prints, per run: the writer thread's CPU microseconds per message (from
``/proc/self/task/TID/schedstat``: exact, unlike the tick-sampled utime), SQL
statements per message (SQLite's own trace: BEGIN and COMMIT included),
messages per commit, and the wall rate. The median of ``--repeat`` runs is
the figure to compare. ``--tree=DIR`` imports another checkout's agent (a
``git worktree add --detach DIR <commit>``): run both, alternating, for an
A/B. It uses one of the runtime's inner functions (``_settle_and_next``):
if it changes, this is what to adapt.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# ``--tree DIR``: measure another checkout's agent (an A/B without a second copy of this file).
_TREE = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--tree=")), None)
sys.path.insert(0, str(Path(__file__).resolve().parent))
import backlog  # noqa: E402 - bench/harness.py puts this checkout first on the path: the tree goes before it

sys.path.insert(0, _TREE or str(Path(__file__).resolve().parent.parent))

from agent.core.dispatch import ChannelPolicy, SessionFacts, Settle  # noqa: E402
from agent.core.protocol import TransmitResponse  # noqa: E402
from agent.core.states import State  # noqa: E402
from agent.runtime import channel_worker  # noqa: E402
from agent.storage import sqlite as db  # noqa: E402
from agent.storage.liveness import LeaseHolder  # noqa: E402
from agent.storage.store import SqliteStore  # noqa: E402
from agent.storage.writer import Writer  # noqa: E402


def _thread_cpu_ns(native_id: int) -> int:
    return int(Path(f"/proc/self/task/{native_id}/schedstat").read_text().split()[0])


def one_run(workdir: Path, rows: int, channels: int) -> dict[str, Any]:
    """Fill a queue, drain it round by round; the writer's figures per message."""
    path = workdir / "queue.db"
    names = [f"ch{i}" for i in range(channels)]
    backlog.fill_queue(path, names, rows)
    conn = db.open_database(path, backlog.AGENT_ID, db.DatabaseOptions(synchronous="full"), time.time())
    writer = Writer(SqliteStore(conn, db.load_queries(), db_path=path))
    writer.start()
    try:
        me = LeaseHolder.for_this_process(backlog.AGENT_ID)
        epoch = writer.submit(SqliteStore.try_acquire_lease, me, 60.0).result(30)
        facts = SessionFacts(up=True)
        policies = {c: (ChannelPolicy(name=c), ChannelPolicy(name=c, paused=True)) for c in names}
        current: dict[str, tuple[str, int]] = {}
        for name in names:
            head = writer.submit(SqliteStore.channel_head, name).result(30)
            assert head is not None, f"channel {name} has no head"
            # Set up with the store calls every tree has (not measured): claim, then mark in flight.
            assert writer.submit(SqliteStore.claim, me.holder, epoch, head.id).result(30)
            attempt = writer.submit(SqliteStore.mark_inflight, me.holder, epoch, head.id, State.CLAIMED,
                                    head.attempts).result(30)
            current[name] = (head.id, attempt)
        statements = [0]

        def count(_sql: str) -> None:
            statements[0] += 1

        writer.submit(lambda s: s.conn.set_trace_callback(count)).result(30)
        tid = writer._thread.native_id  # the thread whose CPU is measured
        assert tid is not None
        cpu0, wall0, batches0, delivered = _thread_cpu_ns(tid), time.perf_counter(), writer.batches, 0
        while current:
            futures = {}
            for name, (message_id, attempt) in current.items():
                answer = Settle(id=message_id, attempt=attempt, state=State.PROCESSED,
                                response=TransmitResponse(message_id, attempt, 200))
                futures[name] = writer.submit(channel_worker._settle_and_next, me.holder, epoch, answer,
                                              policies[name], facts, time.time())
            for name, future in futures.items():
                done, nxt = future.result(30)
                assert done, f"the settle of {current[name][0]} did not move its row"
                delivered += 1
                if nxt is None:
                    del current[name]
                else:
                    current[name] = (nxt.head.id, nxt.attempt)
        cpu1, wall1 = _thread_cpu_ns(tid), time.perf_counter()
        commits = writer.batches - batches0
        seen = statements[0]
    finally:
        writer.close()
    if delivered != rows:
        raise SystemExit(f"delivered {delivered} of {rows} rows")
    return {"writer_us_per_msg": (cpu1 - cpu0) / 1e3 / delivered, "statements_per_msg": seen / delivered,
            "msgs_per_commit": delivered / max(1, commits), "msg_per_s": delivered / (wall1 - wall0)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8000, help="the backlog, spread over the channels")
    parser.add_argument("--channels", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tree", help="=DIR: another checkout's agent (parsed before the imports)")
    parser.add_argument("--json", help="write every run's figures here")
    parser.add_argument("--smoke", action="store_true", help="a few hundred rows, one run: proves it works")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.repeat = 400, 1
    if threading.current_thread() is not threading.main_thread():  # pragma: no cover - a script
        raise SystemExit("run as a script")
    runs = []
    for n in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="dispatch-cycle-") as tmp:
            run = one_run(Path(tmp), args.rows, args.channels)
        runs.append(run)
        print(f"run {n + 1}: writer {run['writer_us_per_msg']:.1f} µs CPU/msg, {run['statements_per_msg']:.2f} "
              f"statements/msg, {run['msgs_per_commit']:.2f} msgs/commit, {run['msg_per_s']:.0f} msg/s", flush=True)
    import agent

    tree = str(Path(agent.__file__).resolve().parent.parent)  # the checkout actually measured
    median = statistics.median(r["writer_us_per_msg"] for r in runs)
    print(f"{tree}: writer {median:.1f} µs CPU per delivered message (median of {len(runs)}), "
          f"{runs[0]['statements_per_msg']:.2f} statements/msg, {args.channels} strict channels")
    if args.json:
        Path(args.json).write_text(json.dumps({"tree": tree, "rows": args.rows, "channels": args.channels,
                                               "runs": runs, "median_writer_us_per_msg": median}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

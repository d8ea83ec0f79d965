"""A large backlog: restart to ready, RSS while draining, drain rate, claim cost by backlog size.

    .venv/bin/python bench/backlog.py [--rows 1000000] [--channels 4] [--drain-seconds 60]

The backlog is written through the store's own intake path (``SqliteStore.intake_groups``
as the writer calls it for a commit batch, one group per message, with the IntakeItem the
listener builds and the commit ACK from ``acks.build_ack``, then ``set_ack_outcomes`` with
"delivered" as after the ACKs went out) in transactions of 10,000 rows: the rows, seq
counters and dedupe keys are exactly what intake writes, only the commits are fewer. Then, for a small backlog (``--small-rows``) and for
the large one:

- claim cost: inside one transaction that is rolled back (the backlog stays as
  it is), ``--claims`` times the dispatch path's queries on the channel heads:
  head lookup, claim, mark in flight, settle; median microseconds each;
- restart to ready: ``python -m agent run`` started on the existing database
  with a local upstream server (bench/upstream_server.py) already listening:
  seconds to ``/readyz`` 200 and to the ``agent_started`` log line, RSS then;
- drain: for ``--drain-seconds`` (or until empty, ``--drain-all``) the rate the
  server receives transmits, and the daemon's RSS every 0.5 s.

Prints figures; asserts nothing. ``--smoke``: 1,000 rows, a few seconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import harness as h

AGENT_ID = "bench-agent"


def fill_queue(db_path: Path, channels: list[str], rows: int, batch: int = 10_000) -> float:
    """Write ``rows`` queued messages through the store's intake path (the writer's: a commit batch of
    one-message groups, then their ACK outcomes); seconds taken.

    The one place the benches use the agent's inside: if the store's
    interface changes, this function is what to adapt.
    """
    from agent.core import acks, charsets, envelope
    from agent.storage import sqlite as db
    from agent.storage.store import IntakeItem, SqliteStore

    started = time.perf_counter()
    conn = db.open_database(db_path, AGENT_ID, db.DatabaseOptions(synchronous="full"), time.time())
    # A larger page cache for the fill only (what is written does not change): the
    # indexes of a million rows do not fit SQLite's default 2 MiB.
    conn.execute("PRAGMA cache_size = -262144")
    store = SqliteStore(conn, db.load_queries(), db_path=db_path)
    try:
        done = 0
        while done < rows:
            with store.transaction():
                items = []
                for i in range(done, min(rows, done + batch)):
                    body = h.ADT_TEMPLATE.format(cid=f"B{i}").encode()
                    env = envelope.read_msh(body)
                    codec = charsets.resolve_codec(env.charset, "utf-8")
                    commit_ack = acks.build_ack(env, acks.ack_code(acks.Outcome.COMMITTED, env.enhanced),
                                                codec=codec)
                    item = IntakeItem(
                        channel=channels[i % len(channels)], remote="127.0.0.1:40000",
                        sending_app=env.sending_app, sending_facility=env.sending_facility,
                        control_id=env.control_id, message_type=env.message_type, body=body,
                        encoding=codec, ack_mode="commit", accept_ack_type=env.accept_ack_type,
                        application_ack_type=env.application_ack_type, commit_ack=commit_ack,
                    )
                    items.append(item)
                # As the writer commits a batch: every sender's message its own group.
                results = [r for group in store.intake_groups([[it] for it in items]) for r in group]
                for n, result in enumerate(results, start=done):
                    if result.outcome != "accepted":
                        raise h.BenchError(f"backlog row {n}: intake said {result.outcome}")
                store.set_ack_outcomes([(r.message_id, "delivered") for r in results])
            done = min(rows, done + batch)
    finally:
        conn.close()
    return time.perf_counter() - started


def claim_cost(db_path: Path, channels: list[str], claims: int) -> dict[str, float]:
    """Median µs of each dispatch query on the channel heads, in a transaction rolled back."""
    from agent.storage import sqlite as db
    from agent.storage.store import LeaseHolder, SqliteStore

    conn = db.open_database(db_path, AGENT_ID, db.DatabaseOptions(synchronous="full"), time.time())
    store = SqliteStore(conn, db.load_queries(), db_path=db_path)
    times: dict[str, list[float]] = {"head": [], "claim": [], "mark_inflight": [], "settle": []}
    me = LeaseHolder.for_this_process(AGENT_ID)
    conn.execute("BEGIN IMMEDIATE")
    try:
        epoch = store.try_acquire_lease(me, 60)
        if epoch is None:
            raise h.BenchError("claim cost: the dispatch lease is held by another process")
        for i in range(claims):
            channel = channels[i % len(channels)]
            t0 = time.perf_counter()
            head = store.channel_head(channel)
            t1 = time.perf_counter()
            if head is None:
                break
            if not store.claim(me.holder, epoch, head.id):
                raise h.BenchError(f"claim cost: could not claim the head of {channel}")
            t2 = time.perf_counter()
            attempt = store.mark_inflight(me.holder, epoch, head.id, "claimed", head.attempts)
            t3 = time.perf_counter()
            store.settle(me.holder, epoch, head.id, attempt, "processed", server_status=200, server_ack=None)
            t4 = time.perf_counter()
            for key, dt in (("head", t1 - t0), ("claim", t2 - t1), ("mark_inflight", t3 - t2), ("settle", t4 - t3)):
                times[key].append(dt * 1e6)
    finally:
        conn.execute("ROLLBACK")
        conn.close()
    out = {key: statistics.median(v) for key, v in times.items() if v}
    out["total"] = sum(out.values())
    out["claims"] = float(len(times["head"]))
    return out


def restart_and_drain(wd: Path, name: str, channels: list[str], rows: int, seconds: float | None) -> dict[str, Any]:
    """Start the daemon on the existing backlog, measure ready, then watch it drain."""
    # Exact arrival times for a small backlog (drained in a second); 0.25 s progress lines otherwise.
    exact = rows <= 100_000
    upstream = h.Upstream(wd / name, records=wd / name / "records.tsv" if exact else None)
    config = h.agent_config(wd / name / "data", [{"name": c, "listen": f"127.0.0.1:{h.free_port()}"} for c in channels],
                            admin_port=h.free_port(), server_url=upstream.url, agent_id=AGENT_ID)
    agent = h.Agent(wd / name, config)
    samples: list[tuple[float, int, int]] = []
    try:
        ready = agent.wait_ready(120)
        ready["rss_mib"] = h.mib(h.rss_bytes(agent.pid))
        ready_at = time.monotonic()
        deadline = ready_at + seconds if seconds is not None else float("inf")
        while True:
            now = time.monotonic()
            got = upstream.received()
            samples.append((now - ready_at, got, h.rss_bytes(agent.pid)))
            if got >= rows or now >= deadline:
                break
            if not agent.alive():
                raise h.BenchError(f"the agent exited while draining:\n{agent.tail()}")
            time.sleep(0.5)
    finally:
        agent.stop(60)
        upstream.stop_and_collect()
    # Drain rate: from the first delivery (the session is up) to the last one seen.
    if exact:
        points = [(t, i + 1) for i, t in enumerate(sorted(r[0] for r in upstream.read_records()))]
    else:
        points = [p for p in upstream.progress() if p[1] > 0]
    first, last = (points[0], points[-1]) if points else ((0.0, 0), (0.0, 0))
    rate = (last[1] - first[1]) / (last[0] - first[0]) if last[0] > first[0] else float("nan")
    rss = [h.mib(s[2]) for s in samples]
    return {
        **ready,
        "drained": samples[-1][1],
        "drain_seconds": samples[-1][0],
        "drain_rate": rate,
        "rss_min_mib": min(rss),
        "rss_max_mib": max(rss),
        "rss_last_mib": rss[-1],
        "rss_samples_mib": [round(r, 1) for r in rss],
    }


def phase(wd: Path, name: str, rows: int, args: argparse.Namespace) -> dict[str, Any]:
    channels = [f"ch{i}" for i in range(args.channels)]
    (wd / name / "data").mkdir(parents=True)
    db_path = wd / name / "data" / "queue.db"
    fill_s = fill_queue(db_path, channels, rows)
    size = db_path.stat().st_size
    print(f"{name}: {rows} queued rows over {len(channels)} channel(s) written through the store's intake path "
          f"in {fill_s:.1f} s ({rows / fill_s:.0f} rows/s), queue.db {h.mib(size):.0f} MiB", flush=True)
    cost = claim_cost(db_path, channels, min(args.claims, rows))
    print(f"{name}: claim cost (median µs, {int(cost['claims'])} heads, rolled back): head {cost['head']:.1f}, "
          f"claim {cost['claim']:.1f}, mark in flight {cost['mark_inflight']:.1f}, settle {cost['settle']:.1f}, "
          f"total {cost['total']:.1f}", flush=True)
    seconds = None if args.drain_all or rows <= args.small_rows else args.drain_seconds
    drain = restart_and_drain(wd, name, channels, rows, seconds)
    print(f"{name}: restart to ready {drain['readyz_s']:.2f} s (/readyz 200), agent_started after "
          f"{drain['agent_started_s']:.2f} s, RSS at ready {drain['rss_mib']:.1f} MiB", flush=True)
    print(f"{name}: drained {drain['drained']} in {drain['drain_seconds']:.1f} s: {drain['drain_rate']:.0f} msg/s; "
          f"RSS while draining {drain['rss_min_mib']:.1f}-{drain['rss_max_mib']:.1f} MiB "
          f"(last {drain['rss_last_mib']:.1f})", flush=True)
    return {"rows": rows, "fill_s": fill_s, "db_bytes": size, "claim_us": cost, **drain}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="the large backlog")
    parser.add_argument("--small-rows", type=int, default=1_000, help="the small backlog (drained whole)")
    parser.add_argument("--channels", type=int, default=4)
    parser.add_argument("--claims", type=int, default=2_000, help="claims timed per backlog")
    parser.add_argument("--drain-seconds", type=float, default=60.0, help="how long to watch the large drain")
    parser.add_argument("--drain-all", action="store_true", help="wait until the large backlog is empty")
    parser.add_argument("--workdir")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--smoke", action="store_true", help="1,000 rows: proves the bench works")
    args = parser.parse_args()
    h.stop_on_sigterm()
    if args.smoke:
        args.rows, args.small_rows, args.claims, args.drain_all = 1_000, 200, 200, True
    with h.workdir(args.workdir, args.keep) as wd:
        info = h.machine(wd)
        h.print_machine(info)
        small = phase(wd, "small", args.small_rows, args)
        large = phase(wd, "large", args.rows, args)
        ratio = large["claim_us"]["total"] / small["claim_us"]["total"]
        print(f"\nbacklog of {args.rows} rows (targets from the issue in brackets):")
        print(f"  restart to ready        {large['readyz_s']:6.2f} s      [< 2 s: {h.verdict(large['readyz_s'] < 2)}]")
        print(f"  RSS at ready            {large['rss_mib']:6.1f} MiB    "
              f"[< 200 MiB: {h.verdict(large['rss_mib'] < 200)}]")
        print(f"  RSS while draining      {large['rss_min_mib']:6.1f}-{large['rss_max_mib']:.1f} MiB "
              f"[< 200 MiB and flat: {h.verdict(large['rss_max_mib'] < 200)}; "
              f"grew {large['rss_last_mib'] - large['rss_mib']:+.1f} MiB since ready]")
        print(f"  drain rate              {large['drain_rate']:6.0f} msg/s  (small backlog: "
              f"{small['drain_rate']:.0f} msg/s) [>= the e2e rate: compare with bench/e2e.py]")
        print(f"  claim cost              {large['claim_us']['total']:6.1f} µs     (small backlog: "
              f"{small['claim_us']['total']:.1f} µs, {ratio:.2f}x) [independent of backlog size]")
        h.write_json(args.json, {"machine": info, "args": vars(args), "small": small, "large": large,
                                 "claim_ratio": ratio})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""End to end: intake plus dispatch over the WebSocket to a local protocol-v1 server.

    .venv/bin/python bench/e2e.py [--channels 4] [--connections 16] [--duration 10] [--warmup 2]
                                  [--server-delay MS] [--max-in-flight N [--partition-key PID-3.1]]
                                  [--backend sqlite [postgresql]] [--dsn DSN]

The daemon (``synchronous = "full"``, ``ack = "commit"``) takes ``--connections``
senders spread over ``--channels`` channels from the C load generator and
forwards to bench/upstream_server.py, a minimal server in its own process
that answers every transmit at once (or after ``--server-delay``); its CPU
share is printed to show it is not the bottleneck. The figure is the
sustained delivery rate: transmits the server received per second during
the measured window (after the warm-up, while the senders are sending). Then
it waits for the queue to drain and checks every ACKed message was delivered
exactly once (one id, one attempt), in its channel (or partition key) in
order of seq and, per sender connection, of MSH-10. python-hl7's intake rate
(bench/baseline_server.py, the same senders on one port) is measured before
and after in the same run; the ratio is delivered / baseline.

``--backend postgresql`` puts the queue in PostgreSQL (a throwaway local
cluster in the work dir, or ``--dsn``'s server) instead of SQLite;
``--backend sqlite postgresql`` measures one after the other in one run,
each with its own daemon, data dir and upstream server, between the same
two baseline measurements.

``--max-in-flight`` (with ``--partition-key``, default PID-3.1, and
``--patients`` distinct PID-3.1 values) sets the partitioned-channel keys;
an hl7-agent without them is refused with the configuration error. Exit 1
when a run saw sender errors or the delivery check failed. ``--smoke``:
a few hundred messages, to show the bench works.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import harness as h

TARGET_RATIO = 1.0


def baseline_rate(wd: Path, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    server = h.start_baseline(wd)
    try:
        report = h.run_loadgen([server.port], args.connections, duration=args.duration, count=args.count,
                               warmup=args.warmup, prefix=f"b{tag}")
    finally:
        server.stop()
    h.check_all_accepted(report, f"python-hl7 baseline ({tag})")
    return report


def verify(records: list[tuple[float, str, int, int, str, str, str]], report: dict[str, Any],
           channel_of_port: dict[int, str], partitioned: bool, drained: bool) -> dict[str, Any]:
    """Delivered once, to the right channel, in order; everything ACKed arrived (when drained)."""
    acked = h.acked_control_ids(report)
    ids_per_cid: dict[str, set[str]] = defaultdict(set)
    attempts = Counter(mid for _, _, _, _, _, mid, _ in records)
    wrong_channel = seq_disorder = sender_disorder = 0
    last_seq: dict[tuple[str, str], int] = {}
    last_n: dict[int, int] = {}
    seqs: dict[str, list[int]] = defaultdict(list)
    for _t, channel, seq, attempt, cid, mid, pid3 in records:
        ids_per_cid[cid].add(mid)
        if attempt > 1:
            continue
        seqs[channel].append(seq)
        key = (channel, pid3 if partitioned else "")
        if seq <= last_seq.get(key, 0):
            seq_disorder += 1
        last_seq[key] = max(seq, last_seq.get(key, 0))
        where = acked.get(cid)
        if where is None:
            continue
        conn, n = where
        if channel_of_port[report["per_connection"][conn]["port"]] != channel:
            wrong_channel += 1
        if not partitioned:
            if n <= last_n.get(conn, -1):
                sender_disorder += 1
            last_n[conn] = n
    missing = [cid for cid in acked if cid not in ids_per_cid]
    gaps = sum(1 for ch, s in seqs.items() if sorted(s) != list(range(1, len(s) + 1))) if drained else 0
    result = {
        "acked": len(acked),
        "delivered_distinct": len(ids_per_cid),
        "transmits": len(records),
        "resends": sum(n - 1 for n in attempts.values()),
        "duplicates": sum(1 for ids in ids_per_cid.values() if len(ids) > 1),
        "missing": len(missing) if drained else None,
        "unexpected": sum(1 for cid in ids_per_cid if cid not in acked),
        "wrong_channel": wrong_channel,
        "seq_disorder": seq_disorder,
        "sender_disorder": sender_disorder,
        "channels_with_seq_gaps": gaps,
        "order_scope": "partition key (channel, PID-3.1)" if partitioned else "channel",
    }
    result["ok"] = not (result["resends"] or result["duplicates"] or (drained and missing) or wrong_channel
                        or seq_disorder or sender_disorder or gaps)
    return result


def run_backend(wd: Path, args: argparse.Namespace, backend: str, queue: list[str], name: str,
                base: float, patients: int) -> dict[str, Any]:
    """One daemon on ``backend`` under the load, then drained and checked: its figures."""
    partitioned = args.max_in_flight is not None
    extra: dict[str, Any] = {"max_connections": max(64, args.connections + 8)}
    if partitioned:
        extra.update(partition_key=args.partition_key, max_in_flight=args.max_in_flight)
    channels = h.channels_on_ports(args.channels, **extra)
    ports = h.channel_ports(channels)
    channel_of_port = {p: str(c["name"]) for p, c in zip(ports, channels, strict=True)}
    admin_port = h.free_port()
    data = wd / ("data" if name == "agent" else f"data-{backend}")
    upstream = h.Upstream(wd, delay_ms=args.server_delay, records=wd / f"records-{backend}.tsv")
    agent = h.Agent(wd, h.agent_config(data, channels, admin_port=admin_port, server_url=upstream.url,
                                       queue=queue), name=name)
    spy = None
    drained = settled = False
    drain_s = settle_s = float("nan")
    try:
        agent.wait_ready()
        upstream.wait_session()
        if args.profile:
            spy = h.py_spy(agent.pid, Path(args.profile) / f"e2e-{name}.txt", args.warmup + args.duration)
        with h.CpuSampler({"upstream": upstream.pid, "agent": agent.pid}) as cpu:
            report = h.run_loadgen(ports, args.connections, duration=args.duration, count=args.count,
                                   warmup=args.warmup, prefix=f"e{backend[0]}", patients=patients)
            h.check_all_accepted(report, f"hl7-agent intake ({backend})")
            total = report["acked"]
            load_end = time.monotonic()
            if spy is not None and not args.no_drain:
                # Dispatch alone: the first seconds of the drain, in a profile of their own.
                spy.proc.wait(60)
                spy = h.py_spy(agent.pid, Path(args.profile) / f"e2e-{name}-drain.txt", 4)
            if not args.no_drain:
                drained = upstream.wait_received(total, args.drain_timeout)
                drain_s = time.monotonic() - load_end
                deadline = time.monotonic() + 60
                while drained and time.monotonic() < deadline:
                    if agent.queue_stats()["states"]["processed"] >= total:
                        settled = True
                        settle_s = time.monotonic() - load_end
                        break
                    time.sleep(0.5)
        if spy is not None:
            spy.proc.wait(60)
        t0, t1 = report["t_measure_mono"], report["t_measure_mono"] + report["window_s"]
        shares = {name_: cpu.share(name_, t0, t1) for name_ in ("upstream", "agent")}
        cpu_window_s = cpu.seconds("agent", t0, t1)
        cpu_drain_s = cpu.seconds("agent", load_end, load_end + drain_s) if drained else float("nan")
    finally:
        agent.stop()
        summary = upstream.stop_and_collect()
    records = upstream.read_records()

    window = report["window_s"]
    in_window = sum(1 for r in records if r[3] == 1 and t0 <= r[0] <= t1)
    sustained = in_window / window
    last = max((r[0] for r in records), default=report["t_start_mono"])
    overall = len({r[5] for r in records}) / (last - report["t_start_mono"]) if records else 0.0
    behind = report["acked"] - sum(1 for r in records if r[3] == 1 and r[0] <= report["t_end_mono"])
    # The process's CPU per message: in the window it takes messages in and delivers them
    # (each counted where it happened); while draining it only delivers.
    taken_in = report["msg_per_s"] * window
    drain_delivered = sum(1 for r in records if r[3] == 1 and load_end <= r[0] <= load_end + drain_s) \
        if drained else 0
    cpu_per = {
        "window_us_per_message_in_plus_delivered": 1e6 * cpu_window_s / (taken_in + in_window)
        if taken_in + in_window else None,
        "drain_us_per_delivered": 1e6 * cpu_drain_s / drain_delivered if drain_delivered else None,
        "window_cpu_s": cpu_window_s, "drain_cpu_s": cpu_drain_s, "drain_delivered": drain_delivered,
    }
    return {
        "backend": backend, "intake": report, "delivered_per_s": sustained,
        "delivered_overall_per_s": overall, "ratio": sustained / base, "cpu_share": shares,
        "upstream_summary": summary, "drain_s": drain_s, "settle_s": settle_s,
        "drain_after_load_per_s": behind / drain_s if drained and behind > 0 else None,
        "check": verify(records, report, channel_of_port, partitioned, drained), "cpu_per_message": cpu_per,
        "in_window": in_window, "behind": behind, "drained": drained, "settled": settled,
    }


def print_backend(r: dict[str, Any], args: argparse.Namespace, base: float, before: float, after: float) -> None:
    partitioned = args.max_in_flight is not None
    report, check, shares = r["intake"], r["check"], r["cpu_share"]
    lat = report["latency_ms"]
    mode = f"max_in_flight {args.max_in_flight}, partition_key {args.partition_key}" if partitioned else \
        "one in flight per channel"
    print(f"\ne2e ({r['backend']}): {args.channels} channel(s), {args.connections} senders, server answers "
          f"after {args.server_delay:g} ms, {mode}")
    print(f"  intake (ACKed by the agent)        {report['msg_per_s']:8.0f} msg/s   ACK p50 {lat['p50']:.2f} ms, "
          f"p99 {lat['p99']:.2f} ms")
    print(f"  delivered, steady state            {r['delivered_per_s']:8.0f} msg/s   ({r['in_window']} transmits "
          f"received in the {report['window_s']:.1f} s window)")
    print(f"  delivered, first byte to last      {r['delivered_overall_per_s']:8.0f} msg/s   (queue behind by "
          f"{r['behind']} when the senders stopped)")
    print(f"  python-hl7 intake, same run        {base:8.0f} msg/s   (before {before:.0f}, after {after:.0f})")
    print(f"  ratio delivered/python-hl7: {r['ratio']:.2f}x   target >= {TARGET_RATIO:.1f}x: "
          f"{h.verdict(r['ratio'] >= TARGET_RATIO)}")
    print(f"  CPU in the window: upstream server {shares['upstream']:.0%} of one core, agent "
          f"{shares['agent']:.0%}, load generator {report['cpu_s'] / report['wall_s']:.0%}")
    per = r["cpu_per_message"]
    window_us, drain_us = per["window_us_per_message_in_plus_delivered"], per["drain_us_per_delivered"]
    def known(x: float | None) -> bool:
        return x is not None and not math.isnan(x)

    print("  agent CPU per message: "
          + (f"{window_us:.0f} µs per message taken in or delivered in the window" if known(window_us) else "n/a")
          + (f"; {drain_us:.0f} µs per delivered message while draining (dispatch alone)"
             if known(drain_us) else ""))
    if shares["upstream"] > 0.8:
        print("  warning: the upstream server used most of a core: it may be the bottleneck")
    if args.no_drain:
        print("  drain skipped (--no-drain): only what arrived was checked")
    elif not r["drained"]:
        print(f"  the queue did not drain within {args.drain_timeout:.0f} s")
    else:
        behind, drain_s = r["behind"], r["drain_s"]
        without_load = f" ({behind / drain_s:.0f} msg/s without intake load)" if behind > 0 else ""
        print(f"  drained {drain_s:.1f} s after the senders stopped{without_load}; all rows processed after "
              f"{r['settle_s']:.1f} s" if r["settled"] else
              "  delivered, but not every row was processed in 60 s")
    print(f"  delivery check ({check['order_scope']}): {check['acked']} ACKed, {check['delivered_distinct']} "
          f"delivered, resends {check['resends']}, duplicates {check['duplicates']}, missing "
          f"{check['missing']}, wrong channel {check['wrong_channel']}, out of seq order "
          f"{check['seq_disorder']}, out of sender order {check['sender_disorder']}: "
          f"{'OK' if check['ok'] else 'FAILED'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--channels", type=int, default=4)
    parser.add_argument("--connections", type=int, default=16, help="sender connections, spread over the channels")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds measured")
    parser.add_argument("--count", type=int, help="messages measured, instead of --duration")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--server-delay", type=float, default=0.0, metavar="MS",
                        help="the upstream server answers each transmit after this many ms")
    parser.add_argument("--max-in-flight", type=int, help="per-channel max_in_flight (partitioned channels)")
    parser.add_argument("--partition-key", default="PID-3.1", help="partition_key with --max-in-flight")
    parser.add_argument("--patients", type=int, help="distinct PID-3.1 values (default 256 with --max-in-flight)")
    parser.add_argument("--drain-timeout", type=float, default=600.0, help="longest wait for the queue to drain")
    parser.add_argument("--no-drain", action="store_true", help="stop after the window; check only what arrived")
    parser.add_argument("--workdir")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--profile", metavar="DIR", help="py-spy record the agent during the load "
                                                           "(and the first seconds of the drain)")
    parser.add_argument("--smoke", action="store_true", help="a few hundred messages: proves the bench works")
    parser.add_argument("--backend", choices=h.BACKENDS, nargs="+", default=["sqlite"],
                        help="the agent's queue backend; two: one after the other in this run")
    parser.add_argument("--dsn", help="--backend postgresql: this server's database (default: a local "
                                      "throwaway cluster in the work dir)")
    args = parser.parse_args()
    h.stop_on_sigterm()
    if args.dsn and "postgresql" not in args.backend:
        parser.error("--dsn needs --backend postgresql")
    if len(set(args.backend)) != len(args.backend):
        parser.error("--backend: each backend once")
    if args.smoke:
        args.count, args.warmup = args.count or 300, 0.0
    if args.count:
        args.duration = None
    if args.profile and args.duration is None:
        parser.error("--profile needs --duration")
    partitioned = args.max_in_flight is not None
    patients = args.patients if args.patients is not None else (256 if partitioned else 0)
    names = ["agent"] if len(args.backend) == 1 else [f"agent-{b}" for b in args.backend]

    with h.workdir(args.workdir, args.keep) as wd, contextlib.ExitStack() as stack:
        queues = [stack.enter_context(h.queue_database(wd, b, args.dsn)) for b in args.backend]
        info = h.machine(wd)
        info["backend"] = " + ".join(args.backend)
        h.print_machine(info)
        print(f"queue backend: {info['backend']}", flush=True)
        if partitioned:
            channels = h.channels_on_ports(args.channels, partition_key=args.partition_key,
                                           max_in_flight=args.max_in_flight)
            config = h.agent_config(wd / "data", channels, admin_port=h.free_port(),
                                    server_url="ws://127.0.0.1:1/agent", queue=queues[0])
            code, text = h.check_config(config, wd)
            if code != 0:
                print(f"e2e: --max-in-flight needs the channel keys partition_key and max_in_flight "
                      f"(partitioned channels), which this hl7-agent refuses:\n  {text}", file=sys.stderr)
                return 2

        before = baseline_rate(wd, args, "0")
        print(f"python-hl7 intake before: {before['msg_per_s']:.0f} msg/s", flush=True)
        # The ratio is against the baseline before the run; the printout adds the one after.
        results = [run_backend(wd, args, backend, queue, name, before["msg_per_s"], patients)
                   for backend, queue, name in zip(args.backend, queues, names, strict=True)]
        after = baseline_rate(wd, args, "1")
        print(f"python-hl7 intake after: {after['msg_per_s']:.0f} msg/s", flush=True)
        base = h.median([before["msg_per_s"], after["msg_per_s"]])
        for r in results:
            r["ratio"] = r["delivered_per_s"] / base
            r["baseline_per_s"] = base
            print_backend(r, args, base, before["msg_per_s"], after["msg_per_s"])
        out: dict[str, Any] = {"machine": info, "args": vars(args), "baseline": [before, after],
                               "baseline_per_s": base}
        if len(results) == 1:
            out.update(results[0])
        else:
            out["backends"] = {r["backend"]: r for r in results}
        h.write_json(args.json, out)
        ok = all(r["check"]["ok"] and (args.no_drain or (r["drained"] and r["settled"])) for r in results)
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

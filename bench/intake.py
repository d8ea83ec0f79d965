"""Intake: hl7-agent (durable) against python-hl7's non-durable asyncio server, side by side.

    .venv/bin/python bench/intake.py [--connections 16 1] [--rounds 2] [--duration 10] [--warmup 2]
                                     [--backend sqlite [postgresql]] [--dsn DSN]

Both servers run at once; the C load generator (bench/loadgen.c) drives one
of them at a time, alternating A B B A in every round (A = python-hl7's
``start_hl7_server``: parse + ``create_ack``, nothing stored; B = the daemon
as a subprocess, ``synchronous = "full"``, ``ack = "commit"``: every AA
follows its own row's COMMIT, data dir on the disk of the work dir; with
``--backend postgresql`` the queue is in PostgreSQL instead — a throwaway
local cluster in the work dir, or the server of ``--dsn`` — every AA after
PostgreSQL's COMMIT with ``synchronous_commit = on``), so a
drift in machine load hits both alike. ``--backend sqlite postgresql`` runs
one daemon per backend, all at once, and alternates A B C C B A: both
backends side by side in one run. Each connection sends serially: a
message, its ACK, the next one. Reports per connection count the medians of
msg/s and ACK latency p50/p99, the ratio agent/baseline, the targets next to
it, and the disk's fsync rate (small write + fsync in a loop on the same file
system: one commit per message cannot beat it on one connection).

Stops with exit 1 if any run saw a connection error or a non-AA ACK: that
run measured something else. ``--smoke`` runs a few hundred messages to show
the bench works; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

import harness as h

#: The issue's targets: (minimum msg/s ratio agent/baseline, p99 no worse than the baseline's).
TARGETS = {16: (2.0, True), 1: (1.0, False)}


def one_run(kind: str, port: int, pid: int, connections: int, args: argparse.Namespace, prefix: str,
            profile: Path | None) -> dict[str, Any]:
    spy = None
    if profile is not None:
        spy = h.py_spy(pid, profile, args.warmup + args.duration)
    try:
        with h.CpuSampler({"server": pid}) as cpu:
            report = h.run_loadgen([port], connections, duration=args.duration, count=args.count,
                                   warmup=args.warmup, prefix=prefix)
    finally:
        if spy is not None and spy.proc.wait(args.duration + args.warmup + 60) != 0:
            print(f"warning: py-spy failed:\n{spy.tail()}", file=sys.stderr)
    h.check_all_accepted(report, f"{kind} at {connections} connection(s)")
    report["kind"] = kind
    report["server_cpu"] = cpu.share("server", report["t_measure_mono"], report["t_end_mono"])
    report["loadgen_cpu"] = report["cpu_s"] / report["wall_s"] if report["wall_s"] else 0.0
    return report


def agent_kinds(backends: list[str]) -> list[str]:
    """The runs' kinds: ``agent`` for one backend (as before), ``agent-<backend>`` for several."""
    return ["agent"] if len(backends) == 1 else [f"agent-{b}" for b in backends]


def summarise(connections: int, runs: dict[str, list[dict[str, Any]]], agents: list[str]) -> dict[str, Any]:
    def med(kind: str, key: str, sub: str | None = None) -> float:
        return h.median([r[key][sub] if sub else r[key] for r in runs[kind]])

    out: dict[str, Any] = {"connections": connections, "agents": agents}
    for kind in ("baseline", *agents):
        out[kind] = {"msg_per_s": med(kind, "msg_per_s"), "p50_ms": med(kind, "latency_ms", "p50"),
                     "p99_ms": med(kind, "latency_ms", "p99"), "max_ms": med(kind, "latency_ms", "max"),
                     "server_cpu": med(kind, "server_cpu"), "loadgen_cpu": med(kind, "loadgen_cpu"),
                     "runs": len(runs[kind])}
    target = TARGETS.get(connections)
    for kind in agents:
        suffix = "" if kind == "agent" else kind[len("agent"):].replace("-", "_")
        ratio = out[kind]["msg_per_s"] / out["baseline"]["msg_per_s"]
        out[f"ratio{suffix}"] = ratio
        out[f"p99_ratio{suffix}"] = out[kind]["p99_ms"] / out["baseline"]["p99_ms"]
        if target is not None:
            out["target_ratio"] = target[0]
            out[f"target_met{suffix}"] = ratio >= target[0]
            if target[1]:
                out[f"p99_target_met{suffix}"] = out[kind]["p99_ms"] <= out["baseline"]["p99_ms"]
    return out


def print_summary(s: dict[str, Any], fsync: float) -> None:
    c = s["connections"]
    agents: list[str] = s["agents"]
    print(f"\nintake, {c} connection(s): medians of {s[agents[0]]['runs']} runs per server")
    print(f"  {'':22} {'msg/s':>9} {'ACK p50 ms':>11} {'ACK p99 ms':>11} {'max ms':>8} {'server CPU':>11}")
    labels = {"baseline": "python-hl7", "agent": "hl7-agent"}
    for kind in ("baseline", *agents):
        r = s[kind]
        label = labels.get(kind, f"hl7-agent ({kind[len('agent-'):]})")
        print(f"  {label:22} {r['msg_per_s']:9.0f} {r['p50_ms']:11.2f} {r['p99_ms']:11.2f} {r['max_ms']:8.1f} "
              f"{r['server_cpu']:10.0%}")
    for kind in agents:
        suffix = "" if kind == "agent" else kind[len("agent"):].replace("-", "_")
        name = "agent" if kind == "agent" else kind[len("agent-"):]
        line = f"  ratio {name}/python-hl7: {s['ratio' + suffix]:.2f}x"
        if "target_ratio" in s:
            line += f"   target >= {s['target_ratio']:.1f}x: {h.verdict(s['target_met' + suffix])}"
        if "p99_target_met" + suffix in s:
            line += (f";  p99 {s[kind]['p99_ms']:.2f} vs {s['baseline']['p99_ms']:.2f} ms, target no worse: "
                     f"{h.verdict(s['p99_target_met' + suffix])}")
        print(line)
        if c == 1 and kind in ("agent", "agent-sqlite"):
            print(f"  one fsync per message is the floor on one connection: {name} {s[kind]['msg_per_s']:.0f} "
                  f"msg/s against {fsync:.0f} fsync/s on this disk ({s[kind]['msg_per_s'] / fsync:.2f} of it)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, nargs="+", default=[16, 1])
    parser.add_argument("--rounds", type=int, default=2, help="A B B A rounds per connection count")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds measured per run")
    parser.add_argument("--count", type=int, help="messages measured per run, instead of --duration")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds sent before measuring")
    parser.add_argument("--fsync-seconds", type=float, default=3.0)
    parser.add_argument("--workdir", help="where the data dir and logs go (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the temp work dir")
    parser.add_argument("--json", help="write every run and the summary to this file")
    parser.add_argument("--profile", metavar="DIR",
                        help="after the measured runs, one more agent run at the highest connection count "
                             "under py-spy record (raw profile into DIR)")
    parser.add_argument("--smoke", action="store_true", help="a few hundred messages: proves the bench works")
    parser.add_argument("--backend", choices=h.BACKENDS, nargs="+", default=["sqlite"],
                        help="the agent's queue backend; two: one daemon each, side by side")
    parser.add_argument("--dsn", help="--backend postgresql: this server's database (default: a local "
                                      "throwaway cluster in the work dir)")
    args = parser.parse_args()
    h.stop_on_sigterm()
    if args.dsn and "postgresql" not in args.backend:
        parser.error("--dsn needs --backend postgresql")
    if len(set(args.backend)) != len(args.backend):
        parser.error("--backend: each backend once")
    if args.smoke:
        args.count, args.rounds, args.warmup, args.fsync_seconds = args.count or 300, 1, 0.0, 0.2
    if args.count:
        args.duration = None
    if args.profile and args.duration is None:
        parser.error("--profile needs --duration")

    agents = agent_kinds(args.backend)
    with h.workdir(args.workdir, args.keep) as wd, contextlib.ExitStack() as stack:
        queues = [stack.enter_context(h.queue_database(wd, b, args.dsn)) for b in args.backend]
        info = h.machine(wd)
        info["backend"] = " + ".join(args.backend)
        h.print_machine(info)
        print(f"queue backend: {info['backend']}", flush=True)
        fsync = [h.fsync_rate(wd, args.fsync_seconds)]
        print(f"fsync rate on the data disk: {fsync[0]:.0f}/s", flush=True)
        baseline = h.start_baseline(wd)
        servers = {"baseline": (baseline.port, baseline.pid)}
        daemons: list[h.Agent] = []
        results: dict[str, Any] = {"machine": info, "args": vars(args), "runs": [], "summary": []}
        try:
            for kind, backend, queue in zip(agents, args.backend, queues, strict=True):
                channel = {"name": "adt", "listen": f"127.0.0.1:{h.free_port()}", "ack": "commit",
                           "max_connections": max(64, max(args.connections) + 8)}
                data = wd / ("data" if kind == "agent" else f"data-{backend}")
                agent = h.Agent(wd, h.agent_config(data, [channel], admin_port=h.free_port(), queue=queue),
                                name=kind)
                daemons.append(agent)
                ready = agent.wait_ready()
                print(f"{kind} ready in {ready['readyz_s']:.2f} s (pid {agent.pid}, {backend})", flush=True)
                servers[kind] = (h.channel_ports([channel])[0], agent.pid)
            print(f"baseline pid {baseline.pid}", flush=True)
            for connections in args.connections:
                runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in servers}
                for rnd in range(args.rounds):
                    for kind in ("baseline", *agents, *reversed(agents), "baseline"):
                        port, pid = servers[kind]
                        tag = kind[0] + (kind[6:7] if kind.startswith("agent-") else "")
                        prefix = f"{tag}{connections}.{len(results['runs'])}"
                        report = one_run(kind, port, pid, connections, args, prefix, None)
                        report["round"] = rnd
                        runs[kind].append(report)
                        results["runs"].append(report)
                        lat = report["latency_ms"]
                        print(f"  round {rnd + 1} {kind:16} c={connections:<3} {report['msg_per_s']:8.0f} msg/s  "
                              f"p50 {lat['p50']:6.2f}  p99 {lat['p99']:6.2f}  max {lat['max']:7.1f} ms  "
                              f"server CPU {report['server_cpu']:4.0%}  loadgen CPU {report['loadgen_cpu']:4.0%}",
                              flush=True)
                results["summary"].append(summarise(connections, runs, agents))
            if args.profile:
                # One more agent run under py-spy, not counted: sampling slows the process.
                connections = max(args.connections)
                profile = Path(args.profile) / f"intake-{agents[0]}-c{connections}.txt"
                port, pid = servers[agents[0]]
                report = one_run(agents[0], port, pid, connections, args, f"p{connections}", profile)
                print(f"  profiled run (not counted) c={connections}: {report['msg_per_s']:.0f} msg/s; "
                      f"py-spy raw profile in {profile}", flush=True)
        finally:
            baseline.stop()
            for agent in daemons:
                agent.stop()
        fsync.append(h.fsync_rate(wd, args.fsync_seconds))
        results["fsync_per_s"] = fsync
        for s in results["summary"]:
            print_summary(s, h.median(fsync))
        print(f"\nfsync rate on the data disk ({info['disk']}): before {fsync[0]:.0f}/s, after {fsync[1]:.0f}/s")
        durable = {"sqlite": "SQLite synchronous=FULL", "postgresql": "PostgreSQL synchronous_commit=on"}
        print("baseline: python-hl7 start_hl7_server, hl7.parse + create_ack, nothing stored; "
              f"agent: {', '.join(durable[b] for b in args.backend)}, ACK after COMMIT")
        h.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Intake of two source trees side by side: the daemon of another commit (A) against this tree's (B).

    git worktree add --detach /tmp/old <commit>      # or: git archive <commit> | tar -x -C /tmp/old
    .venv/bin/python bench/intake_ab.py --old /tmp/old [--connections 16 1] [--rounds 3] [--duration 8]

For a change that must not make intake slower: both daemons run at once
(``synchronous = "full"``, ``ack = "commit"``, one channel each, their own
data dirs), the C load generator drives one at a time, alternating A B B A
in every round so drifting machine load hits both alike (``--swap``: B A A
B, to see whether the position in the round matters on a busy machine).
Reports per connection count the medians of msg/s, ACK latency p50/p99,
server CPU and server CPU per message — the last is the steadiest figure on
a shared machine, where one connection's msg/s follows the other tenants.
The old tree needs no installation: it is put first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import harness as h


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, help="source tree of the commit to compare against")
    parser.add_argument("--connections", type=int, nargs="+", default=[16, 1])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds measured per run")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--swap", action="store_true", help="B A A B instead of A B B A")
    parser.add_argument("--workdir")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="one short round: proves the bench works")
    args = parser.parse_args()
    h.stop_on_sigterm()
    if args.smoke:
        args.rounds, args.duration, args.warmup = 1, 0.5, 0.0
    order = ("new", "old", "old", "new") if args.swap else ("old", "new", "new", "old")
    new_tree = h.REPO
    with h.workdir(args.workdir, args.keep) as wd:
        h.print_machine(h.machine(wd))
        agents: dict[str, tuple[h.Agent, int]] = {}
        try:
            for kind, tree in (("old", Path(args.old).resolve()), ("new", new_tree)):
                h.REPO = tree  # the child's PYTHONPATH
                channel = {"name": "adt", "listen": f"127.0.0.1:{h.free_port()}", "ack": "commit",
                           "max_connections": max(64, max(args.connections) + 8)}
                (wd / kind).mkdir()
                config = h.agent_config(wd / kind / "data", [channel], admin_port=h.free_port(),
                                        agent_id=f"bench-{kind}")
                agents[kind] = (h.Agent(wd / kind, config, name=kind), h.channel_ports([channel])[0])
            h.REPO = new_tree
            for kind, (agent, _) in agents.items():
                print(f"{kind} ready in {agent.wait_ready()['readyz_s']:.2f} s (pid {agent.pid})", flush=True)
            summaries = [compare(agents, c, order, args) for c in args.connections]
        finally:
            h.REPO = new_tree
            for agent, _ in agents.values():
                agent.stop()
        for c, s in zip(args.connections, summaries, strict=True):
            print(f"\n{c} connection(s): medians of {2 * args.rounds} runs each")
            for kind in ("old", "new"):
                r = s[kind]
                print(f"  {kind}: {r['msg_per_s']:8.0f} msg/s  p50 {r['p50_ms']:6.2f} ms  p99 {r['p99_ms']:6.2f} ms  "
                      f"server CPU {r['cpu']:4.0%}  {r['cpu_us_per_msg']:5.0f} us CPU/msg")
            print(f"  new/old: {s['new']['msg_per_s'] / s['old']['msg_per_s']:.2f}x msg/s, "
                  f"{s['new']['cpu_us_per_msg'] / s['old']['cpu_us_per_msg']:.2f}x CPU per message")
    return 0


def compare(agents: dict[str, tuple[h.Agent, int]], connections: int, order: tuple[str, ...],
            args: argparse.Namespace) -> dict[str, dict[str, float]]:
    runs: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
    for rnd in range(args.rounds):
        for kind in order:
            agent, port = agents[kind]
            with h.CpuSampler({"server": agent.pid}) as cpu:
                report = h.run_loadgen([port], connections, duration=args.duration, count=None,
                                       warmup=args.warmup, prefix=f"{kind[0]}{connections}.{rnd}.{len(runs[kind])}")
            h.check_all_accepted(report, f"{kind} at {connections} connection(s)")
            report["cpu"] = cpu.share("server", report["t_measure_mono"], report["t_end_mono"])
            runs[kind].append(report)
            lat = report["latency_ms"]
            print(f"  round {rnd + 1} {kind} c={connections:<3} {report['msg_per_s']:8.0f} msg/s  "
                  f"p50 {lat['p50']:6.2f}  p99 {lat['p99']:6.2f} ms  server CPU {report['cpu']:4.0%}  "
                  f"{report['cpu'] / report['msg_per_s'] * 1e6:5.0f} us CPU/msg", flush=True)
    return {kind: {"msg_per_s": h.median([r["msg_per_s"] for r in rs]),
                   "p50_ms": h.median([r["latency_ms"]["p50"] for r in rs]),
                   "p99_ms": h.median([r["latency_ms"]["p99"] for r in rs]),
                   "cpu": h.median([r["cpu"] for r in rs]),
                   "cpu_us_per_msg": h.median([r["cpu"] / r["msg_per_s"] * 1e6 for r in rs])}
            for kind, rs in runs.items()}


if __name__ == "__main__":
    sys.exit(main())

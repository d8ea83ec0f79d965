"""Where intake's CPU goes, by thread: the daemon's CPU per accepted message, event loop and writer apart.

    .venv/bin/python bench/threads.py [--connections 16 1] [--runs 2] [--duration 6] [--tree DIR]

The daemon (``synchronous = "full"``, ``ack = "commit"``, one channel) is
driven by the C load generator at each connection count, ``--runs`` times
after a warm-up run. Around each run the CPU of every thread is read from
``/proc/PID/task/TID/schedstat`` (nanoseconds, counted by the scheduler: exact,
where ``utime`` is sampled at the tick; user and system from ``stat``). It
prints msg/s, ACK latency and, per thread, CPU microseconds per accepted
message: the event loop (the main thread), the writer (the busiest other
thread under intake load: it runs every statement, the WAL writes and the
fsync) and the rest together.

Reading it: the loop and the writer share one GIL and, with every sender
waiting on the same COMMIT, mostly take turns — so their sum against one
core's worth, not each alone, is what bounds msg/s. ``--tree`` measures
another checkout (a worktree of another commit, or one with an experiment's
patch applied; environment variables the patch reads pass through to the
daemon). bench/README.md, "Ninth round", shows its use.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import harness as h


def thread_times(pid: int) -> dict[int, tuple[int, float, float]]:
    """Per thread id: (CPU ns from schedstat, user s, system s)."""
    out: dict[int, tuple[int, float, float]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            ns = int((task / "schedstat").read_text().split()[0])
            stat = (task / "stat").read_text()
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
        out[int(task.name)] = (ns, *h.user_system_seconds(stat))
    return out


def per_message(pid: int, before: dict[int, tuple[int, float, float]], after: dict[int, tuple[int, float, float]],
                messages: int) -> dict[str, dict[str, float]]:
    """CPU µs per message of the loop, the writer (busiest other thread) and the rest."""
    deltas = {tid: (after[tid][0] - t[0], after[tid][1] - t[1], after[tid][2] - t[2])
              for tid, t in before.items() if tid in after}
    others = sorted((tid for tid in deltas if tid != pid), key=lambda tid: deltas[tid][0], reverse=True)
    groups = {"loop": [pid], "writer": others[:1], "rest": others[1:]}
    out: dict[str, dict[str, float]] = {}
    for name, tids in groups.items():
        ns = sum(deltas[t][0] for t in tids if t in deltas)
        user = sum(deltas[t][1] for t in tids if t in deltas)
        system = sum(deltas[t][2] for t in tids if t in deltas)
        out[name] = {"us": ns / 1e3 / messages, "user_us": user * 1e6 / messages, "sys_us": system * 1e6 / messages}
    out["total"] = {"us": sum(g["us"] for g in out.values())}
    return out


def measure(agent: h.Agent, port: int, connections: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    h.run_loadgen([port], connections, duration=args.warmup, prefix=f"w{connections}")  # warm-up, not counted
    runs = []
    for n in range(args.runs):
        before = thread_times(agent.pid)
        report = h.run_loadgen([port], connections, duration=args.duration, prefix=f"c{connections}r{n}")
        after = thread_times(agent.pid)
        h.check_all_accepted(report, f"{connections} connection(s)")
        messages = int(report["acked"])
        cpu = per_message(agent.pid, before, after, messages)
        runs.append({"connections": connections, "msg_per_s": report["msg_per_s"],
                     "p50_ms": report["latency_ms"]["p50"], "p99_ms": report["latency_ms"]["p99"],
                     "messages": messages, "cpu_us_per_msg": cpu})
        print(f"  c={connections:<3d} {report['msg_per_s']:7.0f} msg/s  p50 {report['latency_ms']['p50']:5.2f}  "
              f"p99 {report['latency_ms']['p99']:5.2f} ms   CPU µs per message: "
              + "  ".join(f"{name} {g['us']:5.1f}" + (f" (user {g['user_us']:.0f}, sys {g['sys_us']:.0f})"
                                                        if "user_us" in g else "")
                          for name, g in cpu.items()), flush=True)
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, nargs="+", default=[16, 1])
    parser.add_argument("--runs", type=int, default=2, help="measured runs per connection count")
    parser.add_argument("--duration", type=float, default=6.0, help="seconds per measured run")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of the uncounted run before them")
    parser.add_argument("--tree", help="the source tree whose daemon runs (default: this checkout)")
    parser.add_argument("--workdir")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--json", help="write every run's figures here")
    parser.add_argument("--smoke", action="store_true", help="one short run each: proves the bench works")
    args = parser.parse_args()
    h.stop_on_sigterm()
    if args.smoke:
        args.runs, args.duration, args.warmup = 1, 0.5, 0.2
    if args.tree:
        h.REPO = Path(args.tree).resolve()  # the daemon's PYTHONPATH
    with h.workdir(args.workdir, args.keep) as wd:
        info = h.machine(wd)
        h.print_machine(info)
        print(f"tree: {h.REPO}")
        channel = {"name": "adt", "listen": f"127.0.0.1:{h.free_port()}", "ack": "commit",
                   "max_connections": max(64, max(args.connections) + 8)}
        agent = h.Agent(wd, h.agent_config(wd / "data", [channel], admin_port=h.free_port()))
        try:
            agent.wait_ready()
            port = h.channel_ports([channel])[0]
            runs = [run for c in args.connections for run in measure(agent, port, c, args)]
        finally:
            agent.stop()
    print("\nmedians, CPU µs per accepted message:")
    for c in args.connections:
        mine = [r for r in runs if r["connections"] == c]
        med = {name: statistics.median(r["cpu_us_per_msg"][name]["us"] for r in mine)
               for name in ("loop", "writer", "rest", "total")}
        print(f"  {c:3d} connection(s): {statistics.median(r['msg_per_s'] for r in mine):7.0f} msg/s   "
              + "  ".join(f"{name} {value:6.1f}" for name, value in med.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "tree": str(h.REPO), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

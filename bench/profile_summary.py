"""Where the time goes, from a ``py-spy record --format raw --threads --idle [--native]`` file.

    .venv/bin/python bench/profile_summary.py PROFILE.txt [--top 20]

With ``--idle`` every thread has a sample per tick, waiting or not. The
frame at the top of each native stack tells what a thread was doing:
waiting for I/O readiness (epoll_wait, poll, select), for the disk
(fsync, fdatasync), for the GIL or another lock (pthread_cond_*wait,
sem_*wait, futex), or running. Per thread this prints that split, then the
functions where the running samples were ("self", native frames grouped by
library) and the functions on their stacks ("inclusive").
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<where>[^()]*)\)$")

#: Leaf native functions that mean "not running" and what the thread waits for.
WAITS = {
    "epoll_wait": "waiting for I/O (event loop idle)",
    "poll": "waiting for I/O (event loop idle)",
    "select": "waiting for I/O (event loop idle)",
    "fdatasync": "waiting for the disk (fsync)",
    "fsync": "waiting for the disk (fsync)",
    # CPython 3.11 takes the GIL back through pthread_cond_timedwait (take_gil is inlined)
    "pthread_cond_timedwait": "waiting for the GIL",
    "pthread_cond_wait": "waiting for the GIL",
    # a Python lock or queue.get(): a thread waiting for work
    "PyThread_acquire_lock_timed": "waiting for a lock or queue (no work)",
    "sem_wait": "waiting for a lock or queue (no work)",
    "sem_timedwait": "waiting for a lock or queue (no work)",
    "sem_clockwait": "waiting for a lock or queue (no work)",
    # native frames above it are not always named: SQLite writing and syncing its WAL
    "sqlite3WalFrames": "waiting for the disk (fsync)",
}


def frame_name(frame: str) -> str:
    """``func (file:line)`` -> ``func (file)``; a bare native address -> ``[native lib]``."""
    match = _FRAME.match(frame.strip())
    if match is None:
        return frame.strip()
    func, where = match.group("func"), match.group("where")
    path = where.rsplit(":", 1)[0] if ":" in where else where
    base = Path(path).name
    if func.startswith("0x"):
        return f"[native {base}]"
    if "/agent/" in path:
        base = "agent/" + base
    return f"{func} ({base})"


def leaf_state(frames: list[str]) -> str:
    """What the thread was doing: the first named frame from the top, skipping bare addresses."""
    for frame in reversed(frames):
        if frame.startswith("[native"):
            continue
        func = frame.split(" (", 1)[0]
        return WAITS.get(func, "running")
    return "running"


def parse(path: Path) -> dict[str, list[tuple[list[str], int]]]:
    threads: dict[str, list[tuple[list[str], int]]] = defaultdict(list)
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        head, *frames = stack.split(";")
        thread = head.split(":", 1)[1].strip() if ":" in head else head
        threads[thread].append(([frame_name(f) for f in frames], int(count)))
    return threads


def summarise(path: Path, top: int) -> str:
    threads = parse(path)
    out = [f"{path}"]
    running_all = sum(n for stacks in threads.values() for frames, n in stacks if leaf_state(frames) == "running")
    for thread, stacks in sorted(threads.items(), key=lambda kv: -sum(n for _, n in kv[1])):
        t_total = sum(n for _, n in stacks)
        states: Counter[str] = Counter()
        leaf: Counter[str] = Counter()
        inclusive: Counter[str] = Counter()
        for frames, n in stacks:
            state = leaf_state(frames)
            states[state] += n
            if state != "running":
                continue
            if frames:
                leaf[frames[-1]] += n
            for name in set(frames):
                inclusive[name] += n
        running = states["running"]
        out.append(f"\n== thread {thread}: {t_total} samples; running {running / t_total:.1%} of its wall time "
                   f"({running / running_all:.1%} of all running samples of the process)" if running_all else "")
        out += [f"    {n / t_total:6.1%}  {state}" for state, n in states.most_common() if state != "running"]
        if not running:
            continue
        out.append("  running, self (top of stack), share of this thread's running samples:")
        out += [f"    {n / running:6.1%}  {name}" for name, n in leaf.most_common(top)]
        out.append("  running, inclusive (on the stack; frames on nearly every stack left out):")
        out += [f"    {n / running:6.1%}  {name}" for name, n in inclusive.most_common()
                if n < 0.97 * running][:top]
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profiles", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    for path in args.profiles:
        print(summarise(path, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())

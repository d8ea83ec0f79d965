"""The disk's share of one commit: N WAL frames written, then fdatasync, timed on the work dir's disk.

    .venv/bin/python bench/commit_floor.py [--frames 1 2 4 8 12 16 32 55] [--commits 400]

A SQLite commit in WAL mode appends one frame per page it changed (a 24-byte
header and the 4 KiB page, one ``pwrite`` each) and, with ``synchronous =
"full"``, fdatasyncs the WAL before COMMIT returns. This does just that on a
preallocated file, ``--commits`` times per frame count, and prints the
median and p90 wall time: what a commit of that many pages costs before any
statement runs — the floor under the ACK of a lone sender, whose every
message is a commit of its own (bench/wal_frames.py counts how many pages
intake's commits change). The work dir decides the disk measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import harness as h

FRAME_HEADER = 24
PAGE = 4096


def commit_times(directory: Path, frames: int, commits: int) -> list[float]:
    """Wall seconds of ``commits`` rounds of ``frames`` frame writes and one fdatasync."""
    slots = 64  # frames written in turn over a preallocated file, as a WAL after a checkpoint
    path = directory / "commit-floor.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, bytes(slots * (FRAME_HEADER + PAGE)))
        os.fsync(fd)
        header, page = os.urandom(FRAME_HEADER), os.urandom(PAGE)
        times, slot = [], 0
        for _ in range(commits):
            started = time.perf_counter()
            for _ in range(frames):
                offset = slot * (FRAME_HEADER + PAGE)
                os.pwrite(fd, header, offset)
                os.pwrite(fd, page, offset + FRAME_HEADER)
                slot = (slot + 1) % slots
            os.fdatasync(fd)
            times.append(time.perf_counter() - started)
        return times
    finally:
        os.close(fd)
        path.unlink()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 32, 55])
    parser.add_argument("--commits", type=int, default=400, help="commits timed per frame count")
    parser.add_argument("--workdir")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--smoke", action="store_true", help="a few commits each: proves the bench works")
    args = parser.parse_args()
    if args.smoke:
        args.commits = 5
    with h.workdir(args.workdir, args.keep) as wd:
        info = h.machine(wd)
        h.print_machine(info)
        rows = []
        for frames in args.frames:
            times = sorted(commit_times(wd, frames, args.commits))
            row = {"frames": frames, "median_us": statistics.median(times) * 1e6,
                   "p90_us": times[int(0.9 * (len(times) - 1))] * 1e6}
            rows.append(row)
            print(f"  {frames:3d} frames + fdatasync: median {row['median_us']:6.0f} µs, p90 {row['p90_us']:6.0f} µs",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "commits": args.commits, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

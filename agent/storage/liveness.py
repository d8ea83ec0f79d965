"""Whether the process that holds the dispatch lease still runs (docs/queue.md#takeover).

A lease row names its holder by PID, boot id, PID namespace and process start
time. On the same boot and in the same PID namespace, a PID that is gone, was
reused (another start time) or has exited (a zombie) proves the holder dead,
so a successor need not wait out the TTL. Anywhere else nothing is proven.
This reads /proc (proc(5)): I/O, hence here and not in ``agent.core``.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LeaseHolder", "holder_provably_dead", "process_start_ticks", "read_boot_id", "read_pidns"]


@dataclass(frozen=True)
class LeaseHolder:
    """Who holds (or wants) the dispatch lease, with what proves it alive."""

    holder: str
    pid: int
    boot_id: str
    pidns: str
    start_ticks: int

    @classmethod
    def for_this_process(cls, agent_id: str) -> LeaseHolder:
        pid = os.getpid()
        return cls(
            holder=f"{agent_id}@{os.uname().nodename}:{pid}:{uuid.uuid4().hex[:8]}",
            pid=pid,
            boot_id=read_boot_id(),
            pidns=read_pidns(),
            start_ticks=process_start_ticks(pid) or 0,
        )


def read_boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def read_pidns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _process_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time) from /proc/PID/stat, fields 3 and 22 (proc(5)); None if no such PID."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


def process_start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks since boot)."""
    found = _process_stat(pid)
    return found[1] if found is not None else None


#: proc(5) states of a process that has exited: Z (zombie: killed or exited,
#: not yet reaped by its parent) and X (dead). A stopped process (T, t) may
#: still resume, so it counts as alive.
_EXITED_STATES = frozenset({"Z", "X"})


def process_exited(pid: int) -> bool:
    """No such PID, or it exited and waits to be reaped (a zombie): it runs no code."""
    found = _process_stat(pid)
    return found is None or found[0] in _EXITED_STATES


def holder_provably_dead(pid: int | None, boot: str | None, pidns: str | None, start: int | None) -> bool:
    """Same boot and PID namespace, and the PID is gone, reused, or has exited unreaped (a zombie).

    A zombie keeps its /proc entry and start time until its parent reaps it
    (a supervisor may take its time), yet runs no code: it can dispatch
    nothing, so a standby need not wait out the TTL for it.
    """
    if pid is None or not boot or not pidns:
        return False
    if boot != read_boot_id() or pidns != read_pidns():
        return False
    found = _process_stat(pid)
    if found is None:
        return True
    state, ticks = found
    return (start is not None and ticks != start) or state in _EXITED_STATES

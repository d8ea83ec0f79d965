"""The writer's own WAL checkpoints: when one is due, and the checkpoint itself.

SQLite copies the WAL back into the database file at a checkpoint. Its
automatic one runs inside the COMMIT that crosses 1000 frames, so that
batch's answers (its senders' ACKs) wait for the copy and an fsync of the
file: several milliseconds at every thousandth page, which was the ACK
latency's p99 under load. The daemon's writer runs a smaller one itself,
after it answered the batch (agent/storage/writer.py); SQLite's stays as a
backstop (agent/storage/sqlite.py: WRITER_AUTOCHECKPOINT_PAGES). The
housekeeping checkpoints (``checkpoint_interval``, the truncating one at a
pause) are agent/storage/maintenance.py's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.storage.store_base import StoreBase

#: The writer checkpoints the WAL after about this many frames (pages) were committed.
#: A checkpoint copies each page once however often the WAL holds it, and
#: fsyncs the file: fewer, larger ones cost less in all, but the batch after
#: one waits for it. Half SQLite's default (1000): intake_ab at 16 connections,
#: 4 rounds, measured 0.98x msg/s and ACK p99 10.7 -> 8.6 ms against checkpoints
#: inside COMMIT; at 1000, 1.05x and 12.3 -> 11.7 ms; at 256, 0.93x.
CHECKPOINT_FRAMES = 512

#: How far the WAL file may outgrow its size limit (``journal_size_limit``,
#: to which a restarted WAL is cut back) before the writer checkpoints at once,
#: whatever its count says. The free-space floor reserves room for a WAL of
#: that limit (agent/storage/maintenance.py); past it, the WAL eats the reserve.
WAL_SLACK_BYTES = 256 * 1024


class CheckpointPacer:
    """When the writer runs its next WAL checkpoint: after about ``frames`` committed frames.

    How many frames a commit writes depends on the load — about 12 for one
    message, 40 for seven (bench/wal_frames.py), so the pacer counts commits
    and learns the frames per commit from each checkpoint's count of the WAL.
    Pure; :func:`passive_checkpoint` is the I/O the writer runs.
    """

    def __init__(self, frames: int = CHECKPOINT_FRAMES, per_commit: float = 12.0,
                 wal_limit: int = 4 * 1024 * 1024) -> None:
        self.frames = frames
        self.per_commit = per_commit
        self.commits = 0
        self.wal_limit = wal_limit
        self._wal_checked = 0  # the WAL's size at the last checkpoint its size called for

    def committed(self) -> bool:
        """A commit happened; True when the checkpoint is due now."""
        self.commits += 1
        return self.commits * self.per_commit >= self.frames

    def wal_too_long(self, wal_bytes: int) -> bool:
        """The WAL file is ``wal_bytes`` long after a commit: True when that calls for a checkpoint now.

        The count above is an estimate learned from the last interval: after
        quiet commits of a frame each (lease renewals), a burst of commits of
        large rows writes many times the frames it expects, and once wrote
        8 MiB of WAL before its next checkpoint, filling a disk the floor had
        been keeping free. The file's size is the check the estimate cannot
        fool: a WAL past its limit has not restarted since it was that short.
        """
        if wal_bytes <= self.wal_limit:
            self._wal_checked = 0
            return False
        if wal_bytes <= max(self.wal_limit, self._wal_checked) + WAL_SLACK_BYTES:
            return False
        self._wal_checked = wal_bytes
        return True

    def checkpointed(self, wal_frames: int) -> None:
        """The checkpoint ran and found ``wal_frames`` frames in the WAL (-1: it could not look).

        After a complete checkpoint SQLite starts the WAL again at the next
        commit, so the next count covers this interval's commits only; after
        an incomplete one (a reader still used old frames) it covers more,
        the estimate grows and the next checkpoint comes sooner.
        """
        if wal_frames > 0 and self.commits > 0:
            self.per_commit = max(1.0, wal_frames / self.commits)
        self.commits = 0


def passive_checkpoint(store: StoreBase) -> int:
    """A PASSIVE checkpoint (it waits for no lock and blocks nobody): the WAL's frames, -1 if busy."""
    row = store.conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    return int(row[1])

"""When the writer checkpoints the WAL (agent/storage/checkpoints.py): pure decisions."""

from __future__ import annotations

from agent.storage import checkpoints
from agent.storage.checkpoints import CheckpointPacer


def commits_until_due(pacer: CheckpointPacer) -> int:
    n = 1
    while not pacer.committed():
        n += 1
    return n


def test_one_message_commits_are_checkpointed_every_frames_worth() -> None:
    pacer = CheckpointPacer(frames=256, per_commit=12.0)
    assert commits_until_due(pacer) == 22  # 22 * 12 >= 256


def test_it_learns_the_frames_per_commit_from_each_checkpoint() -> None:
    """Busy commits of several messages write more frames: the next checkpoint comes after fewer of them."""
    pacer = CheckpointPacer(frames=256, per_commit=12.0)
    commits_until_due(pacer)
    pacer.checkpointed(22 * 40)  # the WAL held 40 frames per commit
    assert commits_until_due(pacer) == 7  # 7 * 40 >= 256
    pacer.checkpointed(7 * 10)
    assert commits_until_due(pacer) == 26


def test_a_checkpoint_that_could_not_look_keeps_the_estimate() -> None:
    pacer = CheckpointPacer(frames=256, per_commit=32.0)
    commits_until_due(pacer)
    pacer.checkpointed(-1)  # busy: another connection was checkpointing
    assert pacer.commits == 0 and commits_until_due(pacer) == 8


def test_a_wal_past_its_limit_calls_for_a_checkpoint_whatever_the_count() -> None:
    """Past the limit by the slack: due; again only after it grew by the slack once more; reset once cut back."""
    limit, slack = 4096 * 1024, checkpoints.WAL_SLACK_BYTES
    pacer = CheckpointPacer(wal_limit=limit)
    assert not pacer.wal_too_long(limit)
    assert not pacer.wal_too_long(limit + slack)
    assert pacer.wal_too_long(limit + slack + 1)
    assert not pacer.wal_too_long(limit + slack + 2)  # a reader held it: not at every commit
    assert pacer.wal_too_long(limit + 2 * slack + 2)
    assert not pacer.wal_too_long(limit)  # restarted and cut back to the limit
    assert pacer.wal_too_long(limit + slack + 1)

"""The queue's frozen state set and its legal transitions (SPEC section 6).

Like h11, everything that shapes the state machine lives here, as a table.
The same set stands in the schema as a CHECK constraint; a test keeps them equal.
"""

from __future__ import annotations

from agent.errors import LocalError

QUEUED = "queued"
CLAIMED = "claimed"  # taken by the dispatcher, provably not sent
INFLIGHT = "inflight"  # committed *before* the frame is written
PROCESSED = "processed"
REJECTED = "rejected"
FAILED = "failed"
NACKED = "nacked"  # audit row of refused intake

ALL = (QUEUED, CLAIMED, INFLIGHT, PROCESSED, REJECTED, FAILED, NACKED)
LIVE = frozenset({QUEUED, CLAIMED, INFLIGHT})
SETTLED = frozenset({PROCESSED, REJECTED, FAILED})
#: Never purged by `queue purge`: these rows may still be delivered.
NEVER_PURGED = LIVE

ACK_OUTCOMES = ("pending", "delivered", "undelivered", "not_owed")

#: state → states it may move to, and why.
TRANSITIONS: dict[str, frozenset[str]] = {
    QUEUED: frozenset({CLAIMED, FAILED, REJECTED}),  # claim; too big / attempts exhausted
    CLAIMED: frozenset({INFLIGHT, QUEUED, FAILED, REJECTED}),  # send; recovery; too big
    # resend (same state, attempt+1), settle, retry with backoff, recovery
    INFLIGHT: frozenset({INFLIGHT, PROCESSED, REJECTED, FAILED, QUEUED}),
    PROCESSED: frozenset(),
    REJECTED: frozenset({QUEUED}),  # operator re-drive (`queue retry`)
    FAILED: frozenset({QUEUED}),  # operator re-drive
    NACKED: frozenset(),
}


class IllegalTransition(LocalError):
    """Our bug: code asked for a move the state machine forbids."""


def check_transition(old: str, new: str) -> None:
    if new not in TRANSITIONS.get(old, frozenset()):
        raise IllegalTransition(f"a {old} row cannot become {new}")

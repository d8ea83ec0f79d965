"""The queue's row states, their groups, and the events that move a row (docs/queue.md#row-states).

Like h11, everything that shapes the state machine lives here, in one table:
each :class:`Event` names the states a row may be in for it to happen and the
state it leaves the row in. The store's guarded SQL (``WHERE … state IN (…)``)
implements each event; a test keeps the SQL in step with this table, and the
schema's CHECK constraint with :class:`State`. No other Python module spells a
state's name: they use these members (a ``StrEnum``, so a member *is* its
string in SQL parameters and JSON).

The state set is frozen: the previous version of the agent must keep working
on a database this one wrote (docs/queue.md#schema-versions-and-upgrades).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, StrEnum

from agent.errors import LocalError

__all__ = [
    "ACK_OUTCOMES",
    "ALL",
    "DEPTH",
    "IN_FLIGHT",
    "LIVE",
    "PURGEABLE",
    "REDRIVABLE",
    "RETAINED",
    "SETTLED",
    "TRANSITIONS",
    "AckOutcome",
    "Event",
    "IllegalTransition",
    "Move",
    "State",
]


class State(StrEnum):
    """Where a row stands. The order is the life of a row."""

    QUEUED = "queued"  # accepted, waiting for its turn
    CLAIMED = "claimed"  # taken by the dispatcher, provably not sent
    INFLIGHT = "inflight"  # committed *before* the frame is written
    PROCESSED = "processed"  # the server answered 2xx
    REJECTED = "rejected"  # the server answered 4xx, or the row can never be sent
    FAILED = "failed"  # given up, ambiguous, or set aside: waits for an operator
    NACKED = "nacked"  # audit row of a frame intake refused or only recorded


class AckOutcome(StrEnum):
    """Whether the source got its final ACK (docs/queue.md#ack-outcome)."""

    PENDING = "pending"
    DELIVERED = "delivered"
    UNDELIVERED = "undelivered"
    NOT_OWED = "not_owed"


ALL: tuple[State, ...] = tuple(State)
ACK_OUTCOMES: tuple[AckOutcome, ...] = tuple(AckOutcome)
#: Rows that may still be delivered: the dispatcher's, never an operator's to delete,
#: never purged (by retention or by ``queue purge``).
LIVE = frozenset({State.QUEUED, State.CLAIMED, State.INFLIGHT})
#: Rows whose dispatch ended (the server's answer, or giving up).
SETTLED = frozenset({State.PROCESSED, State.REJECTED, State.FAILED})
#: What ``queue purge`` may delete (``failed`` too, though never automatically).
PURGEABLE = (State.PROCESSED, State.REJECTED, State.FAILED, State.NACKED)
#: What retention and the size cap purge by themselves: ``failed`` rows are
#: undelivered messages and stay until an operator acts.
RETAINED = (State.PROCESSED, State.REJECTED, State.NACKED)
#: What ``queue retry`` puts back to ``queued``.
REDRIVABLE = (State.FAILED, State.REJECTED)
#: What counts as a channel's depth (its backlog).
DEPTH = (State.QUEUED, State.CLAIMED, State.INFLIGHT)
#: Taken by the dispatcher: on a partitioned channel, a key with one of these has its turn.
IN_FLIGHT = frozenset({State.CLAIMED, State.INFLIGHT})


@dataclass(frozen=True)
class Move:
    """What an event needs (``sources``: empty means a new row) and what it leaves."""

    sources: frozenset[State]
    targets: frozenset[State]
    why: str


def _move(sources: set[State], targets: set[State], why: str) -> Move:
    return Move(frozenset(sources), frozenset(targets), why)


class Event(Enum):
    """Everything that happens to a row, with the states it needs and leaves (the one table)."""

    INTAKE = _move(set(), {State.QUEUED}, "a message committed by intake")
    AUDIT = _move(set(), {State.NACKED}, "a refused or recorded-only frame kept for audit")
    CLAIM = _move({State.QUEUED}, {State.CLAIMED}, "the dispatcher takes the channel's head")
    SEND = _move({State.CLAIMED}, {State.INFLIGHT}, "committed before the frame is written")
    CLAIM_AND_SEND = _move({State.QUEUED}, {State.INFLIGHT},
                           "CLAIM and SEND in one statement: claimed only inside it, never committed so")
    RESEND = _move({State.INFLIGHT}, {State.INFLIGHT},
                   "a replaying server gets the same id again, attempt + 1")
    SETTLE = _move({State.INFLIGHT}, {State.PROCESSED, State.REJECTED, State.FAILED},
                   "the server answered this attempt")
    RETRY = _move({State.INFLIGHT, State.CLAIMED}, {State.QUEUED},
                  "transient answer or not sent: back to the head with a backoff")
    GIVE_UP = _move({State.QUEUED, State.CLAIMED, State.INFLIGHT}, {State.FAILED, State.REJECTED},
                    "max_attempts reached, too big to send, undecodable, or ambiguous")
    RECOVER = _move({State.CLAIMED}, {State.QUEUED},
                    "a new lease tenure: claimed rows were provably not sent")
    REDRIVE = _move({State.FAILED, State.REJECTED}, {State.QUEUED}, "operator: queue retry")
    SET_ASIDE = _move({State.QUEUED}, {State.FAILED}, "operator: queue fail")

    @property
    def sources(self) -> frozenset[State]:
        return self.value.sources

    @property
    def targets(self) -> frozenset[State]:
        return self.value.targets


#: state → the states it may move to (derived from the events).
TRANSITIONS: dict[State, frozenset[State]] = {
    state: frozenset(t for e in Event if state in e.sources for t in e.targets) for state in State
}


class IllegalTransition(LocalError):
    """Our bug: code asked for a move the state machine forbids."""


"""What an intake connection asks its shell to do, and the table of its phases.

Actions are dataclasses handed out by ``IntakeConnection.next_actions``
(agent.core.intake); besides these, the policy's effects (``Audit``,
``RecordOutcome``, ``Log``, ``Count``, ``Committed``, agent.core.intake_types)
travel the same way. Each action that needs an answer names the
connection method the shell calls with it. The ones made for every message
(``Commit``, ``Send``) are plain slots classes, not frozen: each is consumed
once by the shell, and a frozen dataclass's ``__init__`` (one
``object.__setattr__`` per field) cost 2.5 times as much.

The phases and their moves are one table (``PHASES``), h11's way: an
illegal move is our bug and raises ``IllegalTransition``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from agent.core.intake_types import Audit, Committed, Count, Log, NewMessage, Owed, RecordOutcome
from agent.core.states import IllegalTransition

__all__ = [
    "DONE",
    "PHASES",
    "READING",
    "WRITING",
    "Abort",
    "Action",
    "AwaitApplicationAck",
    "Clock",
    "Close",
    "Commit",
    "HalfClose",
    "HandOver",
    "Phase",
    "Send",
    "StopWaiting",
    "check_move",
]


class Clock(Protocol):
    """Monotonic time for timers, wall time for ``received_at`` (the shell passes the real ones)."""

    def monotonic(self) -> float: ...
    def time(self) -> float: ...


# -- actions: what the shell does for the connection --------------------------------


@dataclass(slots=True)
class Commit:
    """Commit ``items`` (all or none); answer ``commit_done`` or ``commit_failed`` with ``ticket``."""

    ticket: int
    items: tuple[NewMessage, ...]


@dataclass(slots=True)
class Send:
    """Write ``frame`` (one MLLP-framed ACK) in its own write; answer ``written(send, ok)``."""

    frame: bytes
    message_id: str | None = None  # whose ack_outcome the write settles
    relayed: bool = False  # an enhanced-mode application ACK (logged once written)
    also: tuple[str, ...] = ()  # further rows the write settles (the members of an ACK batch)


@dataclass(slots=True)
class AwaitApplicationAck:
    """Ask the relay for the row's application ACK until ``deadline`` (monotonic; None: no limit).

    Answer ``application_ack(token, ack or None)``.
    """

    token: int
    message_id: str
    deadline: float | None


@dataclass(slots=True)
class StopWaiting:
    """The ACK awaited under ``token`` is no longer wanted: stop asking."""

    token: int


@dataclass(frozen=True, slots=True)
class HandOver:
    """Offer the live connection to the successor, with the bytes not handled and what is owed.

    Wait up to ``quiet_within`` seconds for our ACKs to leave the socket
    buffer first (an ACK still in it would go with our copy of the fd). With
    ``or_without_owed``, a successor that refuses ``owed`` (a previous
    version) is offered the connection alone when only relays are owed.
    Answer ``handover_done``.
    """

    buffered: bytes
    owed: Owed
    or_without_owed: bool
    quiet_within: float


@dataclass(frozen=True, slots=True)
class HalfClose:
    """Send FIN after the last ACK (then the sender's late bytes are read and discarded)."""


@dataclass(frozen=True, slots=True)
class Close:
    """Close the connection once what was written is sent."""


@dataclass(frozen=True, slots=True)
class Abort:
    """Drop our handle on the connection now (aborted, or the successor holds it)."""


Action = (Commit | Send | AwaitApplicationAck | StopWaiting | HandOver | HalfClose | Close | Abort
          | Audit | RecordOutcome | Log | Count | Committed)


class Phase(Enum):
    """Where a connection stands."""

    # By identity, as members compare: Enum's own __hash__ is a Python call, and
    # the phase is looked up in READING/WRITING/DONE a dozen times per message.
    __hash__ = object.__hash__

    OPEN = "open"  # reading and handling frames
    FINISHING = "finishing"  # asked to close: reading until the frame in progress is complete
    DRAINING = "draining"  # reading ended: writing what is owed
    HANDING_OVER = "handing_over"  # a successor is being offered the connection
    LINGERING = "lingering"  # FIN sent after the last ACK; discarding what the sender still sends
    CLOSED = "closed"  # nothing more goes out (closed, evicted, aborted, lost)
    HANDED_OVER = "handed_over"  # a successor serves the connection now


PHASES: dict[Phase, frozenset[Phase]] = {
    Phase.OPEN: frozenset({Phase.FINISHING, Phase.DRAINING, Phase.CLOSED}),
    Phase.FINISHING: frozenset({Phase.DRAINING, Phase.CLOSED}),
    Phase.DRAINING: frozenset({Phase.HANDING_OVER, Phase.LINGERING, Phase.CLOSED}),
    Phase.HANDING_OVER: frozenset({Phase.DRAINING, Phase.HANDED_OVER, Phase.CLOSED}),
    Phase.LINGERING: frozenset({Phase.CLOSED}),
    Phase.CLOSED: frozenset(),
    Phase.HANDED_OVER: frozenset(),
}
READING = frozenset({Phase.OPEN, Phase.FINISHING})
WRITING = frozenset({Phase.OPEN, Phase.FINISHING, Phase.DRAINING})
DONE = frozenset({Phase.CLOSED, Phase.HANDED_OVER})


def check_move(phase: Phase, to: Phase) -> None:
    """Raise IllegalTransition unless ``PHASES`` lets a connection in ``phase`` become ``to``."""
    if to not in PHASES[phase]:
        raise IllegalTransition(f"intake connection: {phase.value} cannot become {to.value}")

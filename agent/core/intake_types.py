"""The data intake's core, its policy, the connection shell and the hand-over share.

Dataclasses only, frozen but for the few made per message (see below): a
channel's intake settings (:class:`ChannelPolicy`), a message to commit (:class:`NewMessage`) and an audit row
(:class:`AuditRecord`) on their way to the store, the store's answer as the
core reads it (:class:`CommitResult`), what a sender is owed
(:class:`OwedReply`, :class:`Owed` — also what travels to a successor at an
upgrade, agent.runtime.adoption), and the effects a policy decision asks
for (:class:`Decision`).

:class:`NewMessage`, :class:`Decision`, :class:`Log`, :class:`RecordOutcome`
and :class:`Committed` are built for every message and read once: plain
slots classes, not frozen (a frozen dataclass's ``__init__`` sets each field
through ``object.__setattr__``, 2.5 times the cost). Nothing changes them
after they are made. The counts every message makes are shared constants
(:data:`RECEIVED`, :data:`COMMITTED`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal, Protocol

from agent.core.batch import Batch
from agent.core.envelope import Envelope
from agent.core.states import AckOutcome

__all__ = [
    "COMMITTED",
    "NOTHING_OWED",
    "NO_REPLY",
    "RECEIVED",
    "AckMode",
    "Audit",
    "AuditRecord",
    "BatchPlan",
    "ChannelPolicy",
    "CommitResult",
    "Committed",
    "Count",
    "Counter",
    "Decision",
    "Effect",
    "Log",
    "NewMessage",
    "Owed",
    "OwedFrame",
    "OwedRelay",
    "OwedReply",
    "OwedWait",
    "RecordOutcome",
]

#: How a row is answered: a commit ACK, the server's ACK held for the sender
#: (original mode, channel ``ack = "application"``), or enhanced mode (MSH-15/16).
AckMode = Literal["commit", "application", "enhanced"]

@dataclass(frozen=True)
class ChannelPolicy:
    """What intake needs of one channel's settings (built from ``ChannelSettings`` by the shell)."""

    name: str
    ack: Literal["commit", "application"] = "commit"
    encoding: str = "utf-8"
    max_message_bytes: int = 1048576
    accept_message_types: tuple[str, ...] = ()
    accept_processing_ids: tuple[str, ...] = ()
    accept_versions: tuple[str, ...] = ()
    frame_timeout: float = 60.0
    idle_timeout: float = 0.0  # 0: never
    application_ack_timeout: float = 30.0


# -- what goes to the store ------------------------------------------------------


@dataclass(slots=True)
class NewMessage:
    """A frame that passed every check before the store's: one row to commit."""

    envelope: Envelope
    body: bytes  # exactly as received
    codec: str  # the Python codec it was decoded with
    text: str  # decoded once, segments ended by \r: what the upstream ``body`` carries
    ack_mode: AckMode
    commit_ack: bytes | None  # the accept ACK to send (None: not owed)
    received_at: float  # time.time()


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """An HL7 batch frame whose members passed every check: committed together, all or none."""

    batch: Batch
    messages: tuple[NewMessage, ...]  # one per member, in order
    body: bytes  # the whole frame, as received
    received_at: float


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """A frame refused or only recorded, kept as a ``nacked`` row (docs/queue.md#row-states)."""

    body: bytes
    error_code: str
    error_text: str
    envelope: Envelope | None = None  # MSH fields copied into the row, when readable
    ack_sent: bytes | None = None
    received_at: float = 0.0


class CommitResult(Protocol):
    """What the store answers per committed item (``agent.storage.store.IntakeResult``)."""

    @property
    def outcome(self) -> str: ...  # accepted, duplicate, conflict, backpressure
    @property
    def message_id(self) -> str: ...
    @property
    def seq(self) -> int | None: ...
    @property
    def ack_mode(self) -> str: ...
    @property
    def commit_ack(self) -> bytes | None: ...
    @property
    def app_ack(self) -> bytes | None: ...
    @property
    def prior_state(self) -> str | None: ...
    @property
    def refused_for(self) -> str: ...  # backpressure: "size" or "disk"


# -- what a sender is owed (also what travels to a successor: agent.runtime.adoption) --


@dataclass(frozen=True, slots=True)
class OwedFrame:
    """An ACK ready to write, and the row whose ``ack_outcome`` its write settles (None: none)."""

    frame: bytes
    message_id: str | None = None
    #: Further rows the same write settles: the members of an ACK batch.
    also: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class OwedRelay:
    """An enhanced-mode application ACK to relay when the row settles, if MSH-16 asks for it."""

    message_id: str
    inbound: Envelope


@dataclass(frozen=True, slots=True)
class OwedWait:
    """An application ACK the sender waits for (original mode, ``ack = "application"``).

    ``timeout`` is what is left of ``application_ack_timeout``; after it the
    sender gets AR "resend later" instead.
    """

    message_id: str
    inbound: Envelope
    codec: str
    timeout: float


@dataclass(frozen=True, slots=True)
class OwedReply:
    """One frame's answer: ready ACKs (then, maybe, a relay after them), or a held ACK."""

    frames: tuple[OwedFrame, ...] = ()
    relay: OwedRelay | None = None
    wait: OwedWait | None = None
    #: An ACK batch's members whose application ACKs follow it, one by one.
    relays: tuple[OwedRelay, ...] = ()


@dataclass(frozen=True, slots=True)
class Owed:
    """Everything a connection still owes its sender, in arrival order."""

    replies: tuple[OwedReply, ...] = ()
    relays: tuple[OwedRelay, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.replies or self.relays)


NOTHING_OWED = Owed()
NO_REPLY = OwedReply()


# -- effects ---------------------------------------------------------------------


@dataclass(slots=True)
class Log:
    """A log line: a snake_case event stating a fact, and ids and codes (never message bytes)."""

    level: Literal["debug", "info", "warning", "error"]
    event: str
    fields: dict[str, Any] = field(default_factory=dict)


class Counter(Enum):
    """The intake metrics (agent.runtime.metrics), labelled by channel and ``Count.label``."""

    MESSAGE_RECEIVED = "message_received"
    MESSAGE_COMMITTED = "message_committed"
    MESSAGE_REJECTED = "message_rejected"  # label: the MSA-1 code
    AUDIT_ROW_NOT_STORED = "audit_row_not_stored"
    CONNECTION_TIMED_OUT = "connection_timed_out"  # label: frame or idle


@dataclass(frozen=True, slots=True)
class Count:
    counter: Counter
    label: str = ""


#: The counts of every message, made once.
RECEIVED = Count(Counter.MESSAGE_RECEIVED)
COMMITTED = Count(Counter.MESSAGE_COMMITTED)


@dataclass(frozen=True, slots=True)
class Audit:
    """Keep ``record`` as an audit row; ``then`` is logged only if the row is kept.

    ``limited``: rejected and unparseable frames count against the
    connection's audit bound (docs/acks.md: 100 per minute, then only
    counted); inbound ACKs do not.
    """

    record: AuditRecord
    limited: bool = True
    then: tuple[Log, ...] = ()


@dataclass(slots=True)
class RecordOutcome:
    """Record whether the source got the row's final ACK (docs/queue.md#ack-outcome)."""

    message_id: str
    outcome: AckOutcome


@dataclass(slots=True)
class Committed:
    """A row was committed: the dispatcher may have work."""

    message_id: str


Effect = Log | Count | Audit | RecordOutcome | Committed


@dataclass(slots=True)
class Decision:
    """What to do with one frame (or with its commit's result)."""

    effects: tuple[Effect, ...] = ()
    reply: OwedReply = NO_REPLY  # answered in its turn (arrival order)
    commit: NewMessage | None = None  # commit first: the reply comes from ``replies_for``
    batch: BatchPlan | None = None  # commit these first: the reply comes from ``batch_replies``

"""What goes into the store and what comes out: frozen dataclasses, built by column name.

A query's column names are the dataclass's field names (``build`` checks it
by passing them as keywords), so a column added, dropped or reordered in the
SQL cannot shift a value into the wrong field the way a positional tuple
would. State columns come back as :class:`~agent.core.states.State`.

Over 400 lines on purpose: one small frozen dataclass per query result and
nothing else, all in one place so that a reader finds every row shape the
store returns (and a second dialect must return) together.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

from agent.core.states import AckOutcome, State

__all__ = [
    "AckMode",
    "AuditItem",
    "ChannelActivity",
    "ChannelFlags",
    "HeadRow",
    "IntakeItem",
    "IntakeOutcome",
    "IntakeResult",
    "LastSettled",
    "Lease",
    "LeaseRow",
    "ListedRow",
    "LiveCount",
    "OperatorAction",
    "RecentFailure",
    "RedriveOutcome",
    "ResultRow",
    "RowFilter",
    "RowPlace",
    "SetAsideOutcome",
    "StateCount",
    "StatusHead",
    "StoredRow",
    "build",
]

AckMode = Literal["commit", "application", "enhanced"]
IntakeOutcome = Literal["accepted", "duplicate", "conflict", "backpressure"]

R = TypeVar("R")


class ResultRow(Protocol):
    """A result row readable by column name (``sqlite3.Row``; a dict row elsewhere)."""

    def keys(self) -> list[str]: ...
    def __getitem__(self, key: str) -> Any: ...  # noqa: ANN401 - a column of any type


def build(cls: type[R], row: ResultRow) -> R:
    """``cls`` from one result row, every column passed by its name."""
    return cls(**row)


def _as_state(row: object) -> None:
    state = row.state  # type: ignore[attr-defined]
    if type(state) is not State:
        object.__setattr__(row, "state", State(state))


# -- in ------------------------------------------------------------------------


@dataclass(slots=True)
class IntakeItem:
    """One framed message that passed the envelope checks, ready to queue.

    Not changed once built. Not frozen on purpose: one is built per message on
    the event loop, and a frozen dataclass's ``__init__`` sets each of its
    fields through ``object.__setattr__`` (about three times the cost).
    """

    channel: str
    remote: str
    sending_app: str
    sending_facility: str
    control_id: str
    message_type: str
    body: bytes
    encoding: str
    ack_mode: AckMode
    accept_ack_type: str = ""
    application_ack_type: str = ""
    commit_ack: bytes | None = None  # the accept ACK to send (None: not owed)
    received_at: float = field(default_factory=time.time)
    #: The row's key on a partitioned channel (agent.core.partition); None on other channels.
    partition_key: str | None = None


@dataclass(frozen=True)
class IntakeResult:
    outcome: IntakeOutcome
    message_id: str
    seq: int | None = None
    ack_mode: AckMode = "commit"
    commit_ack: bytes | None = None  # duplicates: the ACK to replay
    app_ack: bytes | None = None  # duplicates: the application ACK, once known
    prior_state: State | None = None  # duplicates: the original row's state
    refused_for: str = ""  # backpressure: "size" (max_db_bytes) or "disk" (min_free_disk_bytes)


@dataclass(frozen=True)
class AuditItem:
    """A frame intake refused or only recorded: kept as a ``nacked`` row."""

    channel: str
    remote: str
    body: bytes
    error_code: str
    error_text: str
    sending_app: str = ""
    sending_facility: str = ""
    control_id: str = ""
    message_type: str = ""
    ack_sent: bytes | None = None
    received_at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class RowFilter:
    """What ``queue list`` selects (None: any); ``limit`` 0 means no limit."""

    state: State | None = None
    channel: str | None = None
    since: float | None = None
    control_id: str | None = None
    limit: int = 50
    show_body: bool = False


# -- out: dispatch ---------------------------------------------------------------


@dataclass(frozen=True)
class HeadRow:
    """The head of a channel: its lowest-seq live row."""

    id: str
    channel: str
    seq: int
    state: State
    attempts: int
    next_attempt_at: float
    claim_epoch: int | None
    remote: str
    control_id: str
    message_type: str
    encoding: str
    body: bytes
    received_at: float
    ack_mode: AckMode
    redrive_base: int = 0
    #: The row's key on a partitioned channel (None: not partitioned, or not computed yet).
    partition_key: str | None = None

    def __post_init__(self) -> None:
        _as_state(self)


@dataclass(frozen=True)
class Lease:
    holder: str
    epoch: int
    expires_at: float


@dataclass(frozen=True)
class LeaseRow:
    """The lease row as stored: the holder's identity is None while nobody holds it."""

    holder: str | None
    holder_pid: int | None
    holder_boot: str | None
    holder_pidns: str | None
    holder_start: int | None
    epoch: int
    expires_at: float | None


# -- out: operator and stats -------------------------------------------------------


@dataclass(frozen=True)
class RowPlace:
    """Where a row stands: enough to decide whether an operator may move it."""

    state: State
    channel: str
    seq: int | None

    def __post_init__(self) -> None:
        _as_state(self)


@dataclass(frozen=True)
class ListedRow:
    """One line of ``queue list`` (``body`` only when asked for)."""

    id: str
    channel: str
    seq: int | None
    state: State
    control_id: str
    message_type: str
    attempts: int
    received_at: float
    error_code: str | None
    remote: str
    updated_at: float
    encoding: str | None
    body: bytes | None
    error_text: str | None = None
    server_reason: str | None = None
    partition_key: str | None = None  # shown as its hash only (patient data)

    def __post_init__(self) -> None:
        _as_state(self)


@dataclass(frozen=True)
class StoredRow:
    """Every column of a row, in the table's order (``queue show``)."""

    id: str
    channel: str
    seq: int | None
    state: State
    remote: str
    sending_app: str
    sending_facility: str
    control_id: str
    message_type: str
    encoding: str | None
    body: bytes
    body_sha256: str
    ack_mode: AckMode
    accept_ack_type: str
    application_ack_type: str
    ack_sent: bytes | None
    app_ack: bytes | None
    ack_outcome: AckOutcome
    attempts: int
    redrive_base: int
    next_attempt_at: float
    claim_epoch: int | None
    server_status: int | None
    server_ack: str | None
    error_code: str | None
    error_text: str | None
    received_at: float
    claimed_at: float | None
    sent_at: float | None
    settled_at: float | None
    updated_at: float
    #: The receiving system's own words (agent.core.acks.server_reason), schema 2.
    server_reason: str | None = None

    def __post_init__(self) -> None:
        _as_state(self)
        if type(self.ack_outcome) is not AckOutcome:
            object.__setattr__(self, "ack_outcome", AckOutcome(self.ack_outcome))


@dataclass(frozen=True)
class ChannelFlags:
    """A channel's durable row: its seq counter and the operator's pause flag."""

    channel: str
    last_seq: int
    paused: bool
    paused_at: float | None
    paused_reason: str | None

    def __post_init__(self) -> None:
        object.__setattr__(self, "paused", bool(self.paused))


@dataclass(frozen=True)
class StateCount:
    """How many rows of one channel are in one state."""

    channel: str
    state: State
    n: int

    def __post_init__(self) -> None:
        _as_state(self)


@dataclass(frozen=True)
class LiveCount:
    """Live rows of one channel in one state, and the oldest queued one's received_at."""

    channel: str
    state: State
    n: int
    oldest: float | None

    def __post_init__(self) -> None:
        _as_state(self)


@dataclass(frozen=True)
class RecentFailure:
    """A failed or rejected row for the status page (no body).

    ``server_reason``: the receiving system's own words for its answer (MSA-3,
    ERR texts), None when it gave none or never answered; ``server_status``
    its last status.
    """

    id: str
    channel: str
    control_id: str
    message_type: str
    state: State
    error_code: str | None
    error_text: str | None
    attempts: int
    updated_at: float
    server_status: int | None = None
    server_reason: str | None = None

    def __post_init__(self) -> None:
        _as_state(self)


@dataclass(frozen=True)
class RedriveOutcome:
    """What ``queue retry ID`` did to one row.

    ``result``: ``moved``; ``would_move`` (dry run); ``missing`` (no such row);
    ``refused`` (not failed/rejected: ``state`` says what it is); ``changed``
    (it was re-drivable when read, but its state changed before the UPDATE).
    """

    id: str
    result: Literal["moved", "would_move", "missing", "refused", "changed"]
    state: State | None = None
    channel: str | None = None


# -- out: the status page ----------------------------------------------------------


@dataclass(frozen=True)
class StatusHead:
    """A channel's head as the status page shows it: where it stands and its last error, no body."""

    id: str
    seq: int
    state: State
    attempts: int
    redrive_base: int
    next_attempt_at: float
    server_status: int | None
    error_code: str | None
    error_text: str | None
    received_at: float
    updated_at: float

    def __post_init__(self) -> None:
        _as_state(self)


@dataclass(frozen=True)
class LastSettled:
    """The row a channel delivered last: how it ended and when."""

    state: State
    settled_at: float | None

    def __post_init__(self) -> None:
        _as_state(self)


@dataclass(frozen=True)
class ChannelActivity:
    """What a channel is doing, for the status page: head, last in, last out, pause."""

    channel: str
    head: StatusHead | None
    last_received_at: float | None
    last_settled: LastSettled | None
    paused: bool
    paused_at: float | None
    paused_reason: str | None


@dataclass(frozen=True)
class SetAsideOutcome:
    """What ``queue fail ID`` did to one row.

    ``result``: ``moved`` (now failed); ``missing`` (no such row); ``refused``
    (not queued at that instant — a claim won, or it is settled: ``state``
    says what it is).
    """

    id: str
    result: Literal["moved", "missing", "refused"]
    state: State | None = None
    channel: str | None = None
    seq: int | None = None


@dataclass(frozen=True)
class OperatorAction:
    """One operator command that changed the queue, as its entry stands (the audit log)."""

    id: int
    action: str
    os_user: str
    pid: int
    channel: str | None
    reason: str | None
    rows: int
    detail: str  # JSON object
    status: str
    started_at: float
    updated_at: float

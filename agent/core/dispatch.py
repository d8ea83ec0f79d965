"""Dispatch policy: what to do with a channel's head, with an answer, and with a send that got none.

Pure functions that return actions (frozen dataclasses); the dispatcher loop
(``agent.runtime.dispatcher``) applies each action with exactly one store
transition, in one commit, and writes the frames. Nothing here waits, reads a
clock or touches the database, so every rule is tested from a table
(tests/unit/test_dispatch_core.py).

- :func:`decide_head`: the head row of a channel (or of a partition) →
  :class:`Wait`, :class:`AwaitSession`, :class:`Claim`, :class:`Send`, or —
  for a row that cannot be sent — :class:`GiveUp` / :class:`Requeue`.
- :func:`on_response`: the server's answer to one attempt → :class:`Settle`,
  :class:`Requeue` (transient, with backoff) or :class:`GiveUp` (attempts spent).
- :func:`on_loss`: no answer will come for this attempt (timeout, connection
  lost, or provably never written) → :class:`KeepInflight`, :class:`Requeue`
  or :class:`GiveUp` (docs/queue.md#recovery).
- :func:`on_unsendable`, :func:`too_big_victim`: a frame too big for the
  server (docs/protocol.md#size-limits).
- :func:`build_transmit` (the body decoded once per send) and
  :func:`application_ack_bytes` (the ACK a source is owed; never raises).

Written for up to ``max_in_flight`` rows in flight per channel (one today:
channels are strict FIFO; partitioned channels raise it): nothing here assumes
the head is the only row in flight, and :func:`decide_head` is asked once per
head with the count of the channel's other rows in flight.

Over 400 lines on purpose: the head, answer and loss decisions must agree on
every row's fate (attempts, backoff, the replay rule, giving up), so they sit
side by side with the actions they return; each is a small function.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal, Protocol, TypeAlias

from agent.core import acks, envelope
from agent.core.partition import shown_key
from agent.core.protocol import StatusClass, Transmit, TransmitResponse, classify_status
from agent.core.retry import attempts_exhausted, retry_delay
from agent.core.states import State
from agent.core.timefmt import rfc3339_utc
from agent.errors import HL7Error

__all__ = [
    "RECHECK_SECONDS",
    "Action",
    "AwaitSession",
    "ChannelPolicy",
    "Claim",
    "GiveUp",
    "HeadDecision",
    "KeepInflight",
    "Loss",
    "Note",
    "Pause",
    "Requeue",
    "RetryPolicy",
    "Row",
    "Send",
    "SessionFacts",
    "Settle",
    "Transition",
    "Wait",
    "ambiguous",
    "application_ack_bytes",
    "build_transmit",
    "decide_head",
    "on_loss",
    "on_response",
    "on_unsendable",
    "too_big_victim",
]

#: A head that waits (a backoff, a paused channel) is looked at again at
#: least this often: an operator's resume or re-drive in another process
#: sends no wake-up.
RECHECK_SECONDS = 1.0
#: The application ACK owed for a row given up on: what a 5xx would have earned.
GIVE_UP_STATUS = 500

# -- what the core reads -----------------------------------------------------------


class Row(Protocol):
    """What the policy reads of a live row (``agent.storage.rows.HeadRow`` is one)."""

    @property
    def id(self) -> str: ...
    @property
    def channel(self) -> str: ...
    @property
    def seq(self) -> int: ...
    @property
    def state(self) -> State: ...
    @property
    def attempts(self) -> int: ...
    @property
    def next_attempt_at(self) -> float: ...
    @property
    def remote(self) -> str: ...
    @property
    def control_id(self) -> str: ...
    @property
    def message_type(self) -> str: ...
    @property
    def encoding(self) -> str: ...
    @property
    def body(self) -> bytes: ...
    @property
    def received_at(self) -> float: ...
    @property
    def ack_mode(self) -> str: ...
    @property
    def redrive_base(self) -> int: ...
    @property
    def partition_key(self) -> str | None: ...


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Backoff for transient answers (docs/queue.md#retry-and-backoff)."""

    initial: float = 1.0
    cap: float = 60.0
    jitter: float = 0.2


@dataclass(frozen=True, slots=True)
class ChannelPolicy:
    """A channel's dispatch settings, plus its durable pause flag as last read."""

    name: str
    max_attempts: int = 0  # 0: retry forever
    on_reject: Literal["continue", "pause"] = "continue"
    guaranteed_delivery: bool = False
    assign_sequence_numbers: bool = False
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    #: Rows of this channel in flight at once (partitioned channels raise it).
    max_in_flight: int = 1
    paused: bool = False
    #: Order per partition key (docs/queue.md#partitioned-channels): transmits name
    #: the key, and ``on_reject = "pause"`` pauses the row's key, not the channel.
    partitioned: bool = False


@dataclass(frozen=True, slots=True)
class SessionFacts:
    """What the policy needs to know of the upstream session: is one up, does it replay."""

    up: bool
    replay: bool = False


@dataclass(frozen=True, slots=True)
class Note:
    """A log line to write (never a message body): ``level`` is a structlog method name."""

    level: Literal["debug", "info", "warning", "error"]
    event: str
    fields: tuple[tuple[str, object], ...] = ()

    @classmethod
    def of(cls, level: Literal["debug", "info", "warning", "error"], event: str, **fields: object) -> Note:
        return cls(level, event, tuple(fields.items()))

    def write(self, logger: Any) -> None:  # noqa: ANN401 - a structlog bound logger
        """Log it with ``logger``'s bound fields (``logger.info(event, **fields)`` …)."""
        getattr(logger, self.level)(self.event, **dict(self.fields))


# -- actions --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to do before ``until`` (a time.time() instant); None: until new rows arrive."""

    until: float | None = None


@dataclass(frozen=True, slots=True)
class AwaitSession:
    """Nothing is claimed or sent without a session: during an outage the head stays ``queued``."""


@dataclass(frozen=True, slots=True)
class Claim:
    """Event.CLAIM: the due, queued head becomes ``claimed`` (provably not sent)."""

    id: str


@dataclass(frozen=True, slots=True)
class Send:
    """Event.SEND / RESEND: commit ``inflight`` (attempt + 1), then write ``transmit``."""

    id: str
    from_state: State
    attempts: int  # the attempt count the row has now; the store's guard checks it
    transmit: Transmit  # attempt = attempts + 1


@dataclass(frozen=True, slots=True)
class Pause:
    """Set the channel's durable pause flag in the same commit (``on_reject = "pause"``).

    ``partition``: on a partitioned channel, the key to pause instead (the channel goes on).
    """

    channel: str
    reason: str
    partition: str | None = None


@dataclass(frozen=True, slots=True)
class Settle:
    """Event.SETTLE: the server answered this attempt (processed or rejected)."""

    id: str
    attempt: int
    state: State
    response: TransmitResponse
    app_ack: bytes | None = None
    error_code: str | None = None
    error_text: str | None = None
    server_reason: str | None = None  # the server's own words (acks.server_reason), for operators
    pause: Pause | None = None
    note: Note | None = None  # logged when the row moved
    stale: Note | None = None  # logged when it did not (another attempt settled it)
    notes: tuple[Note, ...] = ()  # logged before the store call


@dataclass(frozen=True, slots=True)
class Requeue:
    """Event.RETRY: back to ``queued``, due at ``next_attempt_at``; the row stays the head."""

    id: str
    attempt: int
    next_attempt_at: float
    error_code: str
    error_text: str
    server_status: int | None = None
    server_reason: str | None = None
    note: Note | None = None
    stale: Note | None = None
    notes: tuple[Note, ...] = ()


@dataclass(frozen=True, slots=True)
class GiveUp:
    """Event.GIVE_UP: a live row straight to ``failed`` or ``rejected`` (docs/queue.md#giving-up)."""

    id: str
    attempt: int
    state: State
    error_code: str
    error_text: str
    app_ack: bytes | None = None
    pause: Pause | None = None
    note: Note | None = None
    stale: Note | None = None
    notes: tuple[Note, ...] = ()
    server_reason: str | None = None  # set when a server answer ended it (the last one)


@dataclass(frozen=True, slots=True)
class KeepInflight:
    """No store call: the row stays ``inflight`` and is resent with the same id as its head."""


#: A store transition the loop applies with one call.
Transition: TypeAlias = Claim | Send | Settle | Requeue | GiveUp
HeadDecision: TypeAlias = Wait | AwaitSession | Claim | Send | Requeue | GiveUp
Action: TypeAlias = HeadDecision | Settle | KeepInflight


class Loss(StrEnum):
    """Why no answer will come for an attempt; the value is how the reason reads."""

    RESPONSE_TIMEOUT = "response timeout"
    CONNECTION_LOST = "connection lost"
    #: The session closed after ``inflight`` was committed, before the write.
    NOT_WRITTEN = "session closed before the frame was written"
    #: The write guard refused: the lease was not proven valid (agent.core.lease).
    LEASE_UNPROVEN = "lease not proven valid before the write"


# -- building what is sent ------------------------------------------------------------


def build_transmit(row: Row, policy: ChannelPolicy, attempt: int) -> Transmit:
    """The transmit for ``attempt``: the stored bytes decoded once (docs/protocol.md#transmit).

    Raises HL7Error, ValueError or LookupError when the stored bytes no
    longer decode as the row's encoding (decide_head turns that into a GiveUp).
    """
    text = envelope.decode_message(row.body, row.encoding)
    if policy.assign_sequence_numbers:
        # MSH-13 of the forwarded text is seq; the stored bytes stay as received
        # (docs/protocol.md#sequence-numbers-and-msh-13).
        text = envelope.set_msh_field(text, 13, str(row.seq))
    return Transmit(
        id=row.id,
        channel=row.channel,
        control_id=row.control_id,
        message_type=row.message_type,
        seq=row.seq,
        attempt=attempt,
        received_at=rfc3339_utc(datetime.fromtimestamp(row.received_at, UTC)),
        remote=row.remote,
        body=text,
        encoding=row.encoding,
        partition=shown_key(row.partition_key or "") if policy.partitioned else None,
    )


def application_ack_bytes(
    row: Row, status: int, ack_text: str | None, *, now: datetime | None = None
) -> bytes | None:
    """The application ACK the source is owed, in its own character set; never raises.

    The server's ``ack`` text when it sent one, else one built from the row's
    MSH for ``status`` (docs/acks.md#relayed-application-acks). None when no
    ACK can be built: the row still settles.
    """
    return _application_ack(row, status, ack_text, now)[0]


def _application_ack(
    row: Row, status: int, ack_text: str | None, now: datetime | None = None
) -> tuple[bytes | None, tuple[Note, ...]]:
    """The ACK (None for commit-mode rows) and, when it could not be built, a note saying so.

    Whatever a stored row holds (an older version stored any codec Python
    knows, ``idna`` included), the row must still settle: an exception here
    would end the dispatcher and leave the row inflight, resent and failing
    at every restart. A row whose ACK cannot be built settles without one.
    """
    if row.ack_mode == "commit":
        return None, ()
    try:
        if ack_text and acks.usable_server_ack(ack_text):
            return acks.relayed_ack(ack_text, row.encoding), ()
        notes: tuple[Note, ...] = ()
        if ack_text:
            notes = (Note.of("warning", "server_ack_unusable", id=row.id, channel=row.channel, status=status),)
        try:
            inbound = envelope.read_msh(row.body)
        except HL7Error:
            return None, notes
        return acks.app_ack_from_status(inbound, status, row.encoding, now=now), notes
    except Exception as exc:  # noqa: BLE001 - one row's ACK must never stop dispatch
        note = Note.of("error", "application_ack_unbuildable", id=row.id, channel=row.channel,
                       error_type=type(exc).__name__)
        return None, (note,)


# -- the head ---------------------------------------------------------------------------


def decide_head(
    head: Row | None,
    policy: ChannelPolicy,
    session: SessionFacts,
    now: float,
    *,
    in_flight: int = 0,
) -> HeadDecision:
    """What to do next with a channel's head (its lowest-seq live row), as of ``now``.

    ``in_flight``: the channel's other rows in flight; a new head waits while
    they fill ``max_in_flight``. Docs: docs/queue.md#claim-and-send.
    """
    if head is None:
        return Wait()
    if head.state == State.QUEUED:
        if policy.paused:
            return Wait(now + RECHECK_SECONDS)
        if head.next_attempt_at > now:
            return Wait(min(head.next_attempt_at, now + RECHECK_SECONDS))
    if in_flight >= policy.max_in_flight:
        return Wait()
    if not session.up:
        return AwaitSession()
    if head.state == State.QUEUED:
        return Claim(head.id)
    if head.state == State.INFLIGHT and not session.replay:
        # An inflight row we cannot prove unsent and the server cannot dedupe.
        return ambiguous(head, head.attempts, "server does not replay", policy)
    if head.state == State.INFLIGHT and attempts_exhausted(head.attempts - head.redrive_base, policy.max_attempts):
        # Its max_attempts-th send was left unanswered by a restart or a
        # takeover: what on_loss decides for one left unanswered in service.
        return _unanswered(head, head.attempts, "no answer before a restart", policy)
    if policy.paused:
        # Dispatch holds: no new attempt of a head already claimed or in flight
        # (one whose answer timed out or whose connection was lost) until resumed.
        return Wait(now + RECHECK_SECONDS)
    try:
        transmit = build_transmit(head, policy, head.attempts + 1)
    except (HL7Error, ValueError, LookupError) as exc:
        return _give_up(head, head.attempts, State.REJECTED, "102",
                        f"stored message cannot be decoded as {head.encoding}: {exc}", policy)
    return Send(head.id, head.state, head.attempts, transmit)


# -- the answer -----------------------------------------------------------------------


def on_response(
    row: Row,
    attempt: int,
    response: TransmitResponse,
    policy: ChannelPolicy,
    now: float,
    *,
    rng: random.Random | None = None,
) -> Settle | Requeue | GiveUp:
    """The server answered ``attempt`` (docs/protocol.md#status-classes, docs/queue.md#settle)."""
    status = response.status
    kind = classify_status(status)
    # The server's own words (MSA-3, ERR texts of its ACK), kept with the row for operators.
    reason = acks.server_reason(response.ack) if kind is not StatusClass.PROCESSED else None
    if kind is StatusClass.TRANSIENT:
        used = attempt - row.redrive_base
        if attempts_exhausted(used, policy.max_attempts):
            return _give_up(row, attempt, State.FAILED, str(status),
                            f"max_attempts {policy.max_attempts} reached; last status {status}", policy,
                            server_reason=reason)
        r = policy.retry
        delay = retry_delay(used, initial=r.initial, cap=r.cap, jitter=r.jitter, rng=rng)
        scheduled = Note.of("info", "transmit_retry_scheduled", status=status, attempt=attempt,
                            delay_s=round(delay, 2))
        return Requeue(row.id, attempt, now + delay, error_code=str(status),
                       error_text=f"transient status {status}; retry in {delay:.1f}s",
                       server_status=status, server_reason=reason, note=scheduled, stale=scheduled)
    app_ack, notes = _application_ack(row, status, response.ack)
    if kind is StatusClass.PROCESSED:
        return Settle(row.id, attempt, State.PROCESSED, response, app_ack,
                      # Debug: a line per delivered message costs what intake's did (bench/README.md).
                      note=Note.of("debug", "message_processed", status=status, attempt=attempt),
                      stale=_stale(attempt), notes=notes)
    pause = (_pause(row, policy, f"rejected row {row.id} (status {status})")
             if policy.on_reject == "pause" else None)
    return Settle(row.id, attempt, State.REJECTED, response, app_ack, error_code=str(status),
                  error_text=f"rejected by server (status {status})", server_reason=reason, pause=pause,
                  # Not message_rejected: that names intake's rejects (docs/operations.md#log-events).
                  note=Note.of("warning", "message_rejected_by_server", status=status, attempt=attempt),
                  stale=_stale(attempt), notes=notes)


def _stale(attempt: int) -> Note:
    return Note.of("info", "stale_settle_ignored", attempt=attempt)


# -- no answer ------------------------------------------------------------------------


def on_loss(
    row: Row, attempt: int, loss: Loss, policy: ChannelPolicy, *, replay: bool
) -> KeepInflight | Requeue | GiveUp:
    """No answer will come for ``attempt`` (docs/queue.md#recovery).

    A frame provably never written goes back to the head at once. Otherwise
    a replaying server gets the same id again: the row stays ``inflight``
    and is resent when the worker finds it at the head (on this session
    after a timeout, on the next one after a lost connection), unless that
    was its ``max_attempts``-th send: then it is ``failed``. Without replay
    the row is ambiguous.
    """
    if loss is Loss.NOT_WRITTEN:
        return Requeue(row.id, attempt, 0.0, error_code="not_sent", error_text=loss.value,
                       note=Note.of("info", "transmit_not_sent_session_closed", attempt=attempt))
    if loss is Loss.LEASE_UNPROVEN:
        return Requeue(row.id, attempt, 0.0, error_code="not_sent", error_text=loss.value,
                       note=Note.of("info", "transmit_not_sent_lease_unproven", attempt=attempt))
    if replay:
        if attempts_exhausted(attempt - row.redrive_base, policy.max_attempts):
            # Unanswered as often as max_attempts allows (a message the server
            # never answers, or drops its connection on): set aside, not resent
            # for ever. The server may have it; a re-drive sends the same id.
            return _unanswered(row, attempt, loss.value, policy)
        return KeepInflight()
    return ambiguous(row, attempt, f"{loss.value}; server does not replay", policy)


def ambiguous(row: Row, attempt: int, why: str, policy: ChannelPolicy) -> Requeue | GiveUp:
    """An inflight row whose delivery is unknown (docs/queue.md#ambiguous-rows).

    ``failed`` for an operator to review, or back to ``queued`` on a
    ``guaranteed_delivery`` channel (delivered at least once, maybe twice).
    """
    if policy.guaranteed_delivery:
        return Requeue(row.id, attempt, 0.0, error_code="ambiguous",
                       error_text=f"requeued (guaranteed delivery): {why}",
                       note=Note.of("warning", "inflight_requeued_guaranteed", reason=why))
    return _give_up(row, attempt, State.FAILED, "ambiguous", f"delivery unknown: {why}", policy)


def on_unsendable(row: Row, attempt: int, why: str, policy: ChannelPolicy) -> GiveUp:
    """A frame over the size limit, ours or the server's: ``rejected`` with 207, never resent.

    HL7 table 0357: 207 is "application internal error"; no row is retried
    forever for its size (docs/protocol.md#size-limits).
    """
    return _give_up(row, attempt, State.REJECTED, "207", why, policy)


def too_big_victim(in_flight: Iterable[tuple[str, int]]) -> str | None:
    """The id a server's close with 1009 blames: the largest transmit in flight on that session.

    ``in_flight``: (id, frame size in bytes) in the order they were sent; on a
    tie the first sent is the one. None when nothing was in flight.
    """
    victim: str | None = None
    largest = -1
    for message_id, size in in_flight:
        if size > largest:
            victim, largest = message_id, size
    return victim


def _give_up(row: Row, attempt: int, state: State, code: str, text: str, policy: ChannelPolicy,
             *, server_reason: str | None = None) -> GiveUp:
    app_ack, notes = _application_ack(row, GIVE_UP_STATUS, None)
    pause = _pause(row, policy, f"{state} row {row.id}: {text}") if policy.on_reject == "pause" else None
    # message_failed; a row the agent cannot send (too big, undecodable) is
    # message_unsendable, not message_rejected: that names intake's rejects.
    event = "message_failed" if state is State.FAILED else "message_unsendable"
    return GiveUp(row.id, attempt, state, code, text, app_ack, pause,
                  note=Note.of("warning", event, error_code=code, reason=text), notes=notes,
                  server_reason=server_reason)


def _unanswered(row: Row, attempt: int, last: str, policy: ChannelPolicy) -> GiveUp:
    """``failed`` (no_answer): its max_attempts-th send got no answer; ``last`` says how it went."""
    return _give_up(row, attempt, State.FAILED, "no_answer",
                    f"max_attempts {policy.max_attempts} reached; last attempt: {last}", policy)


def _pause(row: Row, policy: ChannelPolicy, reason: str) -> Pause:
    """The channel's pause; on a partitioned channel the row's key only (a NULL key: the channel)."""
    key = row.partition_key if policy.partitioned else None
    return Pause(policy.name, reason, partition=key)


def with_attempt(send: Send, attempt: int) -> Transmit:
    """The transmit of ``send`` as the attempt the store committed (the same, unless a bug)."""
    t = send.transmit
    return t if t.attempt == attempt else replace(t, attempt=attempt)

"""One sender's connection as a sans-I/O object: bytes and results in, actions out.

Like websockets' protocol objects, :class:`IntakeConnection` never touches a
socket, a thread or the database. The shell (agent.runtime.mllp_server)
feeds it what the sender sent, what the writer and the relay answered and
the clock's ticks, and applies the :data:`Action` values it hands back with
``next_actions()``. Like h11, everything that shapes the connection's life
is here, in one table (``PHASES``). What it keeps:

- ACKs in arrival order, each frame's answer in its own slot, at most
  ``MAX_PIPELINED_FRAMES`` frames handled ahead of their ACK writes (so
  pipelined frames share group commits), each ACK in its own write;
- the audit bound: 100 rows per connection per minute, then only counted,
  and at most ``MAX_PENDING_AUDITS`` rows waiting for the writer;
- the application ACKs it waits for: held (original mode) or relayed
  (enhanced mode, at most ``MAX_PENDING_RELAYS``), and what is owed to a
  successor at an upgrade, with the bytes received but not handled;
- ``frame_timeout`` (the clock runs while the sender's bytes are read or
  wait to be framed, not while its frames wait for us) and ``idle_timeout``.

Which ACK a frame earns is agent.core.intake_policy's: pure functions this
object calls. An accept ACK is only ever sent from a commit result, so it
can never precede its row's COMMIT.

Over 400 lines: the state table, the ordering and the bounds are one
mechanism that reads best whole (h11 keeps its state machine in one file).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import count

from agent.core import batch as batch_
from agent.core import intake_batch, mllp
from agent.core import intake_policy as policy_
from agent.core.intake_actions import (
    DONE,
    READING,
    WRITING,
    Abort,
    Action,
    AwaitApplicationAck,
    Clock,
    Close,
    Commit,
    HalfClose,
    HandOver,
    Phase,
    Send,
    StopWaiting,
    check_move,
)
from agent.core.intake_types import (
    NO_REPLY,
    Audit,
    BatchPlan,
    ChannelPolicy,
    CommitResult,
    Count,
    Counter,
    Decision,
    Log,
    NewMessage,
    Owed,
    OwedRelay,
    OwedReply,
    RecordOutcome,
)
from agent.core.states import AckOutcome
from agent.errors import StorageError

__all__ = [
    "AUDIT_ROWS_PER_WINDOW",
    "AUDIT_WINDOW",
    "MAX_PENDING_AUDITS",
    "MAX_PENDING_RELAYS",
    "MAX_PIPELINED_FRAMES",
    "IntakeConnection",
]

#: Frames of one connection handled ahead of their ACK write (pipelining bound).
MAX_PIPELINED_FRAMES = 32
#: Bytes framed per step: one decoder pass stays short (tiny frames are many
#: events), so one connection's flood cannot hold the event loop for long.
FEED_CHUNK = 16 * 1024
#: Frames handled per step at most (16 KiB holds 5,000 empty ones): a flood
#: of tiny frames yields the event loop to the other senders between steps.
STEP_EVENTS = 256
#: After a step whose frames were only counted (over the audit bound), the
#: next waits this long: handling a junk flood flat out would keep the event
#: loop, and the GIL, from every other channel and the writer.
JUNK_READ_PAUSE = 0.01
#: Rejected or unparseable frames kept as audit rows, per connection per window;
#: beyond it they are counted (a metric, one log line per window), not stored,
#: so a flood of junk can neither fill the disk nor queue up on the writer.
AUDIT_ROWS_PER_WINDOW = 100
AUDIT_WINDOW = 60.0
#: Retransmits answered from dedupe logged per connection per window (info);
#: beyond it they are counted in one line per window: a sender stuck in a
#: resend loop must not fill the log's disk (one line each wrote 52 MB in 30 s).
REPLAY_LOGS_PER_WINDOW = 20
REPLAY_EVENT = "retransmit_answered_from_dedupe"
#: Audit rows of one connection waiting for the writer; at the bound reading pauses.
MAX_PENDING_AUDITS = 32
#: Application ACKs one connection waits for at once (enhanced mode). Beyond it
#: the ACK is recorded undelivered and replayed on retransmit: memory per
#: connection stays bounded while the server does not answer.
MAX_PENDING_RELAYS = 256
#: After the last ACK of a graceful close: how long the sender's late bytes are read and discarded.
LINGER = 2.0
#: How long a hand-over may wait for our last ACKs to leave the socket buffer.
QUIET_WAIT = 2.0
#: A held-ACK hand-over that found ACKs still in the socket buffer is tried again after this.
HANDOVER_RETRY = 0.05


@dataclass(eq=False, slots=True)
class _Slot:
    """One handled frame's place in the ACK order."""

    reply: OwedReply | None = None  # None while its commit runs
    message: NewMessage | None = None  # being committed
    batch: BatchPlan | None = None  # an HL7 batch being committed
    wait_token: int | None = None  # a held application ACK is awaited under this token
    deadline: float = 0.0  # until when (monotonic)


class IntakeConnection:
    """One sender's connection: frames in, ACKs out in arrival order (see the module docstring)."""

    def __init__(self, policy: ChannelPolicy, clock: Clock) -> None:
        self.policy = policy
        self.clock = clock
        self.phase = Phase.OPEN
        self._actions: list[Action] = []
        self._decoder = mllp.MllpDecoder(policy.max_message_bytes)
        self._unread = bytearray()  # received, not framed yet
        self._events: deque[mllp.Event] = deque()  # framed, not handled yet
        self._eof = False  # the sender closed its side (after ``_unread``)
        self._peer_gone = False  # ACKs written from now on cannot be known to be read
        self._slots: deque[_Slot] = deque()
        self._tickets = count(1)
        self._commits: dict[int, _Slot] = {}
        self._held: dict[int, _Slot] = {}
        self._relays: dict[int, OwedRelay] = {}
        self._writes_paused = False
        self._frames_handled = 0
        self._finish_upto = 0
        self._shutdown = False  # asked to close by the service: hand over, or close gracefully
        self._can_hand_over = False
        self._released = False  # held ACKs are answered AR at once (a stop without successor)
        self._early_handover_at: float | None = None  # may try to move held ACKs from then on
        self._handover: HandOver | None = None
        self._deferred: list[tuple[int, bytes | None]] = []  # ACKs that came during a hand-over
        self._lost = False
        now = clock.monotonic()
        self._last_activity = now
        self._frame_left: float | None = None  # frame_timeout left to the frame in progress
        self._frame_since: float | None = None  # since when it runs (None: stopped)
        self._resume_at: float | None = None  # junk pause
        self._linger_until = 0.0
        self._discarded = 0
        self._junk_logged = False
        self._junk_counted = False
        self._relay_overflow_logged = False
        self._audits_pending = 0
        self._audit_logs: deque[tuple[Log, ...]] = deque()  # each pending audit row's lines, written with its id
        self._window_start = -AUDIT_WINDOW
        self._rows_in_window = 0
        self._unstored = 0
        self._replays_in_window = 0
        self._replays_unlogged = 0
        self._writes_paused_since: float | None = None

    # -- queries -------------------------------------------------------------------

    def next_actions(self) -> list[Action]:
        """The actions due so far, in order (each returned once)."""
        actions, self._actions = self._actions, []
        return actions

    @property
    def reading(self) -> bool:
        """Whether the shell should read from the socket now."""
        if self.phase is Phase.LINGERING:
            return True
        return (self.phase in READING and not self._unread and not self._events and not self._eof
                and self._resume_at is None)

    @property
    def _frame_clock_runs(self) -> bool:
        """Whether frame_timeout's clock runs: while the connection reads, or holds bytes it will frame next.

        Those bytes are the sender's: one that sends faster than we frame
        (a flood) must not stop the clock. Frames waiting for a free slot or
        the writer do stop it; that wait is ours, not the sender's.
        """
        return self.phase in READING and not self._events and not self._eof

    @property
    def more_to_do(self) -> bool:
        """Received bytes, or frames beyond a step's STEP_EVENTS, wait for another step (``step()`` on the next loop turn)."""
        if self.phase not in READING or self._resume_at is not None:
            return False
        if self._events:  # handled up to STEP_EVENTS, room for more
            return len(self._slots) < MAX_PIPELINED_FRAMES and self._audits_pending < MAX_PENDING_AUDITS
        return bool(self._unread)

    @property
    def mid_frame(self) -> bool:
        return self._decoder.mid_frame

    @property
    def relays_awaited(self) -> int:
        return len(self._relays)

    @property
    def finished(self) -> bool:
        """Nothing more happens here: the phase is final and no commit is outstanding."""
        return self.phase in DONE and not self._commits

    def next_deadline(self) -> float | None:
        """When ``tick()`` is next due (monotonic), if ever."""
        if (self.phase is Phase.OPEN and self._resume_at is None and self._frame_left is None
                and not self.policy.idle_timeout and not self._unstored and self._writes_paused_since is None):
            return None  # between frames, no idle_timeout: what the shell asks twice per message
        due: list[float] = []
        if self._writes_paused_since is not None and self.phase not in DONE:
            due.append(self._writes_paused_since + self.policy.frame_timeout)
        if self._resume_at is not None:
            due.append(self._resume_at)
        if self.phase in READING:
            if self._frame_left is not None:
                if self._frame_since is not None:  # stopped while we do not read
                    due.append(self._frame_since + self._frame_left)
            else:
                idle_at = self._idle_deadline()
                if idle_at is not None:
                    due.append(idle_at)
        if self.phase is Phase.LINGERING:
            due.append(self._linger_until)
        if (self.phase is Phase.DRAINING and self._early_handover_at is not None
                and self._early_handover_at > self.clock.monotonic()):
            due.append(self._early_handover_at)  # a retry; a due one waits for the next answer
        if self._unstored:
            due.append(self._window_start + AUDIT_WINDOW)
        return min(due) if due else None

    def idle_since(self) -> float | None:
        """When this connection last did something, if it is idle now (no partial frame, nothing owed)."""
        if (self.phase is not Phase.OPEN or self._unread or self._events or self._decoder.mid_frame
                or self._slots or self._relays or self._audits_pending):
            return None
        return self._last_activity

    def audit_quota_left(self) -> bool:
        """Whether the next refused frame would still be kept as an audit row in this window."""
        return (self.clock.monotonic() - self._window_start >= AUDIT_WINDOW
                or self._rows_in_window < AUDIT_ROWS_PER_WINDOW)

    # -- inputs ----------------------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        if self.phase is Phase.LINGERING:
            self._discarded += len(data)
        elif self.phase not in DONE:
            self._unread += data  # outside OPEN/FINISHING: kept for a successor, not handled
            self._process(feed=True)
        self._sync()

    def receive_eof(self) -> None:
        self._peer_gone = True
        if self.phase is Phase.LINGERING:
            self._end_linger()
        elif self.phase in READING:
            self._eof = True
            self._process(feed=False)
        self._sync()

    def step(self) -> None:
        """Frame and handle the next part of what was received (see ``more_to_do``)."""
        self._process(feed=True)
        self._sync()

    def tick(self) -> None:
        """Time passed: timeouts, the end of the junk pause, the audit window's summary."""
        now = self.clock.monotonic()
        if self._resume_at is not None and now >= self._resume_at:
            self._resume_at = None
            self._process(feed=True)
        if self.phase in READING:
            if self._frame_left is not None:
                if self._frame_since is not None and now >= self._frame_since + self._frame_left:
                    self._timed_out("frame")
            else:
                idle_at = self._idle_deadline()
                if idle_at is not None and now >= idle_at:
                    self._timed_out("idle")
        if (self._writes_paused_since is not None and self.phase not in DONE
                and now >= self._writes_paused_since + self.policy.frame_timeout):
            self._write_stalled()
        if self.phase is Phase.LINGERING and now >= self._linger_until:
            self._end_linger()
        if (self._unstored or self._replays_unlogged) and now >= self._window_start + AUDIT_WINDOW:
            self._log_unstored()
        self._sync()

    def commit_done(self, ticket: int, results: Sequence[CommitResult]) -> None:
        slot = self._commits.pop(ticket)
        plan, message = slot.batch, slot.message
        slot.batch = None
        try:
            if plan is not None:
                decision = intake_batch.batch_replies(plan, list(results), self.policy)
            else:
                assert message is not None
                decision = policy_.replies_for(message, results[0], self.policy)
        except Exception as exc:  # noqa: BLE001 - answered: no frame ends in silence
            decision = self._last_resort(exc, slot, plan)
        self._apply(decision, slot)
        self._sync()

    def commit_failed(self, ticket: int, error: BaseException) -> None:
        slot = self._commits.pop(ticket)
        plan, message = slot.batch, slot.message
        slot.batch = None
        if not isinstance(error, StorageError):  # a bug, not the disk: the last resort's answer
            decision = self._last_resort(error, slot, plan)
        elif plan is not None:
            decision = intake_batch.batch_storage_failed(plan, str(error))
        else:
            assert message is not None
            decision = policy_.storage_failed(message, str(error))
        self._apply(decision, slot)
        self._sync()

    @staticmethod
    def _last_resort(exc: BaseException, slot: _Slot, plan: BatchPlan | None) -> Decision:
        if plan is not None:
            return policy_.handling_failed(exc, plan.body, plan.received_at)
        assert slot.message is not None
        return policy_.handling_failed(exc, slot.message.body, slot.message.received_at)

    def audit_done(self, error: str | None = None, message_id: str | None = None) -> None:
        """The writer stored the oldest pending audit row (as ``message_id``), or failed to.

        Its lines are written now, with the row's id for an operator to look
        it up; the writer answers one connection's audit rows in order.
        """
        self._audits_pending -= 1
        for line in self._audit_logs.popleft() if self._audit_logs else ():
            self._emit(line if message_id is None else replace(line, fields={**line.fields, "id": message_id}))
        if error is not None:
            self._emit(Log("warning", "audit_row_failed", {"error": error}))
        self._process(feed=False)
        self._sync()

    def written(self, send: Send, ok: bool) -> None:
        """The shell wrote (or failed to write) ``send``."""
        if ok:
            self._last_activity = self.clock.monotonic()
        self._record_write(send.message_id, send.relayed, delivered=ok and not self._peer_gone, also=send.also)
        self._sync()

    def writing_paused(self, paused: bool) -> None:
        """The socket buffer is full (the sender does not read): stop writing until it drains.

        Reading stops meanwhile too, so frame_timeout cannot fire: a sender
        that never reads its ACKs would hold its connection (and a slot of
        max_connections) for good. It gets frame_timeout to read again.
        """
        self._writes_paused = paused
        if not paused:
            self._writes_paused_since = None
        elif self._writes_paused_since is None:
            self._writes_paused_since = self.clock.monotonic()
        self._pump()
        self._sync()

    def application_ack(self, token: int, ack: bytes | None) -> None:
        """The relay's answer for ``token``: the row's application ACK, or None (timed out)."""
        self._application_ack(token, ack)
        self._sync()

    def adopt(self, owed: Owed) -> None:
        """Taken from a predecessor with ``owed``: answered first, in order, before any new frame."""
        for reply in owed.replies:
            slot = _Slot()
            self._slots.append(slot)
            self._settle(slot, reply)
        for relay in owed.relays:
            self._start_relay(relay, bounded=False)
        self._sync()

    def request_close(self, *, can_hand_over: bool) -> None:
        """Finish the frame being received, answer what is owed, then hand over or close gracefully.

        A frame the sender is in the middle of sending is finished and
        answered; frames received but not handled yet are left for a
        successor (``HandOver``) or, without one, not answered at all —
        nothing of them was committed, so the sender's resend is safe
        (docs/acks.md#how-acks-are-written).
        """
        self._shutdown = True
        self._can_hand_over = can_hand_over
        if can_hand_over:
            self._early_handover_at = self.clock.monotonic()
        if self.phase is Phase.OPEN:
            if not self._events and self._decoder.mid_frame:
                self._move(Phase.FINISHING)
                self._finish_upto = self._frames_handled + 1
            else:
                self._stop_reading()
        self._sync()

    def release_held(self) -> None:
        """Stop waiting for the server: each held application ACK is answered AR "resend later" now."""
        self._released = True
        for token in list(self._held):
            self._emit(StopWaiting(token))
            self._application_ack(token, None)
        self._sync()

    def evict(self) -> None:
        """Close this idle connection to admit a newcomer: nothing is owed, nothing to hand over."""
        self._close()
        self._sync()

    def abort(self) -> None:
        if self.phase not in DONE:
            self._move(Phase.CLOSED)
            self._emit(Abort())
            self._cleanup()
        self._sync()

    def connection_lost(self, error: str | None) -> None:
        """The transport is gone (reset, or closed by us)."""
        self._lost = True
        if self.phase in DONE or self.phase is Phase.HANDING_OVER:
            return
        if error is not None:
            self._emit(Log("info", "connection_lost", {"error": error}))
        if self.phase is Phase.LINGERING:
            self._log_discarded()
        self._move(Phase.CLOSED)
        self._cleanup()
        self._sync()

    def handover_done(self, *, taken: bool, moved: bool, quiet: bool = True) -> None:
        """The successor took the connection (``moved``: with what it owes), or did not."""
        offer, self._handover = self._handover, None
        if offer is None:
            return  # aborted meanwhile
        final = offer.or_without_owed
        if self._lost:
            self._move(Phase.CLOSED)
            self._cleanup()
        elif taken:
            self._move(Phase.HANDED_OVER)
            self._deferred = []
            for token in (*self._held, *self._relays):
                self._emit(StopWaiting(token))
            if not moved:  # the connection went without its relays: replayed on retransmit
                for relay in self._relays.values():
                    self._emit(RecordOutcome(relay.message_id, AckOutcome.UNDELIVERED))
            self._held.clear()
            self._relays.clear()
            self._slots.clear()
            self._emit(Log("info", "connection_handed_over", {
                "buffered": len(offer.buffered), "replies_owed": len(offer.owed.replies) if moved else 0,
                "relays_owed": len(offer.owed.relays) if moved else 0}))
            self._emit(Abort())  # our copy of the fd goes; the successor's keeps the connection open
            self._log_unstored()
        else:
            self._move(Phase.DRAINING)
            if not final and not quiet:
                self._early_handover_at = self.clock.monotonic() + HANDOVER_RETRY
            deferred, self._deferred = self._deferred, []
            for token, ack in deferred:
                self._application_ack(token, ack)
            if final and self.phase is Phase.DRAINING:
                self._linger()
        self._sync()

    # -- reading ------------------------------------------------------------------------

    def _process(self, *, feed: bool) -> None:
        """Handle framed events while the bounds allow; with ``feed``, frame one more slice first if none wait."""
        budget = STEP_EVENTS
        while self.phase in READING and self._resume_at is None:
            if self._events:
                if len(self._slots) >= MAX_PIPELINED_FRAMES or self._audits_pending >= MAX_PENDING_AUDITS:
                    return
                if not budget:
                    self._pause_if_flooded()
                    return
                budget -= 1
                self._handle(self._events.popleft())
                continue
            if not self._unread:
                if self._eof:
                    self._end_of_input()
                return
            if not feed:
                return
            if self._pause_if_flooded():
                return
            feed = False
            if len(self._unread) <= FEED_CHUNK:  # the common case: all of it, one copy
                chunk = bytes(self._unread)
                self._unread.clear()
            else:
                chunk = bytes(self._unread[:FEED_CHUNK])
                del self._unread[:FEED_CHUNK]
            was_mid_frame = self._decoder.mid_frame
            events = self._decoder.feed(chunk)
            self._time_frame(was_mid_frame, events)
            self._events.extend(events)

    def _pause_if_flooded(self) -> bool:
        """After a step whose frames were only counted (a flood of bad frames): slow this sender down, not the others."""
        if not self._junk_counted:
            return False
        self._junk_counted = False
        self._resume_at = self.clock.monotonic() + JUNK_READ_PAUSE
        return True

    def _time_frame(self, was_mid_frame: bool, events: list[mllp.Event]) -> None:
        """Start frame_timeout's clock when a frame begins; stop it between frames.

        A frame the sender restarts (a new start block inside it) keeps the
        clock of the first: restarting must not be a way around the timeout.
        """
        if not self._decoder.mid_frame:
            self._frame_left = self._frame_since = None
        elif not was_mid_frame or self._frame_left is None or any(
            not isinstance(e, mllp.JunkSkipped) for e in events
        ):
            self._frame_left = self.policy.frame_timeout
            self._frame_since = self.clock.monotonic()

    def _handle(self, event: mllp.Event) -> None:
        if isinstance(event, mllp.JunkSkipped):
            if not self._junk_logged:
                self._junk_logged = True
                self._emit(Log("warning", "bytes_outside_frame_skipped", {"count": event.count}))
            return
        received_at = self.clock.time()
        self._last_activity = self.clock.monotonic()
        self._frames_handled += 1
        slot = _Slot()
        self._slots.append(slot)
        payload = event.payload if isinstance(event, mllp.Frame) else event.prefix
        try:
            # A frame that starts "MSH" is no batch (FHS/BHS, after blank lines or a BOM): no scan.
            batch = (batch_.split_batch(payload) if isinstance(event, mllp.Frame) and payload[:3] != b"MSH"
                     else None)
            if batch is not None:
                decision = intake_batch.decide_batch(payload, batch, self.policy, received_at)
            elif isinstance(event, mllp.Frame):
                decision = policy_.decide_frame(payload, self.policy, received_at)
            else:
                if batch_.is_batch(payload):
                    decision = intake_batch.decide_oversize_batch(payload, event.size, self.policy, received_at)
                else:
                    decision = policy_.decide_oversize(payload, event.size, self.policy, received_at)
        except Exception as exc:  # noqa: BLE001 - answered: no frame ends in silence
            decision = policy_.handling_failed(exc, payload, received_at)
        self._apply(decision, slot)
        if self.phase is Phase.FINISHING and self._frames_handled >= self._finish_upto:
            self._stop_reading()

    def _end_of_input(self) -> None:
        """EOF, or a timeout: nothing more is read; what is owed is still written."""
        if self._decoder.mid_frame:
            self._emit(Log("warning", "connection_closed_mid_frame", {"buffered": self._decoder.buffered_bytes()}))
        self._stop_reading()

    def _stop_reading(self) -> None:
        if self.phase is Phase.FINISHING and self._decoder.mid_frame and not self._events:
            self._emit(Log("info", "frame_after_close_dropped", {"buffered": self._decoder.buffered_bytes()}))
        self._move(Phase.DRAINING)
        self._frame_left = self._frame_since = None

    def _timed_out(self, kind: str) -> None:
        if kind == "frame":
            # Slowloris: a started frame that does not complete would hold the
            # connection (and its buffer) for good. Nothing of it was committed;
            # ACKs owed for earlier frames are still written before the close.
            self._emit(Log("warning", "connection_frame_timeout", {
                "frame_timeout": self.policy.frame_timeout, "buffered": self._decoder.buffered_bytes()}))
        else:
            self._emit(Log("info", "connection_idle_timeout", {"idle_timeout": self.policy.idle_timeout}))
        self._emit(Count(Counter.CONNECTION_TIMED_OUT, kind))
        self._end_of_input()

    def _write_stalled(self) -> None:
        """The sender read none of its ACKs for frame_timeout with the buffers full: cut it off.

        What it is owed and was not written is recorded undelivered: a
        retransmit gets its ACK from dedupe.
        """
        self._writes_paused_since = None
        self._emit(Log("warning", "connection_write_stalled", {"frame_timeout": self.policy.frame_timeout}))
        self._emit(Count(Counter.CONNECTION_TIMED_OUT, "write"))
        self._move(Phase.CLOSED)
        self._emit(Abort())
        self._cleanup()

    def _idle_deadline(self) -> float | None:
        """idle_timeout counts from the last frame or ACK, and only while nothing is owed."""
        if not self.policy.idle_timeout or self._slots or self._relays or self._events:
            return None
        return self._last_activity + self.policy.idle_timeout

    # -- answers, in arrival order ---------------------------------------------------

    def _apply(self, decision: Decision, slot: _Slot) -> None:
        for effect in decision.effects:
            if isinstance(effect, Audit):
                if effect.limited and not self._audit_allowed():
                    continue
                self._audits_pending += 1
                self._emit(effect)
                self._audit_logs.append(effect.then)
            elif type(effect) is Log and effect.event == REPLAY_EVENT and not self._replay_logged():
                continue
            else:
                self._actions.append(effect)  # self._emit, inlined on the per-message path
        if decision.batch is not None:
            ticket = next(self._tickets)
            slot.batch = decision.batch
            self._commits[ticket] = slot
            self._emit(Commit(ticket, decision.batch.messages))
        elif decision.commit is not None:
            ticket = next(self._tickets)
            slot.message = decision.commit
            self._commits[ticket] = slot
            self._actions.append(Commit(ticket, (decision.commit,)))
        else:
            self._settle(slot, decision.reply)

    def _settle(self, slot: _Slot, reply: OwedReply) -> None:
        """``slot`` now knows its answer: ready ACKs, or an application ACK to wait for."""
        slot.message = None
        wait = reply.wait
        if wait is not None and self.phase is Phase.CLOSED:
            self._emit(RecordOutcome(wait.message_id, AckOutcome.UNDELIVERED))
            reply = NO_REPLY
        elif wait is not None:
            token = next(self._tickets)
            slot.wait_token = token
            slot.deadline = self.clock.monotonic() + wait.timeout
            self._held[token] = slot
            slot.reply = reply
            if self._released:
                self._application_ack(token, None)
                return
            self._emit(AwaitApplicationAck(token, wait.message_id, slot.deadline))
            return
        slot.reply = reply
        self._pump()

    def _pump(self) -> None:
        """Write every answer whose turn it is; stop at one still being committed or held."""
        while self._slots:
            head = self._slots[0]
            if head.reply is None or head.wait_token is not None:
                break
            if self.phase in WRITING and self._writes_paused:
                break
            if self.phase is Phase.HANDING_OVER or self.phase is Phase.HANDED_OVER:
                break
            self._slots.popleft()
            for frame in head.reply.frames:
                self._send(frame.frame, frame.message_id, also=frame.also)
            if head.reply.relay is not None:
                self._start_relay(head.reply.relay, bounded=True)
            for relay in head.reply.relays:
                self._start_relay(relay, bounded=True)

    def _send(self, ack: bytes, message_id: str | None, *, relayed: bool = False, also: tuple[str, ...] = ()) -> None:
        if self.phase in WRITING:
            # Whatever the ACK's origin (built here, the server's text, a row
            # an older version stored): exactly one frame goes out.
            self._actions.append(Send(mllp.encode_ack_frame(ack), message_id, relayed, also))
        else:
            self._record_write(message_id, relayed, delivered=False, also=also)

    def _record_write(self, message_id: str | None, relayed: bool, *, delivered: bool,
                      also: tuple[str, ...] = ()) -> None:
        if message_id is None or self.phase is Phase.HANDED_OVER:
            return
        outcome = AckOutcome.DELIVERED if delivered else AckOutcome.UNDELIVERED
        self._actions.append(RecordOutcome(message_id, outcome))
        for each in also:
            self._actions.append(RecordOutcome(each, outcome))
        if relayed:
            self._emit(Log("info", "application_ack_relayed" if delivered else "application_ack_undelivered",
                           {"id": message_id}))

    def _start_relay(self, relay: OwedRelay, *, bounded: bool) -> None:
        """Enhanced mode: wait for the row's application ACK (no time limit), within the bound."""
        if self.phase is Phase.CLOSED:
            self._emit(RecordOutcome(relay.message_id, AckOutcome.UNDELIVERED))
            return
        if bounded and len(self._relays) >= MAX_PENDING_RELAYS:
            self._emit(RecordOutcome(relay.message_id, AckOutcome.UNDELIVERED))
            if not self._relay_overflow_logged:
                self._relay_overflow_logged = True
                self._emit(Log("warning", "application_acks_not_awaited",
                               {"limit": MAX_PENDING_RELAYS, "id": relay.message_id}))
            return
        token = next(self._tickets)
        self._relays[token] = relay
        self._emit(AwaitApplicationAck(token, relay.message_id, None))

    def _application_ack(self, token: int, ack: bytes | None) -> None:
        if self.phase is Phase.HANDING_OVER:
            self._deferred.append((token, ack))  # answered once we know whether it moved
            return
        slot = self._held.pop(token, None)  # (closing empties both tables)
        if slot is not None:
            assert slot.reply is not None
            assert slot.reply.wait is not None
            decision = policy_.held_answer(slot.reply.wait, ack, at_stop=self._released)
            slot.wait_token = None
            self._apply(decision, slot)
            return
        relay = self._relays.pop(token, None)
        if relay is not None and ack is not None:
            self._relay_arrived(relay, ack)

    def _relay_arrived(self, relay: OwedRelay, ack: bytes) -> None:
        """Relay the server's ACK if MSH-16 wants it and no message here awaits its own ACK.

        Senders match ACKs by order as often as by MSA-2: an application ACK
        slipped between a message and its commit ACK would be taken for the
        wrong answer, so a busy connection gets none (replayed on retransmit).
        """
        if not policy_.relay_wanted(relay.inbound, ack):
            self._emit(RecordOutcome(relay.message_id, AckOutcome.NOT_OWED))
        elif (self.phase in WRITING and not self._slots and not self._events
              and not self._decoder.mid_frame):
            self._send(ack, relay.message_id, relayed=True)
        else:
            self._record_write(relay.message_id, True, delivered=False)

    # -- audit rows ---------------------------------------------------------------------

    def _audit_allowed(self) -> bool:
        """Take one audit row of this window's quota; else count the frame (metric, summary line)."""
        self._roll_window()
        if self._rows_in_window < AUDIT_ROWS_PER_WINDOW:
            self._rows_in_window += 1
            return True
        self._unstored += 1
        self._junk_counted = True
        self._emit(Count(Counter.AUDIT_ROW_NOT_STORED))
        return False

    def _roll_window(self) -> None:
        """A new window of the audit-row and replay-log quotas once the last one is over."""
        now = self.clock.monotonic()
        if now - self._window_start >= AUDIT_WINDOW:
            self._log_unstored()
            self._window_start = now
            self._rows_in_window = 0
            self._replays_in_window = 0

    def _replay_logged(self) -> bool:
        """Take one replay log line of this window's quota; else count it for the summary line."""
        self._roll_window()
        if self._replays_in_window < REPLAY_LOGS_PER_WINDOW:
            self._replays_in_window += 1
            return True
        self._replays_unlogged += 1
        return False

    def _log_unstored(self) -> None:
        if self._unstored:
            self._emit(Log("warning", "audit_rows_not_stored", {
                "count": self._unstored, "limit": AUDIT_ROWS_PER_WINDOW, "window_s": AUDIT_WINDOW}))
            self._unstored = 0
        if self._replays_unlogged:
            self._emit(Log("info", "retransmits_answered_not_logged", {
                "count": self._replays_unlogged, "limit": REPLAY_LOGS_PER_WINDOW, "window_s": AUDIT_WINDOW}))
            self._replays_unlogged = 0

    # -- the end ------------------------------------------------------------------------

    def _drain(self) -> None:
        """Draining: once every answer is written, hand over or close; held ACKs may move earlier."""
        if self._slots:
            now = self.clock.monotonic()
            if (self._shutdown and self._held and self._early_handover_at is not None
                    and now >= self._early_handover_at and not self._peer_gone and self._settled()):
                self._early_handover_at = None  # one try, unless ACKs were still on their way out
                self._offer(or_without_owed=False, quiet_within=0.0)
            return
        if not self._shutdown:
            self._close()
        elif self._can_hand_over and not self._peer_gone and self._decoder.unconsumed() is not None:
            self._offer(or_without_owed=True, quiet_within=QUIET_WAIT)
        else:
            self._linger()

    def _settled(self) -> bool:
        """What is owed is known: no answer is being committed, and the first one is held."""
        head = self._slots[0]
        return not self._commits and head.wait_token is not None

    def _offer(self, *, or_without_owed: bool, quiet_within: float) -> None:
        partial = self._decoder.unconsumed()
        if partial is None:  # an oversize frame in progress: its bytes are gone
            return
        now = self.clock.monotonic()
        replies = []
        for slot in self._slots:
            assert slot.reply is not None
            wait = slot.reply.wait
            replies.append(slot.reply if wait is None
                           else OwedReply(wait=replace(wait, timeout=max(0.0, slot.deadline - now))))
        owed = Owed(tuple(replies), tuple(self._relays.values()))
        # Received but not handled, in stream order: frames framed already, the
        # one in progress, then what was not framed yet.
        framed = b"".join(mllp.encode_frame(e.payload) for e in self._events if isinstance(e, mllp.Frame))
        self._handover = HandOver(framed + partial + bytes(self._unread), owed, or_without_owed, quiet_within)
        self._move(Phase.HANDING_OVER)
        self._emit(self._handover)

    def _linger(self) -> None:
        """Close after the last ACK without ever resetting the connection.

        FIN first (half-close), then read and discard until the sender closes
        too. A sender that already sent its next frame sees a clean EOF instead
        of its ACK and resends on a new connection — to the successor, through
        the shared accept queue; nothing it sent was committed here. Closing
        with unread data would send a RST, which can discard the ACK we just
        wrote before the sender read it.
        """
        self._move(Phase.LINGERING)
        self._linger_until = self.clock.monotonic() + LINGER
        self._emit(HalfClose())

    def _end_linger(self) -> None:
        self._log_discarded()
        self._close()

    def _log_discarded(self) -> None:
        if self._discarded:
            self._emit(Log("info", "bytes_after_close_discarded", {"count": self._discarded}))
            self._discarded = 0

    def _close(self) -> None:
        if self.phase not in DONE:
            self._move(Phase.CLOSED)
            self._emit(Close())
            self._cleanup()

    def _cleanup(self) -> None:
        """Closed: whatever was owed and not written is recorded undelivered (replayed on retransmit)."""
        self._handover = None
        for token, slot in self._held.items():
            self._emit(StopWaiting(token))
            assert slot.reply is not None
            assert slot.reply.wait is not None
            self._emit(RecordOutcome(slot.reply.wait.message_id, AckOutcome.UNDELIVERED))
            slot.wait_token = None
            slot.reply = NO_REPLY
        self._held.clear()
        for token, relay in self._relays.items():
            self._emit(StopWaiting(token))
            self._emit(RecordOutcome(relay.message_id, AckOutcome.UNDELIVERED))
        self._relays.clear()
        self._pump()
        self._log_unstored()

    # -- plumbing -----------------------------------------------------------------------

    def _emit(self, action: Action) -> None:
        self._actions.append(action)

    def _move(self, to: Phase) -> None:
        check_move(self.phase, to)
        self.phase = to

    def _sync(self) -> None:
        """After every input: freed slots take waiting frames, a draining connection moves on, the frame clock follows reading."""
        if self._events and self.phase in READING:
            self._process(feed=False)
        if self.phase is Phase.DRAINING:
            self._drain()
        if self._frame_left is not None:
            now = self.clock.monotonic()
            runs = self._frame_clock_runs
            if runs and self._frame_since is None:
                self._frame_since = now
            elif not runs and self._frame_since is not None:
                self._frame_left -= now - self._frame_since
                self._frame_since = None

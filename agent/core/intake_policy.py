"""Intake policy: which ACK, which row, which audit row a frame earns — pure functions.

Every row of docs/acks.md#which-ack-for-which-situation is decided here, on
the frame's bytes, the channel's settings and, after the commit, the store's
result; nothing here waits, reads a socket or touches the database. Each
function returns a :class:`Decision`: the effects to apply now (log lines,
metric counts, audit rows, ``ack_outcome`` records), the answer the frame is
owed in its turn (an :class:`OwedReply`), or the message to commit first.
``agent.core.intake.IntakeConnection`` calls these and keeps the order, the
bounds and the lifecycle; the tests call them directly, row by row.

The checks run in the documented order, the first that applies answers:
frame size, MSH present, MSH readable (an inbound ACK is recognised even
with a malformed MSH), character set and bytes, the channel's ``accept_*``
lists, then — in the store's transaction — dedupe, backpressure, commit.
"""

from __future__ import annotations

import traceback
from collections.abc import Sequence
from pathlib import PurePath

from agent.core import acks, charsets, envelope
from agent.core.acks import AckCode, Outcome
from agent.core.envelope import Envelope, MalformedMsh, NoMshSegment
from agent.core.intake_types import (
    COMMITTED,
    NO_REPLY,
    RECEIVED,
    AckMode,
    Audit,
    AuditRecord,
    ChannelPolicy,
    CommitResult,
    Committed,
    Count,
    Counter,
    Decision,
    Effect,
    Log,
    NewMessage,
    OwedFrame,
    OwedRelay,
    OwedReply,
    OwedWait,
    RecordOutcome,
)
from agent.core.states import AckOutcome
from agent.errors import HL7Error

__all__ = [
    "codec_or_default",
    "decide_frame",
    "decide_oversize",
    "final_acks",
    "handling_failed",
    "held_answer",
    "refuse",
    "relay_wanted",
    "replies_for",
    "storage_failed",
    "unsupported_reason",
]

#: The last resort's MSA-3 (HL7 table 0357: 207 application internal error).
INTERNAL_ERROR_TEXT = "internal error while handling the message; resending it is safe"
HELD_TIMEOUT_TEXT = "accepted and queued; resend later for the application response"


# -- the checks before the commit ----------------------------------------------


def decide_frame(payload: bytes, policy: ChannelPolicy, received_at: float, *, ack_always: bool = False) -> Decision:
    """A complete frame under ``max_message_bytes``: refuse it, record it, or commit it.

    ``ack_always``: a member of an HL7 batch, whose ACK batch holds one ACK
    per message whatever its MSH-15 says.
    """
    try:
        env = envelope.read_msh(payload)
    except NoMshSegment:
        wide = charsets.sniff_wide_encoding(payload)
        if wide is not None:
            # UTF-16/32 is forbidden by HL7 over MLLP and refused — but its MSH
            # can be read, so the sender gets an ACK, in ASCII.
            return refuse(envelope.read_wide_msh(payload, wide), payload, Outcome.MALFORMED, 102,
                          f"{wide.upper()} is not allowed for HL7 over MLLP; send an 8-bit encoding",
                          received_at)
        later = _msh_not_first(payload, policy, received_at, ack_always=ack_always)
        if later is not None:
            return later
        # No MSH: nothing to address an ACK to; the frame is kept as an audit row.
        dropped = Log("warning", "frame_without_msh_dropped", {"size": len(payload)})
        return Decision((Audit(AuditRecord(payload, "100", "no MSH segment", received_at=received_at),
                               then=(dropped,)),))
    except MalformedMsh as exc:
        if exc.partial is None or not exc.partial.is_ack:
            return refuse(exc.partial, payload, Outcome.MALFORMED, exc.error_code, exc.text, received_at,
                          codec=codec_or_default(exc.partial, policy), ack_always=ack_always)
        env = exc.partial  # an inbound ACK is never answered, even a sloppy one
    received = RECEIVED
    if env.is_ack:
        return _inbound_ack(payload, env, received_at)
    try:
        codec = charsets.resolve_codec(env.charset, policy.encoding)
        text = charsets.decode_message(payload, codec)
    except HL7Error as exc:
        return refuse(env, payload, Outcome.MALFORMED, exc.error_code, exc.text, received_at,
                      first=(received,), ack_always=ack_always)
    refused = unsupported_reason(env, message_types=policy.accept_message_types,
                                 processing_ids=policy.accept_processing_ids,
                                 versions=policy.accept_versions)
    if refused is not None:
        return refuse(env, payload, Outcome.UNSUPPORTED, refused[0], refused[1], received_at, codec=codec,
                      first=(received,), ack_always=ack_always)
    enhanced = env.enhanced
    ack_mode: AckMode = "enhanced" if enhanced else policy.ack
    commit_ack = None
    if ack_always or (ack_mode != "application" and acks.commit_ack_wanted(env, success=True)):
        commit_ack = acks.build_ack(env, acks.ack_code(Outcome.COMMITTED, enhanced), codec=codec)
    return Decision((received,), commit=NewMessage(env, payload, codec, text, ack_mode, commit_ack, received_at))


def _inbound_ack(payload: bytes, env: Envelope, received_at: float) -> Decision:
    """A sender acknowledging what we relayed: recorded, never queued or answered (answering would never end)."""
    record = AuditRecord(payload, "0", "inbound ACK recorded", env, received_at=received_at)
    return Decision((RECEIVED, Audit(record, limited=False, then=(
        Log("info", "inbound_ack_recorded", {"control_id": env.control_id}),))))


def _msh_not_first(payload: bytes, policy: ChannelPolicy, received_at: float, *,
                   ack_always: bool) -> Decision | None:
    """Another segment before the MSH (a broken batch header, say): AE/CE 100, as the MSH there addresses it.

    Any frame whose MSH can be read gets an ACK; HL7 table 0357's 100 is
    "segment sequence error". An inbound ACK is still never answered. None:
    no MSH segment anywhere (the first one after a segment end is looked at).
    """
    found = [at + 1 for at in (payload.find(b"\rMSH"), payload.find(b"\nMSH")) if at >= 0]
    if not found:
        return None
    try:
        env: Envelope | None = envelope.read_msh(payload[min(found):])
    except MalformedMsh as exc:
        env = exc.partial
    except NoMshSegment:
        return None
    if env is not None and env.is_ack:
        return _inbound_ack(payload, env, received_at)
    # The text names no byte before the MSH: those may be anything, patient data too.
    return refuse(env, payload, Outcome.MALFORMED, 100,
                  "segment sequence error: the message must start with its MSH segment",
                  received_at, codec=codec_or_default(env, policy), ack_always=ack_always)


def decide_oversize(prefix: bytes, size: int, policy: ChannelPolicy, received_at: float) -> Decision:
    """A frame over ``max_message_bytes``: AE/CE 207 from the MSH at its start; only ``prefix`` was kept."""
    limit = policy.max_message_bytes
    text = f"message of {size} bytes exceeds max_message_bytes {limit}"
    too_large = Log("warning", "frame_too_large", {"size": size, "limit": limit})
    try:
        env: Envelope | None = envelope.read_msh(prefix)
    except NoMshSegment:
        return Decision((Audit(AuditRecord(prefix, "207", text, received_at=received_at), then=(too_large,)),))
    except MalformedMsh as exc:
        env = exc.partial
    return refuse(env, prefix, Outcome.TOO_LARGE, 207, text, received_at, codec=codec_or_default(env, policy),
                  logs=(too_large,))


def unsupported_reason(
    env: Envelope,
    *,
    message_types: Sequence[str] = (),
    processing_ids: Sequence[str] = (),
    versions: Sequence[str] = (),
) -> tuple[int, str] | None:
    """Why a channel that restricts what it takes refuses ``env``: (ERR-3 code, text), or None.

    HL7 table 0357: 200 unsupported message type, 201 unsupported event code,
    202 unsupported processing id, 203 unsupported version id (answered AR/CR).
    ``message_types`` entries are "ADT" (every event) or "ADT^A01"; a version
    "2.5" also admits "2.5.1". Empty lists restrict nothing.
    """
    if message_types:
        code = env.message_code.upper()
        event = env.trigger_event.upper()
        codes = {t.split("^", 1)[0] for t in message_types}
        if code not in codes:
            return 200, f"message type {code} is not accepted on this channel"
        if code not in message_types and f"{code}^{event}" not in message_types:
            return 201, f"event {code}^{event} is not accepted on this channel"
    if processing_ids:
        processing = env.processing_id.split(env.component_sep, 1)[0].strip()
        if processing not in processing_ids:
            return 202, f"processing id {processing or '(empty)'} is not accepted on this channel"
    if versions:
        version = env.version
        if not any(version == v or version.startswith(v + ".") for v in versions):
            return 203, f"version {version} is not accepted on this channel"
    return None


def codec_or_default(env: Envelope | None, policy: ChannelPolicy) -> str:
    """The codec a reject is written in: the message's, when it can be resolved, else ASCII."""
    if env is None:
        return "ascii"
    try:
        return charsets.resolve_codec(env.charset, policy.encoding)
    except HL7Error:
        return "ascii"


def backpressure_text(result: CommitResult) -> str:
    """MSA-3 of a refusal for room: which limit, in words a sender's operator can act on."""
    if result.refused_for == "disk":
        return "disk space low: message not accepted, resend later"
    return "queue full: message not accepted, resend later"


def refuse(
    env: Envelope | None,
    body: bytes,
    outcome: Outcome,
    error_code: int,
    text: str,
    received_at: float,
    *,
    codec: str = "ascii",
    audit: bool = True,
    first: tuple[Effect, ...] = (),
    logs: tuple[Log, ...] = (),
    ack_always: bool = False,
) -> Decision:
    """A non-accept ACK (if MSH-15 wants one, or ``ack_always``) and, with ``audit``, a ``nacked`` audit row.

    ``first`` is applied before; ``logs`` and the ``message_rejected`` line
    are written only when the audit row is kept (junk past the audit bound
    costs no log line) or when there is no audit row at all.
    """
    code = acks.ack_code(outcome, env.enhanced if env is not None else False)
    effects = list(first)
    ack: bytes | None = None
    if env is None or ack_always or acks.commit_ack_wanted(env, success=False):
        ack = acks.build_ack(env, code, text=text, error_code=error_code, codec=codec,
                             inbound_control_id=envelope.scrape_control_id(body) if env is None else "")
        effects.append(Count(Counter.MESSAGE_REJECTED, str(code)))
    rejected = Log("info", "message_rejected", {
        "code": str(code), "error_code": error_code, "reason": text,
        "control_id": env.control_id if env else None, "message_type": env.message_type if env else None,
    })
    if audit:
        record = AuditRecord(body, str(error_code), text, env, ack_sent=ack, received_at=received_at)
        effects.append(Audit(record, then=(*logs, rejected)))
    else:
        effects.extend((*logs, rejected))
    return Decision(tuple(effects), OwedReply((OwedFrame(ack),)) if ack is not None else NO_REPLY)


# -- after the commit ---------------------------------------------------------------


def replies_for(message: NewMessage, result: CommitResult, policy: ChannelPolicy, *,
                ack_always: bool = False) -> Decision:
    """The store's answer for ``message``: the ACKs it is owed, or why it was not accepted."""
    env = message.envelope
    if result.outcome == "accepted":
        # Debug, not info: a line per message cost a fifth of intake's CPU (bench/README.md).
        first: tuple[Effect, ...] = (
            Log("debug", "message_committed", {"control_id": env.control_id, "message_type": env.message_type,
                                               "id": result.message_id, "seq": result.seq}),
            COMMITTED, Committed(result.message_id))
        return final_acks(env, message.codec, result.message_id, message.ack_mode, policy,
                          commit_ack=message.commit_ack, app_ack=None, first=first)
    ids = {"control_id": env.control_id, "message_type": env.message_type, "id": result.message_id}
    if result.outcome == "backpressure":
        return refuse(env, message.body, Outcome.RESEND_LATER, 207, backpressure_text(result),
                      message.received_at, codec=message.codec, audit=False,
                      first=(Log("warning", "message_refused_backpressure", ids),), ack_always=ack_always)
    if result.outcome == "conflict":
        return refuse(env, message.body, Outcome.DUPLICATE_KEY, 205,
                      f"duplicate key identifier: MSH-10 {env.control_id} was used for another message",
                      message.received_at, codec=message.codec,
                      first=(Log("warning", "control_id_reused_with_other_body",
                                 {**ids, "prior_id": result.message_id}),), ack_always=ack_always)
    # A retransmit: the final ACK replayed byte for byte (docs/acks.md#retransmits-and-dedupe).
    replayed = Log("info", "retransmit_answered_from_dedupe", {**ids, "prior_state": result.prior_state})
    return final_acks(env, message.codec, result.message_id, result.ack_mode, policy,
                      commit_ack=result.commit_ack, app_ack=result.app_ack, first=(replayed,))


def final_acks(
    env: Envelope,
    codec: str,
    message_id: str,
    ack_mode: str,
    policy: ChannelPolicy,
    *,
    commit_ack: bytes | None,
    app_ack: bytes | None,
    first: tuple[Effect, ...] = (),
) -> Decision:
    """What a committed row's sender gets, per mode (docs/acks.md#original-and-enhanced-mode)."""
    if ack_mode == "commit":
        if commit_ack is None:
            return Decision((*first, RecordOutcome(message_id, AckOutcome.NOT_OWED)))
        return Decision(first, OwedReply((OwedFrame(commit_ack, message_id),)))
    effects = list(first)
    if ack_mode == "enhanced":
        # MSH-15 governed the commit ACK (built before the commit); MSH-16 governs the application ACK.
        frames = [] if commit_ack is None else [OwedFrame(commit_ack)]
        relay = None
        if app_ack is not None:
            if relay_wanted(env, app_ack):
                frames.append(OwedFrame(app_ack, message_id))
            else:
                effects.append(RecordOutcome(message_id, AckOutcome.NOT_OWED))
        elif env.application_ack_type.upper() == "NE":
            effects.append(RecordOutcome(message_id, AckOutcome.NOT_OWED))
        else:
            relay = OwedRelay(message_id, env)
        return Decision(tuple(effects), OwedReply(tuple(frames), relay=relay))
    # Original mode, channel ack = "application": the answer is the server's ACK.
    if app_ack is None:
        return Decision(tuple(effects), OwedReply(wait=OwedWait(message_id, env, codec,
                                                                policy.application_ack_timeout)))
    return Decision(tuple(effects), OwedReply((OwedFrame(app_ack, message_id),)))


def relay_wanted(inbound: Envelope, app_ack: bytes) -> bool:
    """Whether MSH-16 asks for this application ACK (HL7 table 0155; accept means AA or CA)."""
    return acks.application_ack_wanted(inbound, success=acks.read_ack_code(app_ack) in ("AA", "CA"))


def held_answer(wait: OwedWait, app_ack: bytes | None, *, at_stop: bool) -> Decision:
    """A held application ACK's answer: the server's ACK, or AR 207 "resend later" (time out or stop).

    The row stays queued and will be delivered; the sender's retransmit gets
    the real application ACK once there is one.
    """
    if app_ack is not None:
        return Decision(reply=OwedReply((OwedFrame(app_ack, wait.message_id),)))
    event = "application_ack_deferred_at_stop" if at_stop else "application_ack_timed_out"
    ar = acks.build_ack(wait.inbound, AckCode.AR, codec=wait.codec, error_code=207, text=HELD_TIMEOUT_TEXT)
    return Decision((RecordOutcome(wait.message_id, AckOutcome.UNDELIVERED),
                     Log("info", event, {"id": wait.message_id, "control_id": wait.inbound.control_id}),
                     Count(Counter.MESSAGE_REJECTED, str(AckCode.AR))),
                    OwedReply((OwedFrame(ar),)))


def storage_failed(message: NewMessage, error: str, *, ack_always: bool = False) -> Decision:
    """The commit failed: AR/CE 207 "resend later", never AA/CA, and nothing kept (the disk is the problem)."""
    env = message.envelope
    failed = Log("error", "message_not_committed", {"control_id": env.control_id, "error": error})
    return refuse(env, message.body, Outcome.RESEND_LATER, 207, "storage failure: message not accepted, resend later",
                  message.received_at, codec=message.codec, audit=False, first=(failed,),
                  ack_always=ack_always)


def handling_failed(exc: BaseException, payload: bytes, received_at: float) -> Decision:
    """Last resort for a frame whose handling raised: AE/CE 207 and an audit row, never silence.

    Any frame whose MSH can be read gets an ACK (except an inbound ACK, or
    where MSH-15 waives it) and every frame an audit row, whatever went
    wrong. HL7 table 0357: 207 application internal error. The log line
    names the exception type and where it was raised, never its text,
    which may quote the message.
    """
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{PurePath(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    failed = Log("error", "frame_handling_failed", {"error_type": type(exc).__name__, "where": where})
    env: Envelope | None = None
    try:
        try:
            env = envelope.read_msh(payload)
        except MalformedMsh as malformed:
            env = malformed.partial
        except NoMshSegment:
            return Decision((failed, Audit(AuditRecord(payload, "207", INTERNAL_ERROR_TEXT, received_at=received_at))))
        if env is not None and env.is_ack:
            return Decision((failed, Audit(AuditRecord(payload, "207", INTERNAL_ERROR_TEXT, received_at=received_at))))
        return refuse(env, payload, Outcome.MALFORMED, 207, INTERNAL_ERROR_TEXT, received_at, first=(failed,))
    except Exception as again:  # noqa: BLE001 - even the reject failed: the minimal ACK still goes out
        again_failed = Log("error", "frame_handling_failed", {"error_type": type(again).__name__, "where": "reject"})
        if env is not None and not acks.commit_ack_wanted(env, success=False):
            return Decision((failed, again_failed))
        code = acks.ack_code(Outcome.MALFORMED, env is not None and env.enhanced)
        minimal = acks.build_ack(None, code, text=INTERNAL_ERROR_TEXT, error_code=207)
        return Decision((failed, again_failed), OwedReply((OwedFrame(minimal),)))

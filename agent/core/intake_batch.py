"""Intake policy for HL7 batch frames: every member checked, all committed or none, one ACK batch.

The same rules as a single message (agent.core.intake_policy), applied to
each member of the batch (agent.core.batch), with three differences that
the batch protocol makes (HL7 v2.5 section 2.10.3):

- every member gets an ACK in the ACK batch, in order, whatever its MSH-15
  says; application ACKs (enhanced mode's MSH-16, or a channel with
  ``ack = "application"``) are relayed one by one after the ACK batch;
- a member that fails a check before the store's refuses the whole batch:
  nothing is committed, that member gets its own reject and every other
  member a reject whose text says the batch was refused; the frame is kept
  as one audit row;
- the members are one commit (all or none); the write of the ACK batch
  settles ``ack_outcome`` for every member whose final ACK it carries.
"""

from __future__ import annotations

from agent.core import acks, envelope
from agent.core import batch as batch_
from agent.core.acks import Outcome
from agent.core.envelope import Envelope
from agent.core.intake_policy import (
    codec_or_default,
    decide_frame,
    refuse,
    relay_wanted,
    replies_for,
    storage_failed,
)
from agent.core.intake_types import (
    NO_REPLY,
    Audit,
    AuditRecord,
    BatchPlan,
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
    RecordOutcome,
)
from agent.core.states import AckOutcome
from agent.errors import EnvelopeError

__all__ = ["batch_replies", "batch_storage_failed", "decide_batch", "decide_oversize_batch"]

#: HL7 table 0357: 100 segment sequence error (a batch whose envelope does not add up).
_STRUCTURE_ERROR = 100


def _hl7_now() -> str:
    # acks.build_ack writes MSH-7 this way; an empty batch has no member ACK to take it from.
    first = acks.build_ack(None, acks.AckCode.AA).split(b"\r", 1)[0].decode("ascii")
    return first.split("|")[6]


def _member_name(number: int, env: Envelope | None) -> str:
    cid = env.control_id if env is not None else ""
    return f"member {number} (MSH-10 {cid})" if cid else f"member {number}"


def _envelope(member: bytes) -> Envelope | None:
    try:
        return envelope.read_msh(member)
    except EnvelopeError as exc:
        partial = getattr(exc, "partial", None)
        return partial if isinstance(partial, Envelope) else None


def decide_batch(payload: bytes, batch: batch_.Batch, policy: ChannelPolicy, received_at: float) -> Decision:
    """A complete batch frame: refuse it whole, record it (an ACK batch from the sender), or commit it."""
    members = batch.members
    envs = [_envelope(m) for m in members]
    if members and all(e is not None and e.is_ack for e in envs):
        # The sender acknowledging in a batch: recorded, never queued or answered.
        record = AuditRecord(payload, "0", "inbound ACK batch recorded", envs[0], received_at=received_at)
        return Decision((Log("info", "inbound_ack_batch_recorded", {"members": len(members)}),
                         Audit(record, limited=False)))
    messages: list[NewMessage] = []
    refusals: dict[int, tuple[bytes, str, str]] = {}  # member index -> (reject ACK, ERR-3, reason)
    effects: list[Effect] = []
    for index, (member, env) in enumerate(zip(members, envs, strict=True)):
        if env is not None and env.is_ack:
            reason = "an ACK message cannot be a member of a batch of messages"
            decision = refuse(env, member, Outcome.UNSUPPORTED, 200, reason, received_at, audit=False,
                              ack_always=True)
            refusals[index] = (decision.reply.frames[0].frame, "200", reason)
            continue
        decision = decide_frame(member, policy, received_at, ack_always=True)
        # Received counts per member; rejections are counted once, from the ACK batch (below).
        effects.extend(e for e in decision.effects if isinstance(e, Count) and e.counter is Counter.MESSAGE_RECEIVED)
        if decision.commit is not None:
            messages.append(decision.commit)
            continue
        audit = next((e.record for e in decision.effects if isinstance(e, Audit)), None)
        code, reason = (audit.error_code, audit.error_text) if audit is not None else ("207", "not accepted")
        frames = decision.reply.frames
        ack = frames[0].frame if frames else acks.build_ack(env, acks.AckCode.AE, text=reason, error_code=207)
        refusals[index] = (ack, code, reason)
    if batch.problem is None and not refusals:
        if not messages:  # an empty batch: answered at once, nothing to commit
            return Decision(tuple(effects), OwedReply((OwedFrame(batch_.ack_batch(batch, (), now=_hl7_now())),)))
        return Decision(tuple(effects), batch=BatchPlan(batch, tuple(messages), payload, received_at))
    return _refused(payload, batch, envs, refusals, policy, received_at, effects)


def decide_oversize_batch(prefix: bytes, size: int, policy: ChannelPolicy, received_at: float) -> Decision:
    """A batch frame over ``max_message_bytes``: an ACK batch refusing every member its kept prefix shows.

    Only the frame's first bytes were kept (the framer discards the rest
    unbuffered), so the answer names the members found there, each AE/CE
    with ERR-3 207, and says nothing of the batch was accepted.
    """
    found = batch_.split_batch(prefix)
    assert found is not None
    limit = policy.max_message_bytes
    text = f"batch of {size} bytes exceeds max_message_bytes {limit}; nothing of it was accepted"
    member_acks = []
    for member in found.members:
        env = _envelope(member)
        code = acks.ack_code(Outcome.TOO_LARGE, env is not None and env.enhanced)
        member_acks.append(acks.build_ack(env, code, text=text, error_code=207, codec=codec_or_default(env, policy),
                                          inbound_control_id=envelope.scrape_control_id(member) if env is None else ""))
    whole = batch_.Batch(found.fhs, found.groups, found.fts)
    response = batch_.ack_batch(whole, member_acks, now=_hl7_now(), comment="batch refused")
    too_large = Log("warning", "frame_too_large", {"size": size, "limit": limit, "members_seen": len(member_acks)})
    effects: list[Effect] = [Count(Counter.MESSAGE_REJECTED, acks.read_ack_code(a) or "") for a in member_acks]
    effects.append(Audit(AuditRecord(prefix, "207", text, _envelope(found.members[0]) if found.members else None,
                                     ack_sent=response, received_at=received_at), then=(too_large,)))
    return Decision(tuple(effects), OwedReply((OwedFrame(response),)))


def _refused(payload: bytes, batch: batch_.Batch, envs: list[Envelope | None],
             refusals: dict[int, tuple[bytes, str, str]], policy: ChannelPolicy, received_at: float,
             effects: list[Effect]) -> Decision:
    """Nothing committed: each refused member its reject, every other one "the batch was refused"."""
    if batch.problem is not None:
        first_code, why = str(_STRUCTURE_ERROR), batch.problem
        others_text = f"batch refused, nothing of it was accepted: {batch.problem}"
        error = _STRUCTURE_ERROR
    else:
        index = min(refusals)
        first_code = refusals[index][1]
        why = f"{_member_name(index + 1, envs[index])}: {refusals[index][2]}"
        others_text = f"batch refused, nothing of it was accepted: {why}"
        error = 207
    member_acks: list[bytes] = []
    for index, env in enumerate(envs):
        if index in refusals and batch.problem is None:
            member_acks.append(refusals[index][0])
            continue
        codec = codec_or_default(env, policy)
        outcome = Outcome.MALFORMED if batch.problem is not None else Outcome.RESEND_LATER
        ack = acks.build_ack(env, acks.ack_code(outcome, env is not None and env.enhanced), text=others_text,
                             error_code=error, codec=codec,
                             inbound_control_id=envelope.scrape_control_id(batch.members[index]) if env is None else "")
        member_acks.append(ack)
    for ack in member_acks:
        effects.append(Count(Counter.MESSAGE_REJECTED, acks.read_ack_code(ack) or ""))
    response = batch_.ack_batch(batch, member_acks, now=_hl7_now(), comment="batch refused")
    refused = Log("warning", "batch_refused", {"members": len(envs), "reason": why})
    record = AuditRecord(payload, first_code, f"batch refused: {why}", envs[0] if envs else None,
                         ack_sent=response, received_at=received_at)
    effects.append(Audit(record, then=(refused,)))
    return Decision(tuple(effects), OwedReply((OwedFrame(response),)))


def batch_replies(plan: BatchPlan, results: list[CommitResult] | tuple[CommitResult, ...],
                  policy: ChannelPolicy) -> Decision:
    """The store's answers for a batch's members: one ACK batch, then the application ACKs owed."""
    effects: list[Effect] = []
    member_acks: list[bytes] = []
    settled: list[str] = []
    after: list[OwedFrame] = []
    relays: list[OwedRelay] = []
    for message, result in zip(plan.messages, results, strict=True):
        env = message.envelope
        ids = {"control_id": env.control_id, "message_type": env.message_type, "id": result.message_id}
        if result.outcome in ("backpressure", "conflict"):
            decision = replies_for(message, result, policy, ack_always=True)
            effects.extend(decision.effects)
            member_acks.append(decision.reply.frames[0].frame)
            continue
        duplicate = result.outcome != "accepted"
        if duplicate:
            effects.append(Log("info", "retransmit_answered_from_dedupe", {**ids, "prior_state": result.prior_state}))
        else:
            effects.extend((Log("debug", "message_committed", {**ids, "seq": result.seq}),  # as single messages
                            Count(Counter.MESSAGE_COMMITTED), Committed(result.message_id)))
        mode = result.ack_mode if duplicate else message.ack_mode
        commit_ack = result.commit_ack if duplicate else message.commit_ack
        if commit_ack is None:  # a prior stored without one (MSH-15 waived it): the batch still has one
            commit_ack = acks.build_ack(env, acks.ack_code(Outcome.COMMITTED, env.enhanced), codec=message.codec)
        member_acks.append(commit_ack)
        if mode == "commit":
            settled.append(result.message_id)
            continue
        app_ack = result.app_ack if duplicate else None
        if app_ack is not None:
            if relay_wanted(env, app_ack):
                after.append(OwedFrame(app_ack, result.message_id))
            else:
                effects.append(RecordOutcome(result.message_id, AckOutcome.NOT_OWED))
        elif mode == "enhanced" and env.application_ack_type.upper() == "NE":
            effects.append(RecordOutcome(result.message_id, AckOutcome.NOT_OWED))
        else:
            relays.append(OwedRelay(result.message_id, env))
    response = batch_.ack_batch(plan.batch, member_acks, now=_hl7_now())
    frame = OwedFrame(response, settled[0], tuple(settled[1:])) if settled else OwedFrame(response)
    return Decision(tuple(effects), OwedReply((frame, *after), relays=tuple(relays)))


def batch_storage_failed(plan: BatchPlan, error: str) -> Decision:
    """The commit failed: every member AR/CE 207 "resend later" in one ACK batch, nothing kept."""
    effects: list[Effect] = []
    member_acks: list[bytes] = []
    for message in plan.messages:
        decision = storage_failed(message, error, ack_always=True)
        effects.extend(decision.effects)
        member_acks.append(decision.reply.frames[0].frame)
    if not member_acks:
        return Decision(tuple(effects), NO_REPLY)
    return Decision(tuple(effects), OwedReply((OwedFrame(batch_.ack_batch(plan.batch, member_acks, now=_hl7_now())),)))

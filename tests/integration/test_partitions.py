"""Partitioned channels end to end, in process: order per patient, several in flight (docs/queue.md#partitioned-channels).

A real Agent on 127.0.0.1, real MLLP senders, the real DevServer whose
``decide`` hook scripts the server. The server's latency is scripted
(``asyncio.sleep`` inside the hook); waiting is by polling with a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import defaultdict
from pathlib import Path

import pytest
from agenttest import run_async as run
from agenttest import until

from agent.app.commands.channel import cmd_channel
from agent.app.commands.queue import cmd_show
from agent.app.devserver import Answer, default_answer
from agent.core.partition import key_hash
from agent.core.protocol import Transmit
from agent.storage.store import SqliteStore
from tests.agenttest import ack_code, hl7_message
from tests.integration.test_dispatch import (
    agent_running,
    dev_server,
    port_of,
    rows,
    send_all,
    settings_for,
    url,
)

PATIENTS = 8
PER_PATIENT = 10
DELAY = 0.2


def interleaved(prefix: str = "P") -> list[tuple[str, str]]:
    """(control id, patient) for 8 patients x 10 messages, interleaved round robin."""
    return [(f"{prefix}{n:03d}", f"PAT{n % PATIENTS}") for n in range(PATIENTS * PER_PATIENT)]


def messages(plan: list[tuple[str, str]]) -> list[bytes]:
    return [hl7_message(c, pid=p) for c, p in plan]


class Recorder:
    """A decide hook: answers after ``delay``, counts what is in flight, per channel and per key."""

    def __init__(self, delay: float = DELAY) -> None:
        self.delay = delay
        self.open = 0
        self.max_open = 0
        self.open_keys: dict[str | None, int] = defaultdict(int)
        self.key_overlaps: list[str] = []
        self.first: float | None = None
        self.last: float = 0.0
        self.blocked: set[str] = set()  # control ids answered 503 while in here
        self.released = asyncio.Event()

    async def __call__(self, t: Transmit) -> Answer:
        self.first = self.first if self.first is not None else time.monotonic()
        self.open += 1
        self.max_open = max(self.max_open, self.open)
        self.open_keys[t.partition] += 1
        if self.open_keys[t.partition] > 1:
            self.key_overlaps.append(t.control_id)
        try:
            await asyncio.sleep(self.delay)  # scripted server latency
        finally:
            self.open -= 1
            self.open_keys[t.partition] -= 1
            self.last = time.monotonic()
        if t.control_id in self.blocked and not self.released.is_set():
            return Answer(503)
        return default_answer(t)


def check_order(received: list[Transmit], plan: list[tuple[str, str]]) -> None:
    """Per patient: first sends in arrival order, and nothing sent before its predecessor was answered."""
    first_seen: list[Transmit] = []
    seen: set[str] = set()
    for t in received:
        if t.id not in seen:
            seen.add(t.id)
            first_seen.append(t)
    by_patient: dict[str, list[str]] = defaultdict(list)
    for t in first_seen:
        assert t.partition is not None
        by_patient[t.partition].append(t.control_id)
    expected: dict[str, list[str]] = defaultdict(list)
    for c, p in plan:
        expected[p].append(c)
    assert dict(by_patient) == dict(expected)


class TestThroughput:
    def test_eight_patients_four_in_flight_beat_strict_order(self, tmp_path: Path) -> None:
        """8 patients x 10 messages, a 200 ms server, max_in_flight = 4: at most 4 in flight, one per
        patient, per-patient order kept, and the total well under 60% of strict order.

        Strict order sends one message at a time, so it takes at least 80 x 200 ms = 16 s whatever
        else happens; 60% of that lower bound is the budget.
        """
        plan = interleaved()
        recorder = Recorder()

        async def scenario() -> None:
            async with dev_server(recorder) as server:
                s = settings_for(tmp_path, url(server), [
                    {"name": "adt", "partition_key": "PID-3.1", "max_in_flight": 4}])
                async with agent_running(s) as agent:
                    acks = await send_all(port_of(agent, "adt"), messages(plan))
                    assert [ack_code(a) for a in acks] == ["AA"] * len(plan)
                    await until(lambda: rows(agent, "SELECT count(*) FROM messages WHERE state = 'processed'")
                                == [(len(plan),)], 60, "every row processed")
                    assert recorder.first is not None
                    elapsed = recorder.last - recorder.first
                    strict_lower_bound = len(plan) * DELAY
                    assert elapsed <= 0.6 * strict_lower_bound, (elapsed, strict_lower_bound)
                    assert recorder.max_open == 4, recorder.max_open
                    assert recorder.key_overlaps == []
                    assert len(server.received) == len(plan), "a message was sent twice"
                    check_order(server.received, plan)
                    # seq still counts per channel, and the key is the patient id.
                    assert sorted(t.seq for t in server.received) == list(range(1, len(plan) + 1))
                    assert {t.partition for t in server.received} == {f"PAT{i}" for i in range(PATIENTS)}
                    stored = rows(agent, "SELECT DISTINCT partition_key FROM messages WHERE state = 'processed'")
                    assert {r[0] for r in stored} == {f"PAT{i}" for i in range(PATIENTS)}

        run(scenario())


class TestBlockedKeys:
    def test_a_503_head_blocks_only_its_patient(self, tmp_path: Path) -> None:
        """PAT0's first message is answered 503 until released: every other patient is delivered
        meanwhile, none of PAT0's later messages is sent, and then PAT0 goes on in order."""
        plan = interleaved()
        recorder = Recorder(delay=0.01)
        recorder.blocked = {plan[0][0]}
        others = [c for c, p in plan if p != "PAT0"]

        async def scenario() -> None:
            async with dev_server(recorder) as server:
                s = settings_for(tmp_path, url(server), [
                    {"name": "adt", "partition_key": "PID-3.1", "max_in_flight": 4}])
                async with agent_running(s) as agent:
                    await send_all(port_of(agent, "adt"), messages(plan))
                    await until(lambda: {t.control_id for t in server.received if t.id in server.answered}
                                >= set(others), 30, "every other patient delivered")
                    pat0 = [t for t in server.received if t.partition == "PAT0"]
                    assert {t.control_id for t in pat0} == {plan[0][0]}, "PAT0 went on past its head"
                    assert len(pat0) >= 2  # retried, not given up
                    # Between attempts the head is queued with its error (blocked, retrying);
                    # while an attempt is out it is inflight: wait for the former.
                    deadline = time.monotonic() + 15
                    while True:
                        view = await agent.reader.call(SqliteStore.blocked_partitions, time.time() - 60)
                        if view or time.monotonic() > deadline:
                            break
                        await asyncio.sleep(0.02)
                    assert [(b.why, b.depth) for b in view] == [("retrying", PER_PATIENT)]
                    recorder.released.set()
                    await until(lambda: rows(agent, "SELECT count(*) FROM messages WHERE state = 'processed'")
                                == [(len(plan),)], 30, "PAT0 delivered after the release")
                    check_order(server.received, plan)
                    assert recorder.key_overlaps == []

        run(scenario())

    def test_on_reject_pause_pauses_the_key_and_resume_clears_it(
            self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """A 400 on PAT0's head with on_reject = "pause" holds PAT0 only; `channel resume` lets it go.

        The channel itself was never paused: the command must clear the key's
        pause all the same (it once said "already resumed" and left it).
        """
        plan = interleaved()
        rejected = plan[0][0]

        async def decide(t: Transmit) -> Answer:
            return Answer(400) if t.control_id == rejected else default_answer(t)

        async def scenario() -> None:
            async with dev_server(decide) as server:
                s = settings_for(tmp_path, url(server), [
                    {"name": "adt", "partition_key": "PID-3.1", "max_in_flight": 4, "on_reject": "pause"}])
                async with agent_running(s) as agent:
                    await send_all(port_of(agent, "adt"), messages(plan))
                    others = len(plan) - PER_PATIENT
                    await until(lambda: rows(agent, "SELECT count(*) FROM messages WHERE state = 'processed'")
                                == [(others,)], 30, "the other patients delivered")
                    assert rows(agent, "SELECT state, count(*) FROM messages WHERE partition_key = 'PAT0'"
                                       " GROUP BY state ORDER BY state") == [("queued", 9), ("rejected", 1)]
                    assert rows(agent, "SELECT paused FROM channels WHERE channel = 'adt'") == [(0,)]
                    paused = rows(agent, "SELECT partition_key, reason FROM partition_pauses")
                    assert [p[0] for p in paused] == ["PAT0"] and "rejected row" in paused[0][1]
                    # `queue show` on a row held behind the paused key says so, by the key's hash.
                    held = rows(agent, "SELECT id FROM messages WHERE partition_key = 'PAT0' AND state = 'queued'"
                                       " ORDER BY seq LIMIT 1")[0][0]
                    secret = rows(agent, "SELECT value FROM meta WHERE key = 'key_hash_secret'")[0][0]
                    show = argparse.Namespace(id=held, raw=False, json=True)
                    capsys.readouterr()  # the log so far
                    assert await asyncio.to_thread(cmd_show, s, show) == 0
                    shown_text = capsys.readouterr().out
                    shown = json.loads(shown_text)
                    assert shown["partition"] == key_hash("PAT0", secret)
                    assert "rejected row" in shown["partition_paused"] and "PAT0" not in shown_text
                    resume = argparse.Namespace(name="adt", channel_command="resume")
                    assert await asyncio.to_thread(cmd_channel, s, resume) == 0
                    assert "channel adt: resumed; 1 paused key resumed" in capsys.readouterr().out
                    await until(lambda: rows(agent, "SELECT count(*) FROM messages WHERE state = 'processed'")
                                == [(len(plan) - 1,)], 30, "PAT0 delivered after resume")
                    assert rows(agent, "SELECT count(*) FROM partition_pauses") == [(0,)]
                    pat0 = [t.control_id for t in server.received if t.partition == "PAT0"]
                    assert pat0 == [c for c, p in plan if p == "PAT0"]

        run(scenario())


class TestLogs:
    def test_key_values_never_reach_the_log_only_their_hash(self, tmp_path: Path, capfd: object) -> None:
        """Patient ids are patient data: the log names a partition by its hash."""
        plan = [("L1", "SECRET-MRN-1"), ("L2", "SECRET-MRN-2")]

        async def decide(t: Transmit) -> Answer:
            return Answer(503) if t.attempt == 1 else default_answer(t)

        async def scenario() -> None:
            async with dev_server(decide) as server:
                s = settings_for(tmp_path, url(server), [
                    {"name": "adt", "partition_key": "PID-3.1", "max_in_flight": 2}],
                    logging={"level": "debug"})
                async with agent_running(s) as agent:
                    await send_all(port_of(agent, "adt"), messages(plan))
                    await until(lambda: rows(agent, "SELECT count(*) FROM messages WHERE state = 'processed'")
                                == [(2,)], 30, "both processed")
                    secret.append(rows(agent, "SELECT value FROM meta WHERE key = 'key_hash_secret'")[0][0])
                    del server

        secret: list[str] = []
        run(scenario())
        out, err = capfd.readouterr()  # type: ignore[attr-defined]
        text = out + err
        assert "transmit_retry_scheduled" in text
        assert "SECRET-MRN" not in text
        assert key_hash("SECRET-MRN-1", secret[0]) in text

    def test_sequence_numbers_on_a_partitioned_channel_are_warned_about(
            self, tmp_path: Path, capfd: object) -> None:
        """assign_sequence_numbers with partition_key (max_in_flight = 1, so allowed): keys still pass
        each other, so MSH-13 may reach the server out of order; the start says so."""
        async def scenario() -> None:
            async with dev_server() as server:
                s = settings_for(tmp_path, url(server), [
                    {"name": "adt", "partition_key": "PID-3.1", "assign_sequence_numbers": True},
                    {"name": "lab", "assign_sequence_numbers": True}])
                async with agent_running(s):
                    pass

        run(scenario())
        out, err = capfd.readouterr()  # type: ignore[attr-defined]
        warned = [line for line in (out + err).splitlines() if "sequence_numbers_across_partitions" in line]
        assert len(warned) == 1 and "adt" in warned[0]

"""HL7 batches end to end, in process: a real Agent, real MLLP sockets, a real SQLite file, a real DevServer.

A batch frame (FHS/BHS … BTS/FTS) is one commit and one response frame
(an ACK batch); each member is a row of its own and is delivered on its
own, in order; a retransmitted batch is answered from dedupe, byte for
byte, and delivered no second time; a broken member commits nothing.
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import pytest
from agenttest import ack_code, batch_of, hl7_message, members_of, msa2, until
from agenttest import run_async as run
from intakefuzz import mutate

from agent.app.devserver import DevServer
from agent.core.batch import split_batch
from agent.core.protocol import Transmit
from tests.integration.test_dispatch import (
    MllpConn,
    agent_running,
    dev_server,
    first_attempts,
    port_of,
    rows,
    settings_for,
    url,
)

DATA = Path(__file__).resolve().parent.parent / "data"
SAMPLES = sorted(DATA.glob("batch_*.hl7"))


def live_rows(agent: object) -> list[tuple[str, int, str, bytes]]:
    return [(str(r[0]), int(r[1]), str(r[2]), bytes(r[3])) for r in rows(
        agent,  # type: ignore[arg-type]
        "SELECT control_id, seq, state, body FROM messages WHERE state <> 'nacked' ORDER BY seq")]


def audit_count(agent: object) -> int:
    return int(rows(agent, "SELECT count(*) FROM messages WHERE state = 'nacked'")[0][0])  # type: ignore[arg-type]


async def delivered(server: DevServer, n: int) -> list[Transmit]:
    await until(lambda: len(first_attempts(server, "adt")) >= n, timeout=20, what=f"{n} transmits")
    return first_attempts(server, "adt")


class TestBatchEndToEnd:
    def test_batch_of_three_one_response_three_rows_three_transmits_in_order(self, tmp_path: Path) -> None:
        async def scenario() -> None:
            async with dev_server() as server, agent_running(
                    settings_for(tmp_path, url(server), [{"name": "adt"}])) as agent:
                members = [hl7_message(c, pid=str(i)) for i, c in enumerate(("B-1", "B-2", "B-3"))]
                conn = await MllpConn.open(port_of(agent, "adt"))
                response = await conn.exchange(batch_of(*members, fhs=True))
                assert response.startswith(b"FHS|") and response.endswith(b"BTS|3\rFTS|1\r")
                assert [(ack_code(a), msa2(a)) for a in members_of(response)] == [
                    ("AA", "B-1"), ("AA", "B-2"), ("AA", "B-3")]
                assert conn.pending == [], "one response frame for the batch"
                assert [(c, s, b) for c, s, _, b in live_rows(agent)] == [
                    ("B-1", 1, members[0]), ("B-2", 2, members[1]), ("B-3", 3, members[2])]
                sent = await delivered(server, 3)
                assert [t.control_id for t in sent] == ["B-1", "B-2", "B-3"]
                await until(lambda: {s for _, _, s, _ in live_rows(agent)} == {"processed"}, what="settled")
                await conn.close()
        run(scenario())

    def test_retransmitted_batch_replayed_byte_for_byte_and_not_delivered_again(self, tmp_path: Path) -> None:
        async def scenario() -> None:
            async with dev_server() as server, agent_running(
                    settings_for(tmp_path, url(server), [{"name": "adt"}])) as agent:
                batch = batch_of(hl7_message("R-1"), hl7_message("R-2"))
                conn = await MllpConn.open(port_of(agent, "adt"))
                first = await conn.exchange(batch)
                await delivered(server, 2)
                await conn.close()
                again = await MllpConn.open(port_of(agent, "adt"))
                assert await again.exchange(batch) == first
                await again.close()
                assert [c for c, *_ in live_rows(agent)] == ["R-1", "R-2"], "no second row"
                await until(lambda: {s for _, _, s, _ in live_rows(agent)} == {"processed"}, what="settled")
                assert [t.control_id for t in server.received] == ["R-1", "R-2"], "no second delivery"
        run(scenario())

    def test_broken_member_commits_nothing(self, tmp_path: Path) -> None:
        async def scenario() -> None:
            async with agent_running(settings_for(tmp_path, None, [{"name": "adt"}])) as agent:
                broken = hl7_message("X-2").replace(b"|P|2.5.1", b"|P|")  # MSH-12 missing
                conn = await MllpConn.open(port_of(agent, "adt"))
                response = await conn.exchange(batch_of(hl7_message("X-1"), broken, hl7_message("X-3")))
                acks = members_of(response)
                assert [(ack_code(a), msa2(a)) for a in acks] == [("AR", "X-1"), ("AE", "X-2"), ("AR", "X-3")]
                assert b"MSH-12 version id missing" in acks[1] and b"member 2 (MSH-10 X-2)" in acks[0]
                await until(lambda: audit_count(agent) == 1, what="the batch's audit row")
                assert live_rows(agent) == [], "nothing committed"
                # The fixed batch is then accepted whole: nothing of the refused one stands in the way.
                response = await conn.exchange(batch_of(hl7_message("X-1"), hl7_message("X-2"), hl7_message("X-3")))
                assert [ack_code(a) for a in members_of(response)] == ["AA", "AA", "AA"]
                assert [c for c, *_ in live_rows(agent)] == ["X-1", "X-2", "X-3"]
                await conn.close()
        run(scenario())

    def test_enhanced_mode_batch_ca_then_application_acks_relayed(self, tmp_path: Path) -> None:
        async def scenario() -> None:
            async with dev_server() as server, agent_running(
                    settings_for(tmp_path, url(server), [{"name": "adt"}])) as agent:
                conn = await MllpConn.open(port_of(agent, "adt"))
                batch = batch_of(*(hl7_message(f"E-{i}", msh15="AL", msh16="AL") for i in (1, 2)))
                response = await conn.exchange(batch)
                assert [(ack_code(a), msa2(a)) for a in members_of(response)] == [("CA", "E-1"), ("CA", "E-2")]
                relayed = [await conn.read_ack(20), await conn.read_ack(20)]
                assert [(ack_code(a), msa2(a)) for a in relayed] == [("AA", "E-1"), ("AA", "E-2")]
                await until(lambda: [r[0] for r in rows(agent, "SELECT ack_outcome FROM messages ORDER BY seq")]
                            == ["delivered", "delivered"], what="ack outcomes")
                assert [t.control_id for t in await delivered(server, 2)] == ["E-1", "E-2"]
                await conn.close()
        run(scenario())

    def test_application_channel_answers_the_batch_then_relays_each_application_ack(self, tmp_path: Path) -> None:
        """ack = "application": the ACK batch is not held; the server's answers follow one by one."""
        async def scenario() -> None:
            async with dev_server() as server, agent_running(
                    settings_for(tmp_path, url(server), [{"name": "adt", "ack": "application"}])) as agent:
                conn = await MllpConn.open(port_of(agent, "adt"))
                response = await conn.exchange(batch_of(hl7_message("P-1"), hl7_message("P-2")))
                assert [(ack_code(a), msa2(a)) for a in members_of(response)] == [("AA", "P-1"), ("AA", "P-2")]
                relayed = [await conn.read_ack(20), await conn.read_ack(20)]
                assert [msa2(a) for a in relayed] == ["P-1", "P-2"]
                assert all(a.startswith(b"MSH") for a in relayed), "each application ACK in its own frame"
                await conn.close()
        run(scenario())

    def test_batch_over_max_message_bytes_is_refused(self, tmp_path: Path) -> None:
        async def scenario() -> None:
            async with agent_running(settings_for(tmp_path, None, [{"name": "adt", "max_message_bytes": 1024}])) as agent:
                conn = await MllpConn.open(port_of(agent, "adt"))
                big = batch_of(*(hl7_message(f"L-{i}") for i in range(8)))
                assert len(big) > 1024
                response = await conn.exchange(big)
                acks = members_of(response)
                assert acks and {ack_code(a) for a in acks} == {"AE"}
                assert b"exceeds max_message_bytes 1024; nothing of it was accepted" in acks[0]
                assert msa2(await conn.exchange(hl7_message("AFTER"))) == "AFTER"
                assert [c for c, *_ in live_rows(agent)] == ["AFTER"]
                await conn.close()
        run(scenario())

    @pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
    def test_corpus_batch_samples_are_accepted_as_batches(self, tmp_path: Path, sample: Path) -> None:
        payload = sample.read_bytes()
        batch = split_batch(payload)
        assert batch is not None and batch.problem is None

        async def scenario() -> None:
            async with agent_running(settings_for(tmp_path, None, [{"name": "adt"}])) as agent:
                conn = await MllpConn.open(port_of(agent, "adt"))
                response = await conn.exchange(payload)
                acks = members_of(response)
                assert len(acks) == len(batch.members)
                assert {ack_code(a) for a in acks} <= {"AA", "CA"}
                assert [b for *_, b in live_rows(agent)] == list(batch.members), "each member a row, bytes as received"
                await conn.close()
        run(scenario())

    def test_mutated_batches_always_get_one_clean_answer(self, tmp_path: Path) -> None:
        """Damaged corpus batches: one ACK batch with one ACK per member, all accepted or all refused."""
        rng = random.Random(10)

        async def scenario() -> None:
            async with agent_running(settings_for(tmp_path, None, [{"name": "adt"}])) as agent:
                conn = await MllpConn.open(port_of(agent, "adt"))
                for n in range(60):
                    payload = mutate(rng, SAMPLES[n % len(SAMPLES)].read_bytes(), rng.randint(1, 4))
                    batch = split_batch(payload)
                    if batch is None or b"\x0b" in payload or b"\x1c" in payload:
                        continue
                    before = len(live_rows(agent))
                    response = await conn.exchange(payload)
                    answer = split_batch(response)
                    assert answer is not None and answer.problem is None, response
                    codes = [ack_code(a) for a in answer.members]
                    assert len(codes) == len(batch.members)
                    added = len(live_rows(agent)) - before
                    assert added <= sum(c in ("AA", "CA") for c in codes), "a row without an accept"
                    if any(b"batch refused" in a for a in answer.members):
                        assert added == 0, "a refused batch committed something"
                        assert not {"AA", "CA"} & set(codes)
                await conn.close()
        run(scenario())


def test_send_of_a_batch_file_sends_one_frame_and_prints_the_ack_batch(tmp_path: Path) -> None:
    """``hl7-agent send`` of a file starting with BHS: one batch frame, the ACK batch printed, exit 0."""
    sample = DATA / "batch_adt_a04_bhs_crlf.hl7"

    async def scenario() -> None:
        async with agent_running(settings_for(tmp_path, None, [{"name": "adt"}])) as agent:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "agent", "send", "--host", "127.0.0.1", "--port", str(port_of(agent, "adt")),
                str(sample), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            async with asyncio.timeout(30):
                out, err = await proc.communicate()
            assert proc.returncode == 0, err
            lines = out.decode().split("\n")
            assert [line[:3] for line in lines if line] == ["BHS", "MSH", "MSA", "MSH", "MSA", "BTS"]
            assert [c for c, *_ in live_rows(agent)] == ["EW88-1", "EW88-2"]
    run(scenario())

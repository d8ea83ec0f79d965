"""The server's reason kept with each row it answered, and log events that tell who rejected what.

The dispatcher in process (a real Agent, real MLLP, a real DevServer whose
``decide`` hook scripts the answers), as in tests/integration/test_dispatch.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agenttest import log_events, run_async, until
from structlog.testing import capture_logs

from agent.app.devserver import Answer, default_answer
from agent.core.protocol import Transmit
from agent.storage.store import SqliteStore
from tests.agenttest import db_rows, hl7_message
from tests.integration.test_dispatch import (
    ScriptedServer,
    agent_running,
    dev_server,
    port_of,
    send_all,
    settings_for,
    state_of,
    url,
)


def server_ack(control_id: str, code: str, text: str, *segments: str) -> str:
    return "\r".join(["MSH|^~\\&|EHR|CENTRAL|LAB|NORTH|20260101120001||ACK^A01^ACK|S1|P|2.5.1",
                      f"MSA|{code}|{control_id}|{text}", *segments]) + "\r"


def reason_of(db: Path, control_id: str) -> tuple[Any, ...]:
    (row,) = db_rows(db, "SELECT state, server_status, server_reason, error_code FROM messages "
                         "WHERE control_id = ? AND state <> 'nacked'", (control_id,))
    return row


class TestServerReasonStored:
    def test_a_4xx_keeps_the_servers_words_and_logs_rejected_by_server(self, tmp_path: Path) -> None:
        """A 422 with MSA-3 and ERR: the row is rejected with that text; the event says the server did it."""
        ack = server_ack("X1", "AE", "unknown patient identifier in PID-3",
                         "ERR|||204^Unknown key identifier^HL70357|E")
        script = ScriptedServer({"X1": [Answer(422, ack=ack)]})
        recent: list[Any] = []

        async def scenario() -> None:
            async with dev_server(script) as server:
                s = settings_for(tmp_path, url(server), [{"name": "adt"}])
                async with agent_running(s) as agent:
                    await send_all(port_of(agent, "adt"), [hl7_message("X1"), hl7_message("X2")])
                    await until(lambda: state_of(agent, "X2") == "processed", 10, "X2 processed")
                    assert agent.reader is not None
                    recent.extend(await agent.reader.call(SqliteStore.recent_failures, 5))

        with capture_logs() as logs:
            run_async(scenario())
        db = tmp_path / "data" / "queue.db"
        assert reason_of(db, "X1") == ("rejected", 422, "unknown patient identifier in PID-3", "422")
        assert reason_of(db, "X2")[2] is None  # a 2xx keeps no reason
        (failure,) = recent
        assert failure.server_reason == "unknown patient identifier in PID-3" and failure.server_status == 422
        (event,) = log_events(logs, "message_rejected_by_server")
        assert event["status"] == 422 and "reason" not in event  # the server's text may name a patient
        assert not log_events(logs, "message_rejected")  # that name is intake's
        assert len(log_events(logs, "message_processed")) == 1

    def test_a_retried_head_shows_why_and_keeps_it_when_given_up(self, tmp_path: Path) -> None:
        """503s with a reason: the queued head carries it while it retries, and the failed row after max_attempts."""
        ack = server_ack("F1", "AE", "database maintenance, try later")
        seen: list[tuple[Any, ...]] = []

        async def decide(t: Transmit) -> Answer:
            if t.control_id == "F1":
                if t.attempt == 2:
                    seen.append(reason_of(tmp_path / "data" / "queue.db", "F1"))
                return Answer(503, ack=ack)
            return default_answer(t)

        async def scenario() -> None:
            async with dev_server(decide) as server:
                s = settings_for(tmp_path, url(server), [{"name": "adt", "max_attempts": 2}])
                async with agent_running(s) as agent:
                    await send_all(port_of(agent, "adt"), [hl7_message("F1"), hl7_message("F2")])
                    await until(lambda: state_of(agent, "F2") == "processed", 10, "F2 processed")

        with capture_logs() as logs:
            run_async(scenario())
        # While it waited between its attempts (read by the server as attempt 2 came in):
        assert seen == [("inflight", 503, "database maintenance, try later", "503")]
        assert reason_of(tmp_path / "data" / "queue.db", "F1") == (
            "failed", 503, "database maintenance, try later", "503")
        (event,) = log_events(logs, "message_failed")
        assert event["error_code"] == "503"
        assert not log_events(logs, "message_rejected")

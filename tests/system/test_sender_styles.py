"""Senders that close their side early still get what they are owed (SPEC 4)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from agenttest import Daemon, ack_code, db_rows, free_port, hl7_message, msa2, toml_config, wait_for

from agent.core import mllp

pytestmark = pytest.mark.slow


def test_sender_that_half_closes_after_sending_still_reads_its_ack(tmp_path: Path) -> None:
    """send + shutdown(SHUT_WR) + read (nc -N style): the AA arrives; the outcome is recorded undelivered, never delivered."""
    port = free_port()
    daemon = Daemon(tmp_path, toml_config(tmp_path / "data", [{"name": "adt", "listen": f"127.0.0.1:{port}"}]))
    try:
        daemon.start().wait_started()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(mllp.encode_frame(hl7_message("HALF-CLOSE")))
            sock.shutdown(socket.SHUT_WR)
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        frames = [e.payload for e in mllp.MllpDecoder(1 << 20).feed(data) if isinstance(e, mllp.Frame)]
        assert len(frames) == 1
        assert (ack_code(frames[0]), msa2(frames[0])) == ("AA", "HALF-CLOSE")
        db = tmp_path / "data" / "queue.db"
        wait_for(lambda: db_rows(db, "SELECT ack_outcome FROM messages")[0][0] != "pending", 10,
                 what="the ack outcome recorded")
        assert db_rows(db, "SELECT state, ack_outcome FROM messages") == [("queued", "undelivered")]
    finally:
        assert daemon.stop() == 0

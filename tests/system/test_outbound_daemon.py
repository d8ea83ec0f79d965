"""Outbound channels with the daemon as a subprocess: a graceful stop, and an upgrade overlap.

The sender is a real MLLP server on 127.0.0.1 (threads, blocking sockets)
that keeps every connection the agents make and pushes on whichever one the
test names, reading the ACK back, as such systems do.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest
from agenttest import Daemon, ack_code, db_rows, hl7_message, msa2, toml_config, wait_for

from agent.core import mllp

pytestmark = pytest.mark.slow


class Sender:
    """An MLLP server that keeps every agent's connection; ``push`` sends on one and reads the ACK."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.conns: list[socket.socket] = []
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.settimeout(10)
            self.conns.append(conn)

    def push(self, index: int, message: bytes) -> bytes:
        conn = self.conns[index]
        conn.sendall(mllp.encode_frame(message))
        decoder = mllp.MllpDecoder(1 << 20)
        while True:
            data = conn.recv(65536)
            if not data:
                raise ConnectionError("the agent closed the connection")
            frames = [e.payload for e in decoder.feed(data) if isinstance(e, mllp.Frame)]
            if frames:
                return frames[0]

    def closed_by_agent(self, index: int) -> bool:
        """The agent closed this connection cleanly (EOF, not a reset)."""
        try:
            return self.conns[index].recv(1) == b""
        except OSError:
            return False

    def close(self) -> None:
        self._stop = True
        self.sock.close()
        for conn in self.conns:
            conn.close()


def config(tmp_path: Path, port: int, agent_id: str = "outbound-daemon") -> str:
    return toml_config(tmp_path / "data", [{"name": "ref", "connect": f"127.0.0.1:{port}",
                                            "reconnect_initial": 0.1, "reconnect_cap": 1}], agent_id=agent_id)


def live_control_ids(tmp_path: Path) -> list[str]:
    return [str(r[0]) for r in db_rows(tmp_path / "data" / "queue.db",
                                       "SELECT control_id FROM messages WHERE state <> 'nacked' ORDER BY seq")]


def test_stop_closes_the_outbound_connection_cleanly(tmp_path: Path) -> None:
    sender = Sender()
    daemon = Daemon(tmp_path, config(tmp_path, sender.port)).start()
    try:
        daemon.wait_started()
        wait_for(lambda: sender.conns, what="the agent dialled")
        for i in range(5):
            assert msa2(sender.push(0, hl7_message(f"D-{i}"))) == f"D-{i}"
        assert daemon.stop() == 0
        assert sender.closed_by_agent(0), "FIN after the last ACK, not a reset"
        assert live_control_ids(tmp_path) == [f"D-{i}" for i in range(5)]
        assert daemon.has_event("outbound_connected")
    finally:
        daemon.stop()
        sender.close()


def test_upgrade_overlap_each_process_dials_its_own_connection(tmp_path: Path) -> None:
    """Old and new process both connected for a moment: messages on either are kept once; the old one leaves cleanly."""
    sender = Sender()
    old = Daemon(tmp_path, config(tmp_path, sender.port), name="old").start()
    new = None
    try:
        old.wait_started()
        wait_for(lambda: len(sender.conns) == 1, what="the old process dialled")
        assert ack_code(sender.push(0, hl7_message("O-1"))) == "AA"
        new = Daemon(tmp_path, config(tmp_path, sender.port), name="new").start()
        new.wait_started()
        wait_for(lambda: len(sender.conns) == 2, what="the new process dialled too")
        first = sender.push(0, hl7_message("BOTH"))
        again = sender.push(1, hl7_message("BOTH"))  # the same message, pushed to the other process
        assert first == again, "the second copy is answered from dedupe, byte for byte"
        assert old.stop() == 0
        assert sender.closed_by_agent(0)
        assert ack_code(sender.push(1, hl7_message("N-1"))) == "AA"
        assert live_control_ids(tmp_path) == ["O-1", "BOTH", "N-1"]
    finally:
        old.stop()
        if new is not None:
            new.stop()
        sender.close()

"""Application ACKs across an upgrade overlap: what a sender is owed travels with its connection.

Two daemons on one data_dir (as in test_overlap.py), a dev server that takes
a few seconds per answer, and senders that wait for the server's ACK: the old
process, on SIGTERM, hands each connection to its successor together with the
application ACKs it still owes, or — with no successor to take them — answers
AR "resend later" for each before closing. Never silence.
"""

from __future__ import annotations

import signal
import ssl
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from agenttest import (
    Answer,
    Daemon,
    DevServerThread,
    MllpClient,
    ack_code,
    db_rows,
    err3,
    free_port,
    hl7_message,
    make_test_pki,
    msa2,
    toml_config,
    wait_for,
)

from agent.app.devserver import default_answer

pytestmark = pytest.mark.slow

SLOW_ANSWER = 4.0  # seconds the server takes per answer while ``slow`` is set
SENDERS = 5


@dataclass
class Received:
    """What one sender read on its one connection, in order, and how the reading ended."""

    acks: list[tuple[str, str, str]] = field(default_factory=list)  # (MSA-1, MSA-2, ERR-3)
    ended: str = ""  # "" while reading; "eof", "reset", "timeout" ...


def slow_server(slow: threading.Event) -> DevServerThread:
    async def decide(t: Any) -> Answer:
        answer = default_answer(t)
        return Answer(answer.status, answer.ack, delay=SLOW_ANSWER if slow.is_set() else 0)

    return DevServerThread(decide=decide).start()


def read_acks(client: MllpClient, into: Received, count: int, timeout: float) -> threading.Thread:
    """Read ``count`` ACK frames on a thread, recording each, until the deadline."""

    def run() -> None:
        deadline = time.monotonic() + timeout
        try:
            while len(into.acks) < count:
                ack = client.read_ack(timeout=max(0.1, deadline - time.monotonic()))
                into.acks.append((ack_code(ack), msa2(ack), err3(ack)))
            into.ended = "done"
        except TimeoutError:
            into.ended = "timeout"
        except ConnectionError as exc:
            into.ended = "eof" if "closed" in str(exc) else f"reset: {exc}"
        except OSError as exc:
            into.ended = f"error: {exc}"

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def pair(tmp_path: Path, port: int, dev: DevServerThread, **channel: object) -> tuple[Daemon, Daemon]:
    config = toml_config(tmp_path / "data", [{"name": "adt", "listen": f"127.0.0.1:{port}", **channel}],
                         server_url=dev.url, admin_port=free_port())
    env = {"HL7_AGENT_SERVER__APPLICATION_ACK_TIMEOUT": "60"}
    old = Daemon(tmp_path, config, name="old", env=env)
    new = Daemon(tmp_path, config, name="new", env={**env, "HL7_AGENT_ADMIN__LISTEN": f"127.0.0.1:{free_port()}"})
    return old, new


def outcomes(tmp_path: Path) -> dict[str, str]:
    return dict(db_rows(tmp_path / "data" / "queue.db",
                        "SELECT control_id, ack_outcome FROM messages WHERE seq IS NOT NULL"))


def committed(tmp_path: Path) -> int:
    return int(db_rows(tmp_path / "data" / "queue.db", "SELECT count(*) FROM messages WHERE seq IS NOT NULL")[0][0])


def test_application_ack_senders_get_the_servers_ack_from_the_successor(tmp_path: Path) -> None:
    """ack = "application", a server taking 4 s per answer, five senders (one pipelining), SIGTERM to the old process beside a successor.

    Every sender gets the server's AA for each of its messages, in arrival
    order (a reject between them included), on the connection it opened
    before the upgrade — none is cut off, none gets AR — and every row ends
    ``ack_outcome = delivered``.
    """
    slow = threading.Event()
    slow.set()
    dev = slow_server(slow)
    port = free_port()
    old, new = pair(tmp_path, port, dev, ack="application")
    clients: list[MllpClient] = []
    try:
        old.start().wait_started()
        clients = [MllpClient(port, timeout=90) for _ in range(SENDERS)]
        # Sender 0 pipelines three frames before its first ACK: two messages and,
        # between them, one with no MSH-9 (rejected AE at once, but written in order).
        expected: list[list[tuple[str, str]]] = [
            [("AA", "APP0-0"), ("AE", "APP0-BAD"), ("AA", "APP0-1")],
            *[[("AA", f"APP{i}-0")] for i in range(1, SENDERS)],
        ]
        for client, wanted in zip(clients, expected, strict=True):
            for code, cid in wanted:
                message = hl7_message(cid)
                client.send(message if code == "AA" else message.replace(b"ADT^A01^ADT_A01", b""))
        wait_for(lambda: committed(tmp_path) == SENDERS + 1, 20, what="every message committed in the old process")
        results = [Received() for _ in clients]
        readers = [read_acks(c, r, len(e), 90) for c, r, e in zip(clients, results, expected, strict=True)]

        new.start().wait_started()
        assert new.has_event("listeners_received_by_handover"), new.log_tail()
        old.signal(signal.SIGTERM)
        assert old.wait_exit(20) == 0, old.log_tail()
        assert not old.has_event("connections_aborted_at_budget"), old.log_tail()

        for reader in readers:
            reader.join(90)
        got = [[(code, cid) for code, cid, _ in r.acks] for r in results]
        assert got == expected, ([r.ended for r in results], old.log_tail(), new.log_tail())
        assert new.has_event("connection_adopted"), new.log_tail()

        # The adopted connections go on serving.
        slow.clear()
        for i, client in enumerate(clients):
            ack = client.exchange(hl7_message(f"AFTER{i}"), timeout=30)
            assert (ack_code(ack), msa2(ack)) == ("AA", f"AFTER{i}")
        wait_for(lambda: set(outcomes(tmp_path).values()) == {"delivered"}, 10,
                 what="every row recorded as delivered")
    finally:
        for client in clients:
            client.close()
        old.stop()
        new.stop()
        dev.stop()


def test_application_ack_senders_get_ar_before_a_plain_stop_closes(tmp_path: Path) -> None:
    """ack = "application", a slow server, SIGTERM with no successor: each sender gets the server's AA or AR 207 "resend later" before the close — never silence.

    The AR'd rows stay in the queue, and a retransmit to the next process gets
    the real ACK.
    """
    slow = threading.Event()
    slow.set()
    dev = slow_server(slow)
    port = free_port()
    old, new = pair(tmp_path, port, dev, ack="application")
    clients: list[MllpClient] = []
    try:
        old.start().wait_started()
        clients = [MllpClient(port, timeout=60) for _ in range(SENDERS)]
        for i, client in enumerate(clients):
            client.send(hl7_message(f"STOP{i}"))
        wait_for(lambda: committed(tmp_path) == SENDERS, 20, what="every message committed")
        results = [Received() for _ in clients]
        readers = [read_acks(c, r, 2, 40) for c, r in zip(clients, results, strict=True)]
        started = time.monotonic()
        old.signal(signal.SIGTERM)
        assert old.wait_exit(20) == 0, old.log_tail()
        assert time.monotonic() - started < 10 + 2
        for reader in readers:
            reader.join(40)
        for i, r in enumerate(results):
            # One ACK, then the agent closes the connection (EOF, not a reset).
            assert len(r.acks) == 1 and r.ended == "eof", (i, r, old.log_tail())
            code, cid, error = r.acks[0]
            assert cid == f"STOP{i}"
            assert (code, error) in {("AA", ""), ("AR", "207")}, r.acks
        refused = [f"STOP{i}" for i, r in enumerate(results) if r.acks[0][0] == "AR"]
        assert refused, "the slow server answered everything within the budget: the test proves nothing"
        assert committed(tmp_path) == SENDERS  # nothing lost
        assert all(outcomes(tmp_path)[cid] == "undelivered" for cid in refused)

        # A retransmit to the next process gets the server's real ACK.
        slow.clear()
        new.start().wait_started()
        with MllpClient(port, timeout=30) as client:
            ack = client.exchange(hl7_message(refused[-1]))
            assert (ack_code(ack), msa2(ack)) == ("AA", refused[-1])
    finally:
        for client in clients:
            client.close()
        old.stop()
        new.stop()
        dev.stop()


def test_enhanced_mode_application_acks_follow_the_connection_to_the_successor(tmp_path: Path) -> None:
    """Enhanced mode (MSH-15 AL, MSH-16 AL), a slow server, SIGTERM beside a successor: each sender got its CA from the old process and gets the server's application ACK from the successor, on the same connection; every row ends ``delivered``."""
    slow = threading.Event()
    slow.set()
    dev = slow_server(slow)
    port = free_port()
    old, new = pair(tmp_path, port, dev)
    clients: list[MllpClient] = []
    try:
        old.start().wait_started()
        clients = [MllpClient(port, timeout=60) for _ in range(SENDERS)]
        for i, client in enumerate(clients):
            ack = client.exchange(hl7_message(f"ENH{i}", msh15="AL", msh16="AL"))
            assert (ack_code(ack), msa2(ack)) == ("CA", f"ENH{i}")
        results = [Received() for _ in clients]
        readers = [read_acks(c, r, 1, 60) for c, r in zip(clients, results, strict=True)]

        new.start().wait_started()
        old.signal(signal.SIGTERM)
        assert old.wait_exit(20) == 0, old.log_tail()
        for reader in readers:
            reader.join(60)
        got = [[(code, cid) for code, cid, _ in r.acks] for r in results]
        assert got == [[("AA", f"ENH{i}")] for i in range(SENDERS)], (
            [r.ended for r in results], old.log_tail(), new.log_tail())
        assert new.has_event("connection_adopted"), new.log_tail()
        wait_for(lambda: set(outcomes(tmp_path).values()) == {"delivered"}, 10,
                 what="every row recorded as delivered")
    finally:
        for client in clients:
            client.close()
        old.stop()
        new.stop()
        dev.stop()


class TlsClient(MllpClient):
    def __init__(self, port: int, ca: Path, timeout: float) -> None:
        super().__init__(port, timeout=timeout)
        self.sock = ssl.create_default_context(cafile=str(ca)).wrap_socket(self.sock, server_hostname="127.0.0.1")


def test_tls_application_ack_senders_get_ar_before_the_close_even_beside_a_successor(tmp_path: Path) -> None:
    """A TLS channel cannot hand connections over (the TLS state lives in the process): with a successor running, each waiting sender still gets the server's AA or AR 207 before the close, never silence."""
    pki = make_test_pki(tmp_path)
    slow = threading.Event()
    slow.set()
    dev = slow_server(slow)
    port = free_port()
    old, new = pair(tmp_path, port, dev, ack="application", tls_cert=str(pki / "server.pem"),
                    tls_key=str(pki / "server.key"))
    clients: list[MllpClient] = []
    try:
        old.start().wait_started()
        clients = [TlsClient(port, pki / "ca.pem", timeout=60) for _ in range(SENDERS)]
        for i, client in enumerate(clients):
            client.send(hl7_message(f"TLS{i}"))
        wait_for(lambda: committed(tmp_path) == SENDERS, 20, what="every message committed")
        results = [Received() for _ in clients]
        readers = [read_acks(c, r, 2, 40) for c, r in zip(clients, results, strict=True)]
        new.start().wait_started()
        old.signal(signal.SIGTERM)
        assert old.wait_exit(20) == 0, old.log_tail()
        for reader in readers:
            reader.join(40)
        for i, r in enumerate(results):
            assert len(r.acks) == 1 and r.ended != "timeout", (i, r, old.log_tail())
            code, cid, error = r.acks[0]
            assert cid == f"TLS{i}"
            assert (code, error) in {("AA", ""), ("AR", "207")}, r.acks
        assert any(r.acks[0][0] == "AR" for r in results), "the slow server answered everything: the test proves nothing"
        assert not old.has_event("connection_handed_over")
    finally:
        for client in clients:
            client.close()
        old.stop()
        new.stop()
        dev.stop()

"""Zero-downtime upgrade overlap: two daemons, one database, one set of listening sockets (SPEC 7)."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from agenttest import (
    Daemon,
    DevServerThread,
    MllpClient,
    ack_code,
    db_rows,
    free_port,
    hl7_message,
    msa2,
    toml_config,
    wait_for,
)

from agent.core import mllp

pytestmark = pytest.mark.slow


@dataclass
class SenderStats:
    acked: list[str] = field(default_factory=list)
    non_accept: list[tuple[str, str]] = field(default_factory=list)
    refused: int = 0
    resent_after_close: int = 0
    reconnects: int = 0
    errors: list[str] = field(default_factory=list)


class Sender(threading.Thread):
    """A sender that reconnects when the agent closes its connection, as real MLLP clients do.

    A message whose ACK did not arrive because the connection closed is sent
    again, identical, on the next connection (the agent's dedupe answers it).
    """

    def __init__(self, name: str, port: int, stop: threading.Event, max_messages: int) -> None:
        super().__init__(name=name, daemon=True)
        self.tag = name
        self.port = port
        self.stop_event = stop
        self.max_messages = max_messages
        self.stats = SenderStats()

    def _connect(self) -> MllpClient | None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                return MllpClient(self.port, timeout=10)
            except ConnectionRefusedError:
                self.stats.refused += 1
            except OSError as exc:
                if exc.errno != errno.ECONNREFUSED:
                    self.stats.errors.append(f"connect: {exc}")
                    return None
                self.stats.refused += 1
            time.sleep(0.01)  # a refused connect is a test failure; this only bounds the loop
        return None

    def run(self) -> None:
        client = self._connect()
        n = 0
        while client is not None and n < self.max_messages and not self.stop_event.is_set():
            control_id = f"{self.tag}-{n:05d}"
            message = hl7_message(control_id, sending_app=self.tag.upper())
            for _try in range(5):
                try:
                    ack = client.exchange(message, timeout=15)
                    break
                except (ConnectionError, OSError):
                    # Closed by the agent (upgrade): reconnect and resend the same bytes.
                    client.close()
                    self.stats.resent_after_close += 1
                    self.stats.reconnects += 1
                    client = self._connect()
                    if client is None:
                        return
            else:
                self.stats.errors.append(f"{control_id}: no ACK after 5 connections")
                return
            code = ack_code(ack)
            if code == "AA" and msa2(ack) == control_id:
                self.stats.acked.append(control_id)
            else:
                self.stats.non_accept.append((control_id, code))
            n += 1
        if client is not None:
            client.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_overlap_refuses_nothing_and_delivers_everything_once_in_order(
    tmp_path: Path, backend: str, request: pytest.FixtureRequest
) -> None:
    """Start a second daemon on the same config and database, SIGTERM the first under load: nothing is refused, lost, duplicated or reordered, and no connection even drops."""
    pg = request.getfixturevalue("pg_database") if backend == "postgresql" else None
    dev = DevServerThread().start()
    ports = {"adt": free_port(), "lab": free_port()}
    channels = [{"name": name, "listen": f"127.0.0.1:{port}"} for name, port in ports.items()]
    config = toml_config(tmp_path / "data", channels, server_url=dev.url, admin_port=free_port(),
                         extra=pg.queue_toml(tmp_path) if pg is not None else "")
    old = Daemon(tmp_path, config, name="old")
    new = Daemon(tmp_path, config, name="new",
                 env={"HL7_AGENT_ADMIN__LISTEN": f"127.0.0.1:{free_port()}"})
    stop = threading.Event()
    # The cap only bounds the test: the senders run until ``stop``. 400 each (the old cap) was
    # all sent within a second on a fast run, before the upgrade began, and the load after it
    # never came.
    senders = [Sender(f"s{i}", ports["adt" if i % 2 == 0 else "lab"], stop, 5000) for i in range(4)]
    try:
        old.start().wait_started()
        for s in senders:
            s.start()
        wait_for(lambda: sum(len(s.stats.acked) for s in senders) >= 60, 20, what="load before upgrade")

        new.start().wait_started()
        assert new.has_event("listeners_received_by_handover"), new.log_tail()
        before_stop = sum(len(s.stats.acked) for s in senders)

        stopped_at = time.monotonic()
        old.signal(signal.SIGTERM)
        assert old.wait_exit(timeout=20) == 0, old.log_tail()
        stop_seconds = time.monotonic() - stopped_at
        assert stop_seconds < 10 + 2, f"old process took {stop_seconds:.1f}s (budget 10s)"

        # The new process keeps serving the reconnected senders and takes the lease.
        wait_for(lambda: sum(len(s.stats.acked) for s in senders) >= before_stop + 60, 20,
                 what="load after the old process exited")
        new.wait_event("lease_acquired", timeout=10)
    finally:
        stop.set()
        for s in senders:
            s.join(30)
        try:
            acked = {cid for s in senders for cid in s.stats.acked}
            if acked and new.proc is not None and new.proc.poll() is None:
                wait_for(lambda: acked <= {t.control_id for t in list(dev.server.received)}, 30,
                         what="every accepted message delivered")
        finally:
            for daemon in (old, new):
                daemon.stop()
            dev.stop()

    stats = [s.stats for s in senders]
    assert all(not st.errors for st in stats), [st.errors for st in stats]
    assert sum(st.refused for st in stats) == 0, "a sender saw a refused connection"
    # Live connections are handed to the new process with the bytes in flight:
    # no sender even sees its connection end, so no ACK can be lost.
    assert [st.reconnects for st in stats] == [0] * len(stats), "a sender lost its connection"
    assert new.has_event("connection_adopted"), new.log_tail()
    assert [x for st in stats for x in st.non_accept] == [], "a sender got a non-accept ACK"
    assert old.has_event("lease_released"), old.log_tail()

    # Exactly once in effect: one id per control id, one 2xx answer per id.
    received = list(dev.server.received)
    ids_by_control: dict[str, set[str]] = defaultdict(set)
    for t in received:
        ids_by_control[t.control_id].add(t.id)
    acked = [cid for st in stats for cid in st.acked]
    assert len(acked) == len(set(acked))
    for cid in acked:
        assert len(ids_by_control[cid]) == 1, f"{cid} reached the server under several ids"
    assert set(dev.server.answered) >= {next(iter(ids_by_control[c])) for c in acked}

    # Per-channel order: each channel's transmits arrive in seq order, and
    # each sender's messages in the order it sent them.
    first_seen: dict[str, list[int]] = defaultdict(list)
    seen_ids: set[str] = set()
    for t in received:
        if t.id not in seen_ids:
            seen_ids.add(t.id)
            first_seen[t.channel].append(t.seq)
    for channel, seqs in first_seen.items():
        assert seqs == sorted(seqs), f"channel {channel} delivered out of order"
    position = {t.control_id: i for i, t in reversed(list(enumerate(received)))}
    for st in stats:
        order = [position[c] for c in st.acked]
        assert order == sorted(order), "a sender's messages reached the server out of order"

    # Nothing accepted is missing from the database, and nothing is left undelivered.
    counted = "SELECT state, count(*) FROM messages WHERE seq IS NOT NULL GROUP BY state"
    rows = dict(pg.rows(counted) if pg is not None else db_rows(tmp_path / "data" / "queue.db", counted))
    assert rows == {"processed": len(acked)}


def test_handover_socket_is_private(tmp_path: Path) -> None:
    """The handover socket in the data directory is 0600, like the database."""
    port = free_port()
    daemon = Daemon(tmp_path, toml_config(tmp_path / "data", [{"name": "adt", "listen": f"127.0.0.1:{port}"}]))
    try:
        daemon.start().wait_started()
        mode = os.stat(tmp_path / "data" / "handover.sock").st_mode & 0o777
        assert mode == 0o600
        assert os.stat(tmp_path / "data" / "queue.db").st_mode & 0o777 == 0o600
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        assert daemon.stop() == 0


def test_successor_without_its_own_admin_address_still_takes_over(tmp_path: Path) -> None:
    """A second version started with the same admin address logs the clash and still serves intake after the first stops."""
    port = free_port()
    config = toml_config(tmp_path / "data", [{"name": "adt", "listen": f"127.0.0.1:{port}"}],
                         admin_port=free_port())
    old = Daemon(tmp_path, config, name="old")
    new = Daemon(tmp_path, config, name="new")
    try:
        old.start().wait_started()
        new.start().wait_started()
        assert new.has_event("admin_unavailable"), new.log_tail()
        assert old.stop() == 0
        with MllpClient(port) as client:
            assert ack_code(client.exchange(hl7_message("AFTER"))) == "AA"
    finally:
        old.stop()
        assert new.stop() == 0


def test_a_third_process_starts_after_the_newer_one_of_an_overlap_was_killed(tmp_path: Path) -> None:
    """kill -9 of the newer process leaves its dead handover socket: the next one still gets the listeners.

    The older process still holds the port, so binding fails; it serves its
    listeners again (within its second's recheck) and the third takes them
    from it, started at once after the kill, as a service manager restarts.
    """
    port = free_port()
    config = toml_config(tmp_path / "data", [{"name": "adt", "listen": f"127.0.0.1:{port}"}],
                         admin_port=free_port())
    old = Daemon(tmp_path, config, name="old")
    new = Daemon(tmp_path, config, name="new", env={"HL7_AGENT_ADMIN__LISTEN": f"127.0.0.1:{free_port()}"})
    third = Daemon(tmp_path, config, name="third", env={"HL7_AGENT_ADMIN__LISTEN": f"127.0.0.1:{free_port()}"})
    try:
        old.start().wait_started()
        new.start().wait_started()
        assert new.has_event("listeners_inherited", source="handover"), new.log_tail()
        new.kill()
        third.start().wait_started()
        assert third.has_event("listeners_received_by_handover"), third.log_tail()
        assert old.has_event("handover_server_republished"), old.log_tail()
        assert old.stop() == 0
        with MllpClient(port) as client:
            assert ack_code(client.exchange(hl7_message("AFTER-KILL"))) == "AA"
    finally:
        new.kill()
        old.stop()
        assert third.stop() == 0


def test_a_listen_address_changed_in_the_new_version_is_bound_not_inherited(tmp_path: Path) -> None:
    """The predecessor's listener for a channel whose listen changed is not taken: the new address is served."""
    old_port, new_port = free_port(), free_port()
    old = Daemon(tmp_path, toml_config(tmp_path / "data", [{"name": "adt", "listen": f"127.0.0.1:{old_port}"}],
                                       admin_port=free_port()), name="old")
    new = Daemon(tmp_path, toml_config(tmp_path / "data", [{"name": "adt", "listen": f"127.0.0.1:{new_port}"}],
                                       admin_port=free_port()), name="new")
    try:
        old.start().wait_started()
        new.start().wait_started()
        assert new.has_event("handed_listener_not_used", channel="adt"), new.log_tail()
        assert not new.has_event("listeners_received_by_handover"), new.log_tail()
        for port in (old_port, new_port):  # the old version keeps its address until it stops
            with MllpClient(port) as client:
                assert ack_code(client.exchange(hl7_message(f"P{port}"))) == "AA"
        assert old.stop() == 0
        with MllpClient(new_port) as client:
            assert ack_code(client.exchange(hl7_message("AFTER"))) == "AA"
    finally:
        old.stop()
        assert new.stop() == 0


def test_pipelining_sender_keeps_every_ack_across_the_overlap(tmp_path: Path) -> None:
    """A sender that writes frames back to back, without waiting, gets one AA per frame, in order, across an upgrade."""
    port = free_port()
    config = toml_config(tmp_path / "data", [{"name": "adt", "listen": f"127.0.0.1:{port}"}],
                         admin_port=free_port())
    old = Daemon(tmp_path, config, name="old")
    new = Daemon(tmp_path, config, name="new", env={"HL7_AGENT_ADMIN__LISTEN": f"127.0.0.1:{free_port()}"})
    total = 3000
    acks: list[tuple[str, str]] = []
    eof = threading.Event()
    try:
        old.start().wait_started()
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)

        def write() -> None:
            with contextlib.suppress(OSError):
                for n in range(total):
                    sock.sendall(mllp.encode_frame(hl7_message(f"P-{n:06d}")))

        def read() -> None:
            decoder = mllp.MllpDecoder(1 << 20)
            with contextlib.suppress(OSError):
                while len(acks) < total:
                    data = sock.recv(65536)
                    if not data:
                        break
                    acks.extend((msa2(e.payload), ack_code(e.payload))
                                for e in decoder.feed(data) if isinstance(e, mllp.Frame))
            eof.set()

        threads = [threading.Thread(target=write, daemon=True), threading.Thread(target=read, daemon=True)]
        for thread in threads:
            thread.start()
        wait_for(lambda: len(acks) >= 300, 30, what="acks before the upgrade")
        new.start().wait_started()
        assert new.has_event("listeners_received_by_handover"), new.log_tail()
        old.signal(signal.SIGTERM)
        assert old.wait_exit(20) == 0, old.log_tail()
        wait_for(lambda: eof.is_set(), 60, what="all acks")
        for thread in threads:
            thread.join(10)
        sock.close()
    finally:
        old.stop()
        new.stop()
    assert len(acks) == total, f"{total - len(acks)} frames got no ACK"
    assert [cid for cid, _ in acks] == [f"P-{n:06d}" for n in range(total)]
    assert {code for _, code in acks} == {"AA"}


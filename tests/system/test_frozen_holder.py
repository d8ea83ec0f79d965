"""A lease holder frozen between its ``inflight`` commit and its WebSocket write never gets a stale frame through.

Two daemons on one data_dir (an upgrade overlap). The holder stops (a real
SIGSTOP, as in a VM pause) right after it committed a row ``inflight`` and
before it wrote the frame; the standby takes over after the TTL, resends that
row and delivers the next ones; then the old holder gets SIGCONT. The epoch
in the database fences its writes there, but not on the wire: two fences
stop its frame — its own check that its lease is still valid by its own
clock, and the server's refusal of a session below the highest epoch it has
seen. Each fence is shown alone, and both together as shipped; a control run
with both switched off shows the scenario really reaches the window.

The stop is placed by tests/faults/sitecustomize.py (the process stops
itself at that point: an outside SIGSTOP cannot hit a window this narrow
reliably). Everything else is real: processes, sockets, SQLite, the server.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections import defaultdict
from pathlib import Path

import pytest
from agenttest import (
    REPO_ROOT,
    Daemon,
    DevServerThread,
    MllpClient,
    ack_code,
    db_rows,
    free_port,
    hl7_message,
    toml_config,
    wait_for,
)

from agent.app.devserver import Arrival

pytestmark = pytest.mark.slow

FAULTS = str(REPO_ROOT / "tests" / "faults")
FROZEN_AT = "F03"


def proc_state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rfind(")") + 2]


def send(port: int, control_id: str) -> None:
    """One message on a new connection (a connection the frozen process accepted would hang)."""
    with MllpClient(port, timeout=15) as client:
        assert ack_code(client.exchange(hl7_message(control_id))) == "AA"


def answered(dev: DevServerThread) -> set[str]:
    """Control ids the server has answered 2xx."""
    done = set(dev.server.answered)
    return {t.control_id for t in list(dev.server.received) if t.id in done}


def epoch_of(daemon: Daemon) -> int:
    epochs = [e["epoch"] for e in daemon.events() if e.get("event") == "lease_acquired"]
    assert epochs, daemon.log_tail()
    return int(epochs[-1])


def transmits(timeline: list[Arrival], **match: object) -> list[Arrival]:
    return [a for a in timeline if a.kind == "transmit"
            and all(getattr(a, k) == v for k, v in match.items())]


def settled_states(db_path: Path, timeout: float = 15.0) -> dict[str, str]:
    """Each row's state once none is queued, claimed or inflight (or at the deadline: the assertions show which)."""

    def read() -> dict[str, str]:
        return dict(db_rows(db_path, "SELECT control_id, state FROM messages WHERE seq IS NOT NULL"))

    live = ("queued", "claimed", "inflight")
    with contextlib.suppress(AssertionError):
        wait_for(lambda: not any(state in live for state in read().values()), timeout,
                 what="every row settled")
    return read()


def frozen_holder_scenario(tmp_path: Path, *, server_fence: bool, agent_guard: bool) -> dict[str, object]:
    """Run the freeze; return what the server saw, who held which epoch, and the rows' states."""
    dev = DevServerThread(track_epochs=server_fence).start()
    port = free_port()
    config = toml_config(tmp_path / "data", [{"name": "adt", "listen": f"127.0.0.1:{port}"}],
                         server_url=dev.url)
    # A short TTL keeps the test short; the rule is the same at 30 s.
    config = config.replace("lease_ttl = 6", "lease_ttl = 4").replace("lease_heartbeat = 2", "lease_heartbeat = 1")
    env = {"PYTHONPATH": FAULTS, "HL7TEST_FREEZE_BEFORE_TRANSMIT": FROZEN_AT}
    if not agent_guard:
        env["HL7TEST_NO_WRITE_GUARD"] = "1"
    old = Daemon(tmp_path, config, name="old", env=env)
    new = Daemon(tmp_path, config, name="new")
    try:
        old.start().wait_started()
        old.wait_event("lease_acquired")
        new.start().wait_started()
        assert new.has_event("listeners_received_by_handover"), new.log_tail()

        for cid in ("F01", "F02", FROZEN_AT):
            send(port, cid)
        wait_for(lambda: proc_state(old.pid) == "T", 15, what="the holder to stop before its write")
        # F03 is inflight, its frame unwritten, its holder stopped.
        new.wait_event("lease_acquired", timeout=30)
        wait_for(lambda: any(a.transmit.control_id == FROZEN_AT for a in transmits(dev.server.timeline)
                             if a.transmit is not None), 15, what="the successor's resend of F03")
        for cid in ("F04", "F05"):
            send(port, cid)
        wait_for(lambda: {"F04", "F05"} <= answered(dev), 15, what="F04 and F05 answered")

        os.kill(old.pid, signal.SIGCONT)
        # Once the old process ended its tenure (lease lost, or its epoch refused)
        # it has closed its session; when the server has seen that session end,
        # every frame it wrote has been read.
        wait_for(lambda: old.has_event("lease_lost") or old.has_event("dispatch_paused_epoch_refused"),
                 20, what="the old holder to end its tenure")
        wait_for(lambda: dev.server.active_sessions == 1, 20, what="the old session to end")

        # The server has answered F05; the successor commits that settle a
        # moment later (on a loaded machine, after the old session is gone).
        states = settled_states(tmp_path / "data" / "queue.db")
        return {
            "timeline": list(dev.server.timeline),
            "old_epoch": epoch_of(old) if old.has_event("lease_acquired") else None,
            "new_epoch": epoch_of(new),
            "states": states,
            "old": old,
        }
    finally:
        if old.proc is not None and old.proc.poll() is None:
            os.kill(old.pid, signal.SIGCONT)
        for daemon in (new, old):
            daemon.stop()
        dev.stop()


def stale_transmits(result: dict[str, object]) -> list[Arrival]:
    """Transmits the server took from the old holder's session after the successor's session said hello."""
    timeline = result["timeline"]
    assert isinstance(timeline, list)
    sent = transmits(timeline)
    old_session = next(a.session for a in sent if a.transmit is not None and a.transmit.control_id == "F01")
    new_session = next(a.session for a in sent if a.transmit is not None and a.transmit.control_id == "F04")
    assert new_session != old_session
    new_hello = next(i for i, a in enumerate(timeline) if a.kind == "hello" and a.session == new_session)
    return [a for a in timeline[new_hello:] if a.kind == "transmit" and a.session == old_session]


def assert_fenced(result: dict[str, object]) -> None:
    timeline = result["timeline"]
    assert isinstance(timeline, list)
    assert result["old_epoch"] is not None and result["new_epoch"] > result["old_epoch"]  # type: ignore[operator]
    assert stale_transmits(result) == []
    # Never an older seq after a newer one on the channel.
    seqs: dict[str, list[int]] = defaultdict(list)
    for a in transmits(timeline):
        assert a.transmit is not None
        seqs[a.transmit.channel].append(a.transmit.seq)
    for channel, order in seqs.items():
        assert order == sorted(order), f"channel {channel}: seq went back: {order}"
    # Nothing lost: every accepted message processed, each reached the server.
    assert result["states"] == {f"F0{i}": "processed" for i in range(1, 6)}
    assert {a.transmit.control_id for a in transmits(timeline) if a.transmit} == {f"F0{i}" for i in range(1, 6)}


class TestFrozenHolder:
    def test_both_fences_as_shipped(self, tmp_path: Path) -> None:
        """Agent check and server epochs on: the frozen holder's frame never reaches the server; nothing lost, no seq goes back."""
        result = frozen_holder_scenario(tmp_path, server_fence=True, agent_guard=True)
        assert_fenced(result)
        old = result["old"]
        assert isinstance(old, Daemon)
        assert old.has_event("lease_validity_lapsed"), old.log_tail()

    def test_the_agents_own_clock_check_alone_stops_the_stale_write(self, tmp_path: Path) -> None:
        """A server that tracks no epochs: the holder's own lease check refuses the write on waking."""
        result = frozen_holder_scenario(tmp_path, server_fence=False, agent_guard=True)
        assert_fenced(result)
        old = result["old"]
        assert isinstance(old, Daemon)
        assert old.has_event("lease_validity_lapsed"), old.log_tail()

    def test_the_servers_epoch_fence_alone_drops_the_stale_frame(self, tmp_path: Path) -> None:
        """With the agent's check switched off, the frame goes out, and the server drops it: its session was superseded."""
        result = frozen_holder_scenario(tmp_path, server_fence=True, agent_guard=False)
        assert_fenced(result)
        timeline = result["timeline"]
        assert isinstance(timeline, list)
        dropped = [a for a in timeline if a.kind == "stale_frame"]
        assert [a.transmit.control_id for a in dropped if a.transmit] == [FROZEN_AT]

    def test_control_without_either_fence_the_stale_frame_arrives(self, tmp_path: Path) -> None:
        """Control: with both fences off the old holder's F03 reaches the server after F05 — the defect, so the scenario is real."""
        result = frozen_holder_scenario(tmp_path, server_fence=False, agent_guard=False)
        stale = stale_transmits(result)
        assert [a.transmit.control_id for a in stale if a.transmit] == [FROZEN_AT]

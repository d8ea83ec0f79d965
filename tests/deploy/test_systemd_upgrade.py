"""The blue/green pair and ``systemd/upgrade.sh`` under a real systemd, under load.

One Debian 12 machine (systemd 252 as PID 1 in systemd-nspawn, private
network), installed as docs/deploy.md says: ``systemd-prepare``, the edits
(server URL, token, channel ``lab`` on 2576 that no socket unit covers),
``systemd-pair``. Channel ``adt`` comes from ``hl7-agent.socket``; ``lab`` is
bound by the daemon and handed from colour to colour over
``handover.sock``. Senders keep sending on both channels, on a persistent
connection and with one connection per message, while the pair switches.

Before ``NonBlocking=yes`` in the units, starting the second colour made
systemd clear O_NONBLOCK on the shared socket: the running colour's event loop
then blocked inside accept4(), the new colour's handover timed out, and the
upgrade rolled back (``test_upgrade_under_load`` failed that way).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from agenttest import ack_code, hl7_message, wait_for
from deploytest import (
    PORTS,
    Load,
    NspawnMachine,
    SystemdWorld,
    doc_block,
    exchange_in,
    installed_systemd,
)

pytestmark = [pytest.mark.deploy, pytest.mark.slow, pytest.mark.timeout(600)]

BLUE = "hl7-agent@blue.service"
GREEN = "hl7-agent@green.service"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SystemdWorld]:
    with installed_systemd(tmp_path_factory.mktemp("systemd-upgrade"), "hl7-agent-pair", "systemd-pair") as world:
        yield world


def colour_events(m: NspawnMachine, unit: str, name: str) -> list[dict[str, object]]:
    """The daemon's events of the unit's current main process."""
    pid = str(m.main_pid(unit))
    return [e for e in m.daemon_events(unit, name) if e["_PID"] == pid]


class TestPair:
    def test_blue_serves_both_channels(self, world: SystemdWorld) -> None:
        """After the documented install blue is active (green idle) and serves both channels."""
        m = world.machine
        assert m.show(BLUE, "ActiveState") == "active"
        assert m.show(GREEN, "ActiveState") == "inactive"
        for channel, port in PORTS.items():
            ack = exchange_in(m.netns, port, hl7_message(f"PAIR-{channel}-1"))
            assert ack_code(ack) == "AA", ack
        started = colour_events(m, BLUE, "agent_started")
        assert started and started[-1]["version"] == "1.0.0", started

    def test_upgrade_under_load(self, world: SystemdWorld) -> None:
        """upgrade.sh to 1.1.0 while senders send on both channels: green takes over, no
        connection is refused, every message gets its AA and reaches the server once, in order."""
        m = world.machine
        mark = m.mark()
        with Load(m.netns, PORTS, "UPGRADE") as load:
            load.wait_acked(20)
            proc = m.sh(doc_block("systemd-upgrade"), cwd="/root/release", check=False, timeout=300)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            load.wait_acked(20)
        assert "done: hl7-agent@green.service is serving" in proc.stdout, proc.stdout
        assert m.show(GREEN, "ActiveState") == "active"
        assert m.show(BLUE, "ActiveState") == "inactive"
        assert m.show(GREEN, "UnitFileState") == "enabled"
        assert m.show(BLUE, "UnitFileState") == "disabled"
        started = colour_events(m, GREEN, "agent_started")
        assert started and started[-1]["version"] == "1.1.0", started
        sources = {e["source"]: e["names"] for e in colour_events(m, GREEN, "listeners_inherited")}
        assert sources.get("systemd") == ["adt"], sources
        assert "lab" in sources.get("handover", []), sources
        # With NonBlocking=yes systemd no longer switches blue's listener to blocking mode.
        assert not [e for e in m.daemon_events(BLUE, "listener_blocking_mode_repaired", since=mark)]
        assert load.refused == 0, load.report()
        load.assert_delivered_once_in_order(world.dev)

    def test_rollback_under_load(self, world: SystemdWorld) -> None:
        """A new colour that never turns healthy (its admin endpoint disabled) is stopped after
        --timeout: upgrade.sh exits 1 saying so, green keeps serving, nothing refused or lost."""
        m = world.machine
        env = m.path("/etc/hl7-agent/blue.env")
        saved = env.read_text()
        env.write_text("HL7_AGENT_ADMIN__LISTEN=\n")
        try:
            with Load(m.netns, PORTS, "ROLLBACK") as load:
                load.wait_acked(20)
                proc = m.sh("systemd/upgrade.sh --timeout 15", cwd="/root/release", check=False, timeout=120)
                load.wait_acked(20)
        finally:
            env.write_text(saved)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "hl7-agent health did not pass within 15s" in proc.stderr, proc.stderr
        assert "rolled back: hl7-agent@blue.service was stopped, hl7-agent@green.service keeps running" in proc.stderr
        assert m.show(GREEN, "ActiveState") == "active"
        assert m.show(BLUE, "ActiveState") == "inactive"
        assert load.refused == 0, load.report()
        load.assert_delivered_once_in_order(world.dev)
        # Green still hands its listeners on: the next upgrade works.
        wait_for(lambda: m.sh("test -S /var/lib/hl7-agent/handover.sock", check=False).returncode == 0, 10,
                 what="green's handover.sock again")

    def test_upgrade_again_after_the_rollback(self, world: SystemdWorld) -> None:
        """After the rollback the pair is consistent: switching to blue (1.0.0, already
        installed, so no --install) under load works like the first upgrade."""
        m = world.machine
        with Load(m.netns, PORTS, "AGAIN") as load:
            load.wait_acked(20)
            proc = m.sh("systemd/upgrade.sh", cwd="/root/release", check=False, timeout=300)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            load.wait_acked(20)
        assert m.show(BLUE, "ActiveState") == "active"
        assert m.show(GREEN, "ActiveState") == "inactive"
        assert load.refused == 0, load.report()
        load.assert_delivered_once_in_order(world.dev)

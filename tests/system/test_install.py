"""Installation: the stdlib ``queue`` is never shadowed, and ``pip install .`` gives a working agent (SPEC 2).

A folder ``queue/`` with Python in it would shadow the standard library's
``queue`` (asyncio imports it) whenever the repo root is on ``sys.path``. The
installed check runs the README's first command in a copy of the repo: a
clean venv (no system site-packages), a non-editable ``pip install .``, then
``hl7-agent run`` with the example config — ports and data dir moved aside
through the documented environment overrides so the test never collides with
a real agent. The venv is built once per module (about 30 s).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import urllib.error
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.agenttest import REPO_ROOT, free_port, http_get, wait_for

pytestmark = pytest.mark.slow

QUEUE_CHECK = (
    "import queue, asyncio; assert hasattr(queue, 'SimpleQueue'), queue.__file__; import agent.app.cli"
)
#: Never copied into the install source: build output, caches, local data.
COPY_IGNORE = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".venv", "data", ".pytest_cache",
    ".mypy_cache", ".ruff_cache",
)


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without anything that could make the repo or another venv importable."""
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith("HL7_AGENT_") and k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
    }
    env.update(extra)
    return env


def readme_first_command() -> list[str]:
    """The steps of README.md's first fenced code block, split at ``&&``."""
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"^```[a-z]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert match, "README.md has no fenced code block"
    lines = [ln for ln in match.group(1).splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    command = " ".join(ln.rstrip("\\").strip() for ln in lines)
    return [step.strip() for step in command.split("&&")]


@dataclass
class Installed:
    src: Path  # the copy of the repo the README command ran in
    venv: Path
    run_step: str  # the README's last step: the daemon command
    install_seconds: float

    @property
    def python(self) -> str:
        return str(self.venv / "bin" / "python")

    @property
    def hl7_agent(self) -> str:
        return str(self.venv / "bin" / "hl7-agent")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """Run the README's set-up steps (venv + non-editable ``pip install .``) in a copy of the repo."""
    import time

    steps = readme_first_command()
    assert len(steps) >= 2 and "hl7-agent run" in steps[-1], steps
    src = tmp_path_factory.mktemp("install") / "hl7-agent"
    shutil.copytree(REPO_ROOT, src, symlinks=True, ignore=COPY_IGNORE)
    started = time.monotonic()
    for step in steps[:-1]:
        argv = shlex.split(step)
        if argv[0] in ("python3", "python"):
            argv[0] = sys.executable  # the interpreter under test (python3 may be older than 3.11)
        proc = subprocess.run(
            argv, cwd=src, env=clean_env(), capture_output=True, text=True, timeout=300, check=False
        )
        assert proc.returncode == 0, f"README step {step!r} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    venv = src / ".venv"
    assert (venv / "bin" / "hl7-agent").exists()
    return Installed(src, venv, steps[-1], time.monotonic() - started)


class TestStdlibQueueNotShadowed:
    def test_repo_root_on_sys_path_keeps_the_stdlib_queue(self) -> None:
        """Run from the repo root (``''`` first on sys.path), ``import queue`` is still the standard library."""
        proc = subprocess.run(
            [sys.executable, "-c", QUEUE_CHECK], cwd=REPO_ROOT, env=clean_env(),
            capture_output=True, text=True, timeout=60, check=False,
        )
        assert proc.returncode == 0, proc.stderr

    def test_queue_folder_holds_no_python(self) -> None:
        """The ``queue/`` folder holds SQL only: no ``__init__.py`` and no ``.py`` file anywhere in it."""
        python_files = [p for p in (REPO_ROOT / "queue").rglob("*") if p.suffix in (".py", ".pyc", ".so")]
        assert python_files == []

    def test_installed_package_keeps_the_stdlib_queue(self, installed: Installed, tmp_path: Path) -> None:
        """The non-editable install, run from an unrelated folder, imports the stdlib queue and the agent."""
        proc = subprocess.run(
            [installed.python, "-c", QUEUE_CHECK + "; import agent; print(agent.__file__)"],
            cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60, check=False,
        )
        assert proc.returncode == 0, proc.stderr
        # Installed, not the source tree: the module lives in the venv's site-packages.
        assert str(installed.venv) in proc.stdout, proc.stdout


class TestInstalledSql:
    def test_installed_package_has_every_query_and_migration(self, installed: Installed, tmp_path: Path) -> None:
        """The non-editable install ships queue/sqlite/ whole: the same named queries and migrations as the tree."""
        script = ("import json; from agent.storage import sql; "
                  "print(json.dumps([sorted(sql.load_queries()), [n for n, _ in sql.load_migrations()], "
                  "sql.__file__]))")
        proc = subprocess.run([installed.python, "-c", script], cwd=tmp_path, env=clean_env(),
                              capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 0, proc.stderr
        queries, migrations, module = json.loads(proc.stdout)
        assert str(installed.venv) in module  # the installed copy, not the source tree
        from agent.storage import sql

        assert queries == sorted(sql.load_queries())
        assert migrations == [n for n, _ in sql.load_migrations()] and migrations


class TestInstalledCommands:
    def test_install_time_is_reported(self, installed: Installed) -> None:
        """The README set-up (venv + pip install .) finishes well within the CI budget."""
        assert installed.install_seconds < 240, installed.install_seconds

    def test_version(self, installed: Installed, tmp_path: Path) -> None:
        """``hl7-agent --version`` works from any folder and names the distribution's version."""
        proc = subprocess.run(
            [installed.hl7_agent, "--version"], cwd=tmp_path, env=clean_env(),
            capture_output=True, text=True, timeout=60, check=False,
        )
        assert proc.returncode == 0, proc.stderr
        assert re.fullmatch(r"hl7-agent \d+\.\d+\.\d+\S*\n", proc.stdout), proc.stdout

    def test_check_config_of_the_example(self, installed: Installed, tmp_path: Path) -> None:
        """``check-config`` accepts the shipped example config from an unrelated folder (SQL and all)."""
        proc = subprocess.run(
            [installed.hl7_agent, "check-config", "--config", str(REPO_ROOT / "config" / "agent.example.toml")],
            cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60, check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "edge-01" in proc.stdout
        assert "change-me" not in proc.stdout  # the token is masked

    def test_readme_first_command_runs_an_agent_that_takes_intake(self, installed: Installed,
                                                                    tmp_path: Path) -> None:
        """The README's run command starts, /healthz answers 200, ``send`` gets AA with no server reachable, SIGTERM exits 0."""
        mllp_port, admin_port, dead_port = free_port(), free_port(), free_port()
        env = clean_env(
            HL7_AGENT_ADMIN__LISTEN=f"127.0.0.1:{admin_port}",
            HL7_AGENT_CHANNELS=json.dumps([{"name": "adt", "listen": f"127.0.0.1:{mllp_port}"}]),
            HL7_AGENT_AGENT__DATA_DIR=str(tmp_path / "data"),
            HL7_AGENT_SERVER__URL=f"ws://127.0.0.1:{dead_port}/agent",  # nobody listens there
        )
        log_path = tmp_path / "agent.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                shlex.split(installed.run_step), cwd=installed.src, env=env, stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            def healthy() -> bool:
                if proc.poll() is not None:
                    raise AssertionError(f"agent exited {proc.returncode}:\n{log_path.read_text()}")
                try:
                    return http_get(f"http://127.0.0.1:{admin_port}/healthz", timeout=2)[0] == 200
                except (urllib.error.URLError, OSError):
                    return False

            wait_for(healthy, 30, interval=0.1, what="/healthz 200")
            sample = REPO_ROOT / "tests" / "data" / "adt_a01_v23_cr.hl7"
            sent = subprocess.run(
                [installed.hl7_agent, "send", "--port", str(mllp_port), "--timeout", "10", str(sample)],
                cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60, check=False,
            )
            assert sent.returncode == 0, sent.stdout + sent.stderr
            assert "MSA|AA|MSG00001" in sent.stdout
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0, log_path.read_text()[-4000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        queued = subprocess.run(
            [installed.python, "-c",
             "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]);"
             "print(c.execute(\"SELECT state, control_id FROM messages\").fetchall())",
             str(tmp_path / "data" / "queue.db")],
            cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60, check=False,
        )
        assert queued.stdout.strip() == "[('queued', 'MSG00001')]", queued.stdout + queued.stderr

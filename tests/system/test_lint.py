"""The house style holds: ruff with the project's rule set and mypy --strict on agent/ (STYLE.md)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from agenttest import REPO_ROOT

pytestmark = pytest.mark.slow


def _tool(name: str) -> list[str]:
    if shutil.which(name) is None and subprocess.run(
        [sys.executable, "-m", name, "--version"], capture_output=True, check=False
    ).returncode != 0:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]' brings it)")
    return [sys.executable, "-m", name]


def test_ruff_is_clean() -> None:
    """ruff check passes on the whole tree with the rules in pyproject.toml."""
    result = subprocess.run([*_tool("ruff"), "check", "."], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stdout[-4000:]


def test_mypy_strict_is_clean() -> None:
    """mypy --strict finds nothing in the agent package."""
    result = subprocess.run([*_tool("mypy")], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-4000:]


def test_ruff_refuses_asyncio_wait_for(tmp_path: Path) -> None:
    """The project's rules reject asyncio.wait_for (it loses cancellations on 3.11, see agent/runtime/aio.py)."""
    sample = tmp_path / "sample.py"
    sample.write_text("import asyncio\n\n\nasync def f(e: asyncio.Event) -> None:\n"
                      "    await asyncio.wait_for(e.wait(), 1)\n", encoding="utf-8")
    result = subprocess.run([*_tool("ruff"), "check", "--no-cache", "--config", str(REPO_ROOT / "pyproject.toml"),
                             "--select", "TID251", str(sample)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 1, result.stdout
    assert "TID251" in result.stdout and "gh-86296" in result.stdout

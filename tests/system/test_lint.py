"""The house style holds: ruff with the project's rule set and mypy --strict on agent/ (STYLE.md)."""

from __future__ import annotations

import shutil
import subprocess
import sys

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

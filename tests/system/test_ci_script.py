"""`.ci/run` installs every system tool the suite looks for, so CI on a clean machine skips nothing.

Tests that need a tool the machine lacks skip (or fail saying what to
install); on a CI host that is a silently lost test. Each tool the suite
looks up is mapped here to its Debian package, and that package must be in
the script's list; where dpkg knows the tool's file, the mapping itself is
checked against it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from agenttest import REPO_ROOT

#: Tool the tests run (``shutil.which``) -> the Debian 12 package that ships it.
TOOLS = {
    "shellcheck": "shellcheck",  # tests/system/test_packaging.py
    "sqlite3": "sqlite3",  # tests/system/test_storage_faults.py (the operator's shell)
    "openssl": "openssl",  # the TLS tests make their certificates with it
    "systemd-analyze": "systemd",  # tests/system/test_packaging.py
    "systemd-socket-activate": "systemd",  # tests/system/test_socket_activation.py
    "mkfs.ext4": "e2fsprogs",  # tests/system/test_storage_faults.py (read-only remount)
    "chromium": "chromium",  # tests/system/test_status_page_browser.py
    "systemd-nspawn": "systemd-container",  # tests/deploy/
    "debootstrap": "debootstrap",
    "podman": "podman",
    "runc": "runc",
}


def _packages() -> list[str]:
    text = (REPO_ROOT / ".ci" / "run").read_text(encoding="utf-8")
    match = re.search(r"^packages=\(([^)]*)\)", text, re.MULTILINE)
    assert match, ".ci/run has no packages=(...) list"
    return match.group(1).split()


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_the_package_of_every_tool_is_installed_by_ci(tool: str) -> None:
    assert TOOLS[tool] in _packages(), f".ci/run does not install {TOOLS[tool]} ({tool})"


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_the_tool_comes_from_that_package(tool: str) -> None:
    """The mapping is true on this machine: dpkg says the tool's file belongs to the package."""
    path = shutil.which(tool)
    if path is None or shutil.which("dpkg") is None:
        pytest.skip(f"{tool} or dpkg not here: nothing to compare the mapping with")
    owners: set[str] = set()
    for candidate in {path, str(Path(path).resolve())}:
        for name in (candidate, candidate.replace("/usr/bin/", "/bin/").replace("/usr/sbin/", "/sbin/")):
            proc = subprocess.run(["dpkg", "-S", name], capture_output=True, text=True, timeout=30, check=False)
            if proc.returncode == 0:
                owners |= {owner.strip().split(":")[0] for line in proc.stdout.splitlines()
                           for owner in line.split(": ")[0].split(",")}
    if not owners:
        pytest.skip(f"{path} belongs to no Debian package here (installed otherwise)")
    assert TOOLS[tool] in owners, f"{path} comes from {sorted(owners)}, not {TOOLS[tool]}"


def test_ci_runs_the_readmes_second_command() -> None:
    """CI runs exactly what the README tells a developer to run (the script's comment says so)."""
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", readme, re.MULTILINE | re.DOTALL)
    assert len(blocks) >= 2, "README.md has no second fenced block"
    second = blocks[1].strip()
    lines = [line for line in (REPO_ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    assert lines[-1].strip() == second, f".ci/run ends with {lines[-1]!r}, the README says {second!r}"

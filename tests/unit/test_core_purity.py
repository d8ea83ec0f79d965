"""agent/core is pure: importing any of its modules loads no I/O machinery and no outer layer.

Each core module is imported in a fresh interpreter (an import in this
process would see whatever other tests loaded); the test fails if asyncio,
socket, sqlite3 or threading got loaded, or anything under agent.storage,
agent.runtime or agent.app. That is what lets the intake and dispatch
policies be tested without a loop, a socket or a database.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import pytest

import agent.core

CORE_MODULES = sorted(f"agent.core.{m.name}" for m in pkgutil.iter_modules(agent.core.__path__))
FORBIDDEN = ("asyncio", "socket", "sqlite3", "threading")
OUTER_LAYERS = ("agent.storage", "agent.runtime", "agent.app")

PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(sys.modules)))
"""


@pytest.mark.parametrize("module", CORE_MODULES)
def test_core_module_imports_no_io_and_no_outer_layer(module: str) -> None:
    out = subprocess.run([sys.executable, "-c", PROBE, module], capture_output=True, text=True, timeout=60,
                         check=True)
    loaded = json.loads(out.stdout)
    assert [m for m in FORBIDDEN if m in loaded] == []
    assert [m for m in loaded if m.startswith(OUTER_LAYERS)] == []


def test_the_intake_core_is_among_them() -> None:
    assert {"agent.core.intake", "agent.core.intake_policy", "agent.core.charsets"} <= set(CORE_MODULES)

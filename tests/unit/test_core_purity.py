"""agent/core is pure: importing any of its modules loads no I/O machinery and no outer layer.

Each core module is imported in a fresh interpreter (an import in this
process would see whatever other tests loaded); the test fails if asyncio,
socket, sqlite3 or threading got loaded, or anything under agent.storage,
agent.runtime or agent.app. That is what lets the intake and dispatch
policies be tested without a loop, a socket or a database.

The other layers are held to their direction by reading every module of the
tree (``ast``, function-level imports included): storage imports only core,
runtime only core and storage (agent.app's configuration models only for type
annotations, under ``TYPE_CHECKING``), and only app composes them all.
"""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import agent.core

#: Every module under agent/core, subpackages included.
CORE_MODULES = sorted(m.name for m in pkgutil.walk_packages(agent.core.__path__, "agent.core."))
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


AGENT = Path(agent.core.__file__).resolve().parents[1]
#: Which layers each layer may import at run time (agent.errors and the package root: everyone).
MAY_IMPORT = {
    "core": {"core"},
    "storage": {"core", "storage"},
    "runtime": {"core", "storage", "runtime"},
    "app": {"core", "storage", "runtime", "app"},
}


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` (annotations only, never run)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (
            (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
            or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
        ):
            inside.update(id(n) for child in node.body for n in ast.walk(child))
    return inside


def layer_imports(path: Path) -> list[tuple[int, str]]:
    """(line, layer) of every run-time import of an agent layer in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    skip = _type_checking_blocks(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + ([f"{node.module}.{a.name}" for a in node.names] if node.module == "agent" else [])
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "agent" and len(parts) > 1 and parts[1] in MAY_IMPORT:
                found.append((node.lineno, parts[1]))
    return found


LAYERED = sorted(p for layer in MAY_IMPORT for p in (AGENT / layer).rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", LAYERED, ids=lambda p: str(p.relative_to(AGENT.parent)))
def test_layers_import_only_inward(path: Path) -> None:
    """core <- storage <- runtime <- app: no module reaches outward (the whole tree, no list)."""
    layer = path.relative_to(AGENT).parts[0]
    outward = [(line, other) for line, other in layer_imports(path) if other not in MAY_IMPORT[layer]]
    assert outward == []


def test_the_layer_check_sees_an_outward_import(tmp_path: Path) -> None:
    """The detector itself: a run-time import is caught, one under TYPE_CHECKING is not."""
    sample = tmp_path / "sample.py"
    sample.write_text("from typing import TYPE_CHECKING\nfrom agent.app import cli\nimport agent.storage.sql\n"
                      "from agent import runtime\nif TYPE_CHECKING:\n    from agent.app.config import Settings\n"
                      "def f():\n    import agent.runtime.aio\n")
    assert sorted(layer_imports(sample)) == [(2, "app"), (3, "storage"), (4, "runtime"), (8, "runtime")]

"""References to our own docs lead somewhere: the file exists and so does the heading.

Code, log text and the docs point readers at ``docs/queue.md#dedupe`` and the
like instead of a private file; a renamed heading would leave such a pointer
dangling without anyone noticing. Anchors are computed the way GitHub (and
most Markdown renderers) do: lower-case, punctuation dropped, spaces to hyphens.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"

#: ``docs/queue.md`` or ``docs/queue.md#dedupe`` in code, SQL or prose.
DOC_REFERENCE = re.compile(r"\bdocs/([\w.-]+\.md)(?:#([\w-]+))?")
#: A Markdown link to a local file or anchor: ``](queue.md#dedupe)``, ``](#frames)``.
MARKDOWN_LINK = re.compile(r"\]\(((?:\.\./)?[\w./-]*?\.md)?(?:#([^)\s]+))?\)")


def anchors(markdown: Path) -> set[str]:
    """The heading anchors of ``markdown``; headings inside fenced code do not count."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in markdown.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        heading = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def _sources() -> list[Path]:
    return sorted([REPO / "README.md", *DOCS.glob("*.md"), *DOCS.glob("*.json"),
                   *(p for p in (REPO / "agent").rglob("*.py") if "__pycache__" not in p.parts),
                   *(REPO / "queue").rglob("*.sql")])


def dangling() -> list[str]:
    out = []
    for path in _sources():
        text = path.read_text(encoding="utf-8")
        targets = [(DOCS / name, anchor) for name, anchor in DOC_REFERENCE.findall(text)]
        if path.suffix == ".md":
            targets += [((path.parent / name) if name else path, anchor)
                        for name, anchor in MARKDOWN_LINK.findall(text) if name or anchor]
        for doc, anchor in targets:
            if not doc.is_file():
                out.append(f"{path.relative_to(REPO)}: {doc.relative_to(REPO)} does not exist")
            elif anchor and anchor not in anchors(doc):
                out.append(f"{path.relative_to(REPO)}: {doc.relative_to(REPO)}#{anchor} has no such heading")
    return out


def test_every_doc_reference_resolves() -> None:
    """Every docs/X.md[#anchor] named in code, SQL or docs, and every local Markdown link, exists."""
    assert dangling() == []


def test_anchors_are_computed_like_github(tmp_path: Path) -> None:
    """The detector itself: punctuation and backticks dropped, duplicates numbered, code ignored."""
    doc = tmp_path / "x.md"
    doc.write_text("# Title\n## `--json`\n## Blue/green pair and upgrades\n```\n# not a heading\n```\n"
                   "## Frames\n### Frames\n", encoding="utf-8")
    assert anchors(doc) == {"title", "--json", "bluegreen-pair-and-upgrades", "frames", "frames-1"}


ARCHITECTURE = DOCS / "architecture.md"
#: A repository path in backticks, optionally with a test's name: `agent/core/intake.py`,
#: `tests/unit/test_states.py::TestTransitions`.
NAMED_PATH = re.compile(r"`((?:agent|tests|queue|docs|config|bench|systemd|scripts)/[\w./-]*)(?:::(\w+))?`")
#: A dotted module name in backticks: `agent.core.dispatch`.
NAMED_MODULE = re.compile(r"`(agent(?:\.\w+)+)`")


def missing_from_architecture(text: str) -> list[str]:
    out = []
    for path, name in NAMED_PATH.findall(text):
        target = REPO / path
        if not target.exists():
            out.append(path)
        elif name and not re.search(rf"^\s*(?:class|def|async def) {name}\b", target.read_text(encoding="utf-8"),
                                    re.MULTILINE):
            out.append(f"{path}::{name}")
    for module in NAMED_MODULE.findall(text):
        base = REPO / module.replace(".", "/")
        if not (base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()):
            out.append(module)
    return out


def test_architecture_names_only_what_exists() -> None:
    """Every module, folder and test docs/architecture.md names exists (a move or rename must update it)."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    assert len(NAMED_PATH.findall(text)) > 40  # the page names the tree; the check is not vacuous
    assert missing_from_architecture(text) == []


def test_the_architecture_check_sees_a_stale_name() -> None:
    """The detector itself: a moved module, a renamed test class and a dotted name are caught."""
    stale = ("`agent/listener.py` `tests/unit/test_states.py::TestNoSuchThing` `agent.core.gone` "
             "`agent/core/intake.py` `tests/unit/test_states.py::TestTransitions` `agent.core.dispatch`")
    assert missing_from_architecture(stale) == ["agent/listener.py", "tests/unit/test_states.py::TestNoSuchThing",
                                                "agent.core.gone"]

"""Every command, flag, metric and log event the docs name exists in the code.

The pages are read as data: a command renamed, a flag dropped, a metric or
event renamed or given other labels without its docs fails here. What each
command *does* is checked by tests/system/test_operations_doc.py (it runs the
operations page's lines) and the deployment tests (they run docs/deploy.md);
this module checks the names on every page, including the ones nobody runs
(README, acks, queue, protocol, configuration).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from agent.app.cli import build_parser
from agent.app.config import ChannelSettings
from agent.app.config.models import _SECTIONS
from agent.runtime.metrics import AgentMetrics

REPO = Path(__file__).resolve().parents[2]
PAGES = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md", REPO / "config" / "agent.example.toml"]
CODE = "\n".join(path.read_text(encoding="utf-8") for path in sorted((REPO / "agent").rglob("*.py")))

#: ``hl7-agent`` followed by a word that is not a command (the example's title line). The user and
#: container named hl7-agent (``sudo -u``, ``-g``, ``docker exec``) are skipped by the pattern.
_NOT_COMMANDS = {"example"}


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def _command_text(page: Path) -> list[tuple[int, str]]:
    """(line number, text) of what a page shows as code: fenced blocks whole, else code spans.

    The example TOML is all comments and values: every line of it counts.
    """
    out: list[tuple[int, str]] = []
    fenced = page.suffix != ".md"
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            out.append((number, line))
        else:
            out.extend((number, span) for span in re.findall(r"`([^`]+)`", line))
    return out


def _mentions() -> list[tuple[str, list[str]]]:
    """(where, [command, subcommand?, flags...]) for each ``hl7-agent CMD ...`` shown as code.

    The words after ``hl7-agent`` up to the end of the code or a shell
    operator: the leading lower-case words are the command, every ``--flag``
    after them (also inside ``[...]`` or ``(...)``, past placeholders such as
    ``ID...`` or ``S``) must be one the command takes.
    """
    found = []
    for page in PAGES:
        for number, text in _command_text(page):
            for match in re.finditer(r"(?<!-u )(?<!-g )(?<!exec )(?<![\w/.-])hl7-agent ([^`]*)", text):
                tokens = match.group(1).split()
                if not tokens or not re.fullmatch(r"[a-z][a-z-]*;?", tokens[0]):
                    continue  # a diagram or prose: no command follows
                words: list[str] = []
                for raw in tokens:
                    token = raw.rstrip(";'\")")
                    if token in {"|", "||", "&&", ";", "#"} or token.startswith((">", "2>", "<")):
                        break
                    if re.fullmatch(r"[a-z][a-z-]*", token) and all(not w.startswith("-") for w in words):
                        if len(words) < 2:
                            words.append(token)
                        continue
                    flag = re.match(r"^[\[(]*(--?[a-z][a-z-]*)", token)
                    if flag:
                        words.append(flag.group(1))
                    if token != raw:  # the command ended (``;``, a closing quote)
                        break
                if words and words[0] not in _NOT_COMMANDS and not words[0].startswith("-"):
                    found.append((f"{page.relative_to(REPO)}:{number}", words))
    return found


def test_the_pages_name_commands_at_all() -> None:
    """The scan finds the command tables (a broken pattern would pass everything)."""
    commands = {words[0] for _, words in _mentions()}
    assert {"run", "check-config", "queue", "channel", "send", "dev-server", "health"} <= commands


@pytest.mark.parametrize(("where", "words"), _mentions(), ids=lambda value: str(value))
def test_every_documented_command_and_flag_exists(where: str, words: list[str]) -> None:
    """``hl7-agent CMD [SUB] --flag`` as written on a page is accepted by the parser."""
    parser = build_parser()
    global_flags = _flags(parser)
    commands = _subcommands(parser)
    assert words[0] in commands, f"{where}: no command {words[0]!r}"
    command = commands[words[0]]
    rest = words[1:]
    subs = _subcommands(command)
    if subs and rest and not rest[0].startswith("-"):
        assert rest[0] in subs, f"{where}: no command {words[0]} {rest[0]!r}"
        command = subs[rest[0]]
        rest = rest[1:]
    known = _flags(command) | global_flags
    for word in rest:
        if word.startswith("-"):
            assert word in known, f"{where}: {' '.join(words[:2])} has no flag {word}"


def _exposed() -> dict[str, set[str]]:
    """{sample name: label names} of everything one process's registry exposes.

    Labelled metrics have no sample until they moved, so their names and
    labels are read from the metric objects themselves; the scrape-time
    collectors (queue gauges, dropped log lines) from a scrape with queue
    statistics bound.
    """
    metrics = AgentMetrics()
    metrics.bind_stats(lambda: {
        "states": {"queued": 1},
        "channels": {"adt": {"queued": 1, "claimed": 0, "inflight": 0,
                             "oldest_queued_age_s": 1.0, "paused": False}},
        "lease": None,
        "db": {"path": "/x/queue.db", "size_bytes": 1, "wal_bytes": 1},
    })
    families: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            families.setdefault(sample.name, set()).update(set(sample.labels) - {"le"})
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            for suffix in suffixes.get(value._type, ("",)):
                families.setdefault(value._name + suffix, set()).update(value._labelnames)
    return families


def _documented_metrics() -> list[tuple[str, str, set[str] | None]]:
    """(where, sample name, label names or None) for each ``hl7_agent_…`` code span."""
    found = []
    for page in PAGES:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for span in re.findall(r"`([^`]*)`", line):
                for name, labels in re.findall(r"\b(hl7_agent_[a-z_]*[a-z])(?:\{([^}]*)\})?", span):
                    names = {label.split("=")[0].strip() for label in labels.split(",")} if labels else None
                    found.append((f"{page.relative_to(REPO)}:{number}", name, names))
    return found


def test_the_pages_name_metrics_at_all() -> None:
    assert len({name for _, name, _ in _documented_metrics()}) >= 8


@pytest.mark.parametrize(("where", "name", "labels"), _documented_metrics(), ids=lambda value: str(value))
def test_every_documented_metric_is_exposed_with_its_labels(where: str, name: str,
                                                            labels: set[str] | None) -> None:
    """A metric a page names is on ``/metrics`` under that name, with the labels it lists."""
    exposed = _exposed()
    assert name in exposed, f"{where}: /metrics has no {name} (it has {sorted(exposed)})"
    if labels is not None:
        assert labels <= exposed[name], f"{where}: {name} has labels {sorted(exposed[name])}, not {sorted(labels)}"


def _event_table_rows() -> list[tuple[str, str]]:
    """(where, event) for each row of docs/operations.md's log event tables."""
    page = REPO / "docs" / "operations.md"
    found = []
    header: list[str] | None = None
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if not line.startswith("|"):
            header = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif header[0] == "event" and not set(line) <= set("|- "):
            found.extend((f"docs/operations.md:{number}", event)
                         for event in re.findall(r"`([a-z_]+)`", cells[0]))
    return found


def test_the_event_tables_are_found() -> None:
    assert len(_event_table_rows()) >= 8


@pytest.mark.parametrize(("where", "event"), _event_table_rows(), ids=lambda value: str(value))
def test_every_documented_log_event_is_emitted_by_the_code(where: str, event: str) -> None:
    """An event the operations page tells people to watch is a string the daemon logs."""
    assert f'"{event}"' in CODE, f"{where}: no code logs {event!r}"


#: ``section.word`` spans that are file names, not keys.
_FILE_NAMES = {"queue.db", "agent.env", "agent.toml"}


def test_every_section_dot_key_on_a_page_is_a_key() -> None:
    """``queue.min_free_disk_bytes``, ``channels[].frame_timeout``, ``[queue] busy_timeout`` name real keys."""
    models = {**_SECTIONS, "channels": ChannelSettings, "channels[]": ChannelSettings}
    sections = "|".join(re.escape(name) for name in sorted(models, key=len, reverse=True))
    wrong, seen = [], 0
    for page in PAGES:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            pairs = re.findall(rf"`({sections})\.([a-z_]+)`", line)
            pairs += re.findall(rf"`\[({sections})\] ([a-z_]+)", line)
            for section, key in pairs:
                seen += 1
                if f"{section}.{key}" not in _FILE_NAMES and key not in models[section].model_fields:
                    wrong.append(f"{page.relative_to(REPO)}:{number}: {section}.{key}")
    assert seen >= 50, "the pattern finds the keys the pages name"
    assert not wrong, wrong


def _test_ids() -> tuple[set[str], set[str]]:
    """(``path::Class`` and ``path::[Class::]name`` of every test, every test function's bare name)."""
    import ast

    ids: set[str] = set()
    names: set[str] = set()
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        rel = path.relative_to(REPO).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            scopes = [("", node)]
            if isinstance(node, ast.ClassDef):
                ids.add(f"{rel}::{node.name}")
                scopes = [(f"{node.name}::", child) for child in node.body]
            for prefix, item in scopes:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name.startswith("test_"):
                    ids.add(f"{rel}::{prefix}{item.name}")
                    names.add(item.name)
    return ids, names


def test_every_test_a_page_cites_exists() -> None:
    """The tests the docs point to as proof (``tests/x.py::Class::test_y``, ``test_y``, a module) exist.

    docs/reliability.md, queue.md and acks.md say which test proves which
    promise; a renamed or deleted test must not leave them pointing nowhere.
    """
    ids, names = _test_ids()
    missing = []
    for page in PAGES:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            where = f"{page.relative_to(REPO)}:{number}"
            for ref in re.findall(r"`(tests/[\w/]+\.py(?:::[\w:]+)?)`", line):
                path = ref.split("::")[0]
                if not (REPO / path).is_file() or ("::" in ref and ref not in ids):
                    missing.append(f"{where}: {ref}")
            for name in re.findall(r"`(test_[a-z0-9_]+)`", line):
                if name not in names:
                    missing.append(f"{where}: {name}")
    assert not missing, missing

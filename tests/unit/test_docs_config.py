"""The configuration docs say what the code does: every key, its default, its variable.

docs/configuration.md (one table per section), the README's key table and
config/agent.example.toml are read as data and compared with the pydantic
models, so a key added, renamed or given another default without its docs
fails here.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from agent.app.config import ChannelSettings, Settings, load_settings
from agent.app.config.models import _SECTIONS

REPO = Path(__file__).resolve().parents[2]
CONFIGURATION_MD = REPO / "docs" / "configuration.md"
README = REPO / "README.md"
EXAMPLE = REPO / "config" / "agent.example.toml"

#: What a channel needs before its defaults can be read.
_CHANNEL_REQUIRED = {"name": "adt", "listen": "127.0.0.1:2575"}
_MODELS: dict[str, type[BaseModel]] = {**_SECTIONS, "channels": ChannelSettings}
#: Defaults that are computed, not constants: the doc describes them in words.
_COMPUTED = {("agent", "id")}
_UNSET = object()
_REQUIRED = object()


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _doc_tables() -> dict[str, dict[str, dict[str, str]]]:
    """``{section: {key: {column: cell}}}`` from the tables under ``## `[section]` `` headings."""
    tables: dict[str, dict[str, dict[str, str]]] = {}
    section: str | None = None
    header: list[str] | None = None
    for line in CONFIGURATION_MD.read_text(encoding="utf-8").splitlines():
        heading = re.match(r"^## `\[\[?([a-z]+)\]\]?`$", line)
        if heading:
            section, header = heading.group(1), None
            tables[section] = {}
            continue
        if line.startswith("#"):
            section = None
            continue
        if section is None or not line.startswith("|"):
            continue
        cells = _cells(line)
        if header is None:
            header = cells
        elif not set(line) <= set("|- "):
            row = dict(zip(header, cells, strict=True))
            key = row["key"].strip("`")
            assert key not in tables[section], f"[{section}] {key} documented twice"
            tables[section][key] = row
    return tables


def _code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`]*)`", text)


def _doc_value(cell: str) -> object:
    """The value a default cell states: its first code span, or the words unset/required."""
    spans = _code_spans(cell)
    if spans:
        text = spans[0]
        try:
            return tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            return text  # a bare word of the docs: 20s, /var/lib/hl7-agent, full
    if cell.startswith("unset") or cell.lower() == "none":
        return _UNSET
    if cell == "required":
        return _REQUIRED
    raise AssertionError(f"cannot read a default from {cell!r}")


def _model_default(section: str, key: str) -> Any:
    model = _MODELS[section]
    base = dict(_CHANNEL_REQUIRED) if section == "channels" else {}
    if section == "channels" and key == "listen":
        base = {"name": "adt", "connect": "127.0.0.1:2575"}  # an outbound channel: listen unset
    return getattr(model.model_validate(base), key)


def _as_model_value(section: str, key: str, value: object) -> Any:
    """``value`` validated as the model validates a file's value (units, paths, case)."""
    model = _MODELS[section]
    base = dict(_CHANNEL_REQUIRED) if section == "channels" else {}
    return getattr(model.model_validate({**base, key: value}), key)


def _check_default(where: str, section: str, key: str, stated: object) -> None:
    field = _MODELS[section].model_fields[key]
    if stated is _REQUIRED:
        assert field.is_required(), f"{where}: {section}.{key} is documented as required"
        return
    assert not field.is_required(), f"{where}: {section}.{key} is required but documented with a default"
    if (section, key) in _COMPUTED:
        return
    default = _model_default(section, key)
    if stated is _UNSET:
        assert default is None, f"{where}: {section}.{key} is documented unset, default is {default!r}"
        return
    assert _as_model_value(section, key, stated) == default, (
        f"{where}: {section}.{key} is documented with default {stated!r}, the code's is {default!r}"
    )


class TestConfigurationReference:
    def test_every_section_has_a_table(self) -> None:
        """docs/configuration.md has one table per section of the models, and no other."""
        assert set(_doc_tables()) == set(_MODELS)

    @pytest.mark.parametrize("section", sorted(_MODELS))
    def test_keys_match_the_model(self, section: str) -> None:
        """Every key of the model is documented, and every documented key exists."""
        documented = set(_doc_tables()[section])
        assert documented == set(_MODELS[section].model_fields), section

    @pytest.mark.parametrize("section", sorted(_MODELS))
    def test_defaults_match_the_model(self, section: str) -> None:
        """Each documented default is the code's default, once validated as a file value would be."""
        for key, row in _doc_tables()[section].items():
            _check_default("docs/configuration.md", section, key, _doc_value(row["default"]))

    @pytest.mark.parametrize("section", sorted(_SECTIONS))
    def test_environment_names(self, section: str) -> None:
        """The env column names HL7_AGENT_<SECTION>__<KEY>, and that variable sets the key."""
        for key, row in _doc_tables()[section].items():
            assert row["env"] == f"`HL7_AGENT_{section.upper()}__{key.upper()}`", (section, key)

    def test_no_security_key_is_said_to_be_refused(self) -> None:
        """The security keys work: no doc may say they are refused until supported."""
        for path in (CONFIGURATION_MD, README, EXAMPLE):
            text = path.read_text(encoding="utf-8")
            assert not re.search(r"refused[^.\n]*until|until (it is |they are )?supported", text), path


def _readme_rows() -> list[tuple[str, str, str]]:
    """(section, key, default cell) from the README's configuration table."""
    rows = []
    in_table = False
    for line in README.read_text(encoding="utf-8").splitlines():
        if line.startswith("| key | default | meaning |"):
            in_table = True
            continue
        if in_table and not line.startswith("|"):
            break
        if not in_table or set(line) <= set("|- "):
            continue
        keys_cell, default_cell, _meaning = _cells(line)
        keys = [k.strip("` ") for k in re.split(r"[,/]", keys_cell) if k.strip("` ")]
        defaults = [d.strip() for d in default_cell.split(" / ")]
        if len(defaults) == 1:
            defaults *= len(keys)
        first_section = keys[0].split(".")[0].removesuffix("[]")
        for dotted, default in zip(keys, defaults, strict=True):
            section, _, key = dotted.rpartition(".")
            rows.append((section.removesuffix("[]") or first_section, key, default))
    return rows


class TestReadme:
    def test_readme_table_lists_every_key(self) -> None:
        """The README's table names every key of every section."""
        documented = {(section, key) for section, key, _ in _readme_rows()}
        expected = {(name, key) for name, model in _MODELS.items() for key in model.model_fields}
        assert documented == expected

    def test_readme_defaults_match_the_model(self) -> None:
        """Each default in the README's table is the code's default."""
        for section, key, cell in _readme_rows():
            if (section, key) in _COMPUTED:
                continue
            stated: object
            if cell in ("none", "required"):
                stated = _UNSET if cell == "none" else _REQUIRED
            else:
                stated = _doc_value(cell)
            _check_default("README.md", section, key, stated)


def _example_assignments() -> tuple[list[tuple[str, str, str]], list[tuple[str, str]]]:
    """Set keys as (section, key, comment line before) and commented-out keys as (section, key)."""
    section = ""
    assigned: list[tuple[str, str, str]] = []
    commented: list[tuple[str, str]] = []
    previous = ""
    for raw in EXAMPLE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        table = re.match(r"^\[\[?([a-z]+)\]\]?$", line)
        if table:
            section = table.group(1)
        elif (match := re.match(r"^([a-z_]+) = ", line)) and section:
            assigned.append((section, match.group(1), previous + " " + line))
        elif (match := re.match(r"^# ([a-z_]+) = ", line)) and section:
            commented.append((section, match.group(1)))
        # The comment block right above a key (several lines) is its context.
        previous = (previous + " " + line) if line.startswith("#") else ""
    return assigned, commented


class TestExample:
    #: Keys the example sets to something else than the default, on purpose (it runs from
    #: the repository as any user, against the dev server): their comment states the default.
    DIFFERENT = frozenset({("agent", "id"), ("agent", "data_dir"), ("server", "url"),
                           ("server", "token")})

    def test_every_key_is_in_the_example(self) -> None:
        """Each key of each section and of a channel is set or shown commented in the example."""
        assigned, commented = _example_assignments()
        present = {(s, k) for s, k, _ in assigned} | set(commented)
        expected = {(name, key) for name, model in _MODELS.items() for key in model.model_fields}
        assert expected <= present, expected - present
        assert present <= expected, present - expected

    def test_example_values_are_the_defaults(self) -> None:
        """The first channel and every section set each key to its default, except the few
        the example must change, whose comment names the default."""
        data = tomllib.loads(EXAMPLE.read_text(encoding="utf-8"))
        assigned, commented = _example_assignments()
        for section, key, context in assigned:
            value = data[section][0][key] if section == "channels" else data[section][key]
            if section == "channels" and key in _CHANNEL_REQUIRED:
                continue
            if section == "channels" and data["channels"][0].get(key, _UNSET) is _UNSET:
                continue  # a key of the second channel only
            if (section, key) in self.DIFFERENT:
                assert re.search(r"[Dd]efault", context), (section, key, context)
                continue
            if section == "channels":
                value = data["channels"][0][key]
            _check_default("config/agent.example.toml", section, key, value)
        for section, key in commented:
            field = _MODELS[section].model_fields[key]
            default = _model_default(section, key)
            assert default in (None, []), (
                f"{section}.{key} is only commented out in the example, but its default is {default!r}"
            )
            assert not field.is_required()

    def test_example_loads(self) -> None:
        """The example is a valid configuration on its own."""
        settings = load_settings(str(EXAMPLE), {})
        assert isinstance(settings, Settings)
        assert [c.name for c in settings.channels] == ["adt", "lab"]


class TestNoPrivateReferences:
    #: "SPEC 3", "SPEC section 3", "SPEC §3", "SPEC.md": a file users never see.
    PRIVATE = re.compile(r"\bSPEC\b")

    def test_no_spec_section_numbers(self) -> None:
        """Code, SQL, docs, README, example configs and units cite the project's own docs
        (docs/protocol.md, docs/acks.md, docs/queue.md ...) or say the rule in words, never
        "SPEC n": log lines, error messages and docstrings reach users who never see that file."""
        paths = [README, *sorted((REPO / "docs").iterdir()), *sorted((REPO / "config").iterdir()),
                 *sorted((REPO / "systemd").iterdir()), *sorted((REPO / "agent").rglob("*.py")),
                 *sorted((REPO / "queue").rglob("*.sql"))]
        offenders = [
            f"{path.relative_to(REPO)}:{number}: {line.strip()}"
            for path in paths if path.is_file() and path.suffix != ".png"
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if self.PRIVATE.search(line)
        ]
        assert offenders == []

    def test_the_check_sees_every_spelling(self) -> None:
        """The detector itself: each way the old references were written is caught."""
        for text in ("(SPEC 3)", "SPEC section 4", "see SPEC.md", "SPEC §6", "SPEC 4-6"):
            assert self.PRIVATE.search(text), text
        assert not self.PRIVATE.search("the specification in docs/protocol.md (SPECIFIC)")

"""Every option of every command says what it does, and its default when it has one (docs/operations.md)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from agent.app.cli import build_parser


def parsers(parser: argparse.ArgumentParser, path: str = "hl7-agent") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """The parser and every subcommand's, depth first, with their command lines."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, f"{path} {name}")


ALL = list(parsers(build_parser()))


def test_every_command_is_seen() -> None:
    """The walk reaches the commands of the CLI, queue fail included."""
    names = {path for path, _ in ALL}
    assert {"hl7-agent queue fail", "hl7-agent queue list", "hl7-agent channel pause",
            "hl7-agent send", "hl7-agent dev-server"} <= names


@pytest.mark.parametrize(("path", "parser"), ALL, ids=[p for p, _ in ALL])
def test_every_argument_has_help(path: str, parser: argparse.ArgumentParser) -> None:
    """No option or positional argument is left without a help text."""
    missing = [a.dest for a in parser._actions
               if not isinstance(a, argparse._SubParsersAction) and not (a.help or "").strip()]
    assert missing == [], path


@pytest.mark.parametrize(("path", "parser"), ALL, ids=[p for p, _ in ALL])
def test_defaults_are_shown(path: str, parser: argparse.ArgumentParser) -> None:
    """An option with a real default shows it in --help; flags that are simply off do not say False."""
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
            continue
        assert f"(default: {action.default})" in text, (path, action.dest)
    assert "(default: None)" not in text and "(default: False)" not in text


def test_examples() -> None:
    """The values an operator looks for: queue list --limit 50, send --timeout 30, export --format mllp."""
    helps = {path: " ".join(p.format_help().split()) for path, p in ALL}
    assert "at most N rows; 0 means all (default: 50)" in helps["hl7-agent queue list"]
    assert "seconds to wait for each ACK (default: 30.0)" in helps["hl7-agent send"]
    assert "(default: mllp)" in helps["hl7-agent queue export"]
    assert "(default: 8080)" in helps["hl7-agent dev-server"]


@pytest.mark.parametrize(("path", "parser"), ALL, ids=[p for p, _ in ALL])
def test_no_option_is_taken_by_a_prefix(path: str, parser: argparse.ArgumentParser) -> None:
    """No abbreviations: ``dev-server --token SECRET`` must not become --token-file SECRET."""
    assert parser.allow_abbrev is False, path


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e9", "soon"])
def test_send_timeout_must_be_a_positive_finite_number_of_seconds(
        value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A usage error (exit 2, one line), not a traceback from the socket layer."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["send", "--port", "2575", "--timeout", value, "m.hl7"])
    assert exit_info.value.code == 2
    assert "is not a number of seconds" in capsys.readouterr().err


def test_send_timeout_accepts_fractions() -> None:
    assert build_parser().parse_args(["send", "--port", "2575", "--timeout", "0.5", "m.hl7"]).timeout == 0.5

"""``partition_key`` and ``max_in_flight``: parsed at load, refused with a clear error when wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.app import config as config_module
from agent.app.config import load_settings
from agent.core.partition import FieldPath
from agent.errors import ConfigError

BASE = '[[channels]]\nname = "adt"\nlisten = "0.0.0.0:2575"\n'


@pytest.fixture(autouse=True)
def no_default_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(config_module, "DEFAULT_CONFIG_PATH", tmp_path / "absent" / "agent.toml")


def load(tmp_path: Path, extra: str) -> config_module.Settings:
    path = tmp_path / "agent.toml"
    path.write_text(BASE + extra, encoding="utf-8")
    return load_settings(str(path), {})


def error(tmp_path: Path, extra: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, extra)
    return str(info.value)


def test_defaults_keep_one_partition(tmp_path: Path) -> None:
    channel = load(tmp_path, "").channels[0]
    assert channel.partition_key is None and channel.partition is None and channel.max_in_flight == 1


def test_partition_key_is_parsed_and_normalised(tmp_path: Path) -> None:
    channel = load(tmp_path, 'partition_key = " MSH-4 , PID-3[2].1 "\nmax_in_flight = 8\n').channels[0]
    assert channel.partition_key == "MSH-4,PID-3[2].1"
    assert channel.partition is not None
    assert channel.partition.paths == (FieldPath("MSH", 4), FieldPath("PID", 3, 2, 1))
    assert channel.max_in_flight == 8


def test_malformed_path_is_refused_with_the_syntax(tmp_path: Path) -> None:
    message = error(tmp_path, 'partition_key = "PID.3"\n')
    assert "channels[0].partition_key" in message and "SEGMENT-FIELD" in message


def test_empty_partition_key_is_refused(tmp_path: Path) -> None:
    assert "at least one HL7 field path" in error(tmp_path, 'partition_key = ""\n')


def test_max_in_flight_needs_partition_key(tmp_path: Path) -> None:
    message = error(tmp_path, "max_in_flight = 4\n")
    assert "max_in_flight = 4 needs partition_key" in message


@pytest.mark.parametrize("value", [0, 257])
def test_max_in_flight_bounds(tmp_path: Path, value: int) -> None:
    assert "max_in_flight" in error(tmp_path, f'partition_key = "PID-3.1"\nmax_in_flight = {value}\n')


def test_sequence_numbers_refused_with_several_in_flight(tmp_path: Path) -> None:
    """MSH-13 would no longer reach the server in arrival order."""
    message = error(tmp_path, 'partition_key = "PID-3.1"\nmax_in_flight = 2\nassign_sequence_numbers = true\n')
    assert "assign_sequence_numbers cannot be used with max_in_flight > 1" in message


def test_sequence_numbers_allowed_with_one_in_flight(tmp_path: Path) -> None:
    channel = load(tmp_path, 'partition_key = "PID-3.1"\nassign_sequence_numbers = true\n').channels[0]
    assert channel.assign_sequence_numbers and channel.max_in_flight == 1

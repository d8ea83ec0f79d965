"""Configuration: file + environment, strict keys, one-line errors, masked rendering (SPEC 3)."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest
from pydantic import BaseModel

from agent.app import config as config_module
from agent.app.config import (
    ChannelSettings,
    Settings,
    load_settings,
    parse_byte_size,
    parse_duration,
    parse_listen,
    render_effective,
    resolve_config_path,
)
from agent.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "config" / "agent.example.toml"

MINIMAL = """
[agent]
id = "edge-01"
data_dir = "state"

[server]
url = "ws://127.0.0.1:8080/agent"
token = "s3cret-token"

[[channels]]
name = "adt"
listen = "0.0.0.0:2575"

[[channels]]
name = "lab"
listen = "[::1]:2576"
encoding = "8859/1"
"""


def write(tmp_path: Path, text: str, name: str = "agent.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def load_error(path: Path | None, environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_settings(str(path) if path else None, environ or {})
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("config error: ")
    return message


@pytest.fixture(autouse=True)
def no_default_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Keep a real /etc/hl7-agent/agent.toml on the test host out of every test."""
    monkeypatch.setattr(config_module, "DEFAULT_CONFIG_PATH", tmp_path / "absent" / "agent.toml")


class TestDefaults:
    def test_environment_alone_is_enough(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """With no file and no variables every key has its documented default."""
        monkeypatch.setattr("socket.gethostname", lambda: "edge-host")
        settings = load_settings(None, {})
        assert settings.config_path is None
        assert settings.agent.id == "edge-host"
        assert settings.agent.data_dir == Path("/var/lib/hl7-agent")
        assert settings.db_path == Path("/var/lib/hl7-agent/queue.db")
        assert settings.agent.shutdown_budget == 20.0
        assert settings.agent.reuse_port is False
        assert settings.server.url is None
        assert settings.server.token_value() is None
        assert settings.server.proxy == "none"
        assert (settings.server.connect_timeout, settings.server.response_timeout) == (10.0, 30.0)
        assert settings.server.application_ack_timeout == 30.0
        assert settings.server.ping_interval == 20.0
        assert settings.admin.listen == "127.0.0.1:9575"
        assert settings.admin.address == ("127.0.0.1", 9575)
        assert (settings.logging.level, settings.logging.format) == ("info", "json")
        assert settings.queue.synchronous == "full"
        assert settings.queue.dedupe_window == 7 * 86400
        assert settings.queue.retention == 30 * 86400
        assert settings.queue.max_db_bytes == 0
        assert settings.queue.min_free_disk_bytes == 256 * 1024 * 1024
        assert settings.dispatch.lease_ttl == 30.0
        assert settings.dispatch.lease_heartbeat == 10.0
        assert settings.channels == []

    def test_channel_defaults(self) -> None:
        """A channel needs only a name and a listen address."""
        channel = ChannelSettings(name="adt", listen="0.0.0.0:2575")
        assert channel.ack == "commit"
        assert channel.max_message_bytes == 1048576
        assert channel.encoding == "utf-8"
        assert channel.on_reject == "continue"
        assert channel.max_attempts == 0
        assert channel.allowed_sources == []
        assert channel.max_connections == 64
        assert channel.idle_timeout == 0.0
        assert (channel.host, channel.port) == ("0.0.0.0", 2575)

    def test_hostname_default_is_sanitised(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A host name outside the id alphabet still yields a valid default id."""
        monkeypatch.setattr("socket.gethostname", lambda: "weird host!" + "x" * 80)
        agent_id = load_settings(None, {}).agent.id
        assert len(agent_id) == 64
        assert agent_id.startswith("weird-host-")

    def test_code_may_use_port_zero(self) -> None:
        """Settings built in code (tests) may listen on port 0; a config file may not."""
        channel = ChannelSettings(name="adt", listen="127.0.0.1:0")
        assert channel.port == 0


class TestFile:
    def test_minimal_file(self, tmp_path: Path) -> None:
        """A TOML file sets sections and channels."""
        path = write(tmp_path, MINIMAL)
        settings = load_settings(str(path), {})
        assert settings.config_path == path
        assert settings.agent.id == "edge-01"
        assert settings.server.url == "ws://127.0.0.1:8080/agent"
        assert settings.server.token_value() == "s3cret-token"
        assert [c.name for c in settings.channels] == ["adt", "lab"]
        assert (settings.channel("lab").host, settings.channel("lab").port) == ("::1", 2576)
        assert settings.channel("lab").encoding == "8859/1"

    def test_unknown_channel_lookup(self, tmp_path: Path) -> None:
        """Asking for a channel that is not configured names the ones that are."""
        settings = load_settings(str(write(tmp_path, MINIMAL)), {})
        with pytest.raises(ConfigError, match="no channel named 'xyz'.*adt, lab"):
            settings.channel("xyz")

    def test_missing_explicit_file_is_an_error(self, tmp_path: Path) -> None:
        """A --config path that does not exist is an error, not a fallback to defaults."""
        message = load_error(tmp_path / "nope.toml")
        assert "nope.toml does not exist" in message
        assert "--config" in message

    def test_empty_explicit_file_name_is_an_error(self, tmp_path: Path) -> None:
        """``--config "$CONF"`` with CONF unset names no file: an error, not HL7_AGENT_CONFIG's file or defaults."""
        env = {"HL7_AGENT_CONFIG": str(write(tmp_path, MINIMAL))}
        with pytest.raises(ConfigError, match="--config is empty"):
            load_settings("", env)
        with pytest.raises(ConfigError, match="--config is empty"):
            load_settings("  ", {})

    def test_missing_file_named_by_env_is_an_error(self, tmp_path: Path) -> None:
        """HL7_AGENT_CONFIG naming a missing file is an error too."""
        message = load_error(None, {"HL7_AGENT_CONFIG": str(tmp_path / "nope.toml")})
        assert "HL7_AGENT_CONFIG" in message

    def test_invalid_toml(self, tmp_path: Path) -> None:
        """A TOML syntax error names the file and the line."""
        message = load_error(write(tmp_path, "[agent\nid = 1\n"))
        assert "is not valid TOML" in message
        assert "line 1" in message

    def test_shipped_example_loads(self) -> None:
        """config/agent.example.toml is valid and says what the README promises."""
        settings = load_settings(str(EXAMPLE), {})
        assert settings.agent.data_dir == REPO / "data"
        assert settings.server.url == "ws://127.0.0.1:8080/agent"
        assert settings.server.token_value() == "change-me"
        assert settings.admin.listen == "127.0.0.1:9575"
        adt, lab = settings.channels
        assert (adt.name, adt.listen, adt.ack) == ("adt", "0.0.0.0:2575", "commit")
        assert (lab.name, lab.listen, lab.ack, lab.encoding) == (
            "lab",
            "0.0.0.0:2576",
            "commit",
            "8859/1",
        )
        assert config_module.security_features_unavailable(settings) == []

    def test_example_documents_every_key(self) -> None:
        """Every key of every section and channel appears in the example, set or commented."""
        text = EXAMPLE.read_text(encoding="utf-8")
        models: list[type[BaseModel]] = [*config_module._SECTIONS.values(), ChannelSettings]
        for model in models:
            for key in model.model_fields:
                assert f"{key} = " in text, key


class TestEnvironment:
    def test_env_overrides_a_section_key(self, tmp_path: Path) -> None:
        """HL7_AGENT_<SECTION>__<KEY> beats the file; other keys of the section stay."""
        path = write(tmp_path, MINIMAL)
        settings = load_settings(
            str(path),
            {"HL7_AGENT_SERVER__URL": "wss://hl7.example.org/agent", "HL7_AGENT_ADMIN__LISTEN": ""},
        )
        assert settings.server.url == "wss://hl7.example.org/agent"
        assert settings.server.token_value() == "s3cret-token"
        assert settings.admin.listen is None
        assert settings.admin.address is None

    def test_an_empty_variable_gives_a_key_with_a_default_its_default(self, tmp_path: Path) -> None:
        """``${VAR:-}`` in a compose file: the key is unset — its default, whatever the file says."""
        path = write(tmp_path, MINIMAL + '\n[queue]\nretention = "30d"\n')
        settings = load_settings(str(path), {"HL7_AGENT_SERVER__PROXY": "", "HL7_AGENT_QUEUE__RETENTION": " ",
                                             "HL7_AGENT_AGENT__REUSE_PORT": "", "HL7_AGENT_AGENT__ID": ""})
        defaults = Settings()
        assert settings.server.proxy == "none"
        assert settings.queue.retention == defaults.queue.retention
        assert settings.agent.reuse_port is False
        assert settings.agent.id == defaults.agent.id

    def test_env_names_are_case_insensitive(self) -> None:
        """Lower-case variable names work too."""
        settings = load_settings(None, {"hl7_agent_logging__level": "DEBUG"})
        assert settings.logging.level == "debug"

    def test_env_value_types_are_coerced(self) -> None:
        """Booleans, durations and sizes from strings."""
        settings = load_settings(
            None,
            {
                "HL7_AGENT_AGENT__REUSE_PORT": "true",
                "HL7_AGENT_QUEUE__MAX_DB_BYTES": "10MiB",
                "HL7_AGENT_SERVER__RESPONSE_TIMEOUT": "2m",
            },
        )
        assert settings.agent.reuse_port is True
        assert settings.queue.max_db_bytes == 10 * 1024 * 1024
        assert settings.server.response_timeout == 120.0

    def test_env_channels_replace_file_channels(self, tmp_path: Path) -> None:
        """HL7_AGENT_CHANNELS is one JSON list that replaces [[channels]] whole."""
        path = write(tmp_path, MINIMAL)
        env = {"HL7_AGENT_CHANNELS": '[{"name": "orm", "listen": "127.0.0.1:3000"}]'}
        settings = load_settings(str(path), env)
        assert [(c.name, c.port) for c in settings.channels] == [("orm", 3000)]

    def test_env_channels_must_be_a_json_list(self) -> None:
        """Broken JSON or a non-list in HL7_AGENT_CHANNELS is a config error naming it."""
        assert "HL7_AGENT_CHANNELS is not valid JSON" in load_error(
            None, {"HL7_AGENT_CHANNELS": "[{"}
        )
        assert "must be a JSON list" in load_error(None, {"HL7_AGENT_CHANNELS": '{"a": 1}'})

    def test_non_key_variables_are_ignored(self, tmp_path: Path) -> None:
        """HL7_AGENT_CONFIG and HL7_AGENT_DEV_TOKEN are not keys and are not errors."""
        path = write(tmp_path, MINIMAL)
        settings = load_settings(
            None, {"HL7_AGENT_CONFIG": str(path), "HL7_AGENT_DEV_TOKEN": "x", "PATH": "/bin"}
        )
        assert settings.config_path == path

    def test_unrelated_os_environ_does_not_leak(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """An explicit environ mapping is the only environment consulted."""
        monkeypatch.setenv("HL7_AGENT_SERVER__URL", "ws://leaked:1/")
        monkeypatch.setenv("HL7_AGENT_BOGUS", "1")
        assert load_settings(None, {}).server.url is None

    def test_os_environ_is_the_default(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Without an explicit mapping, os.environ is read."""
        for name in list(os.environ):
            if name.upper().startswith("HL7_AGENT_"):
                monkeypatch.delenv(name)
        monkeypatch.setenv("HL7_AGENT_AGENT__ID", "from-env")
        assert load_settings().agent.id == "from-env"


class TestUnknownKeys:
    def test_unknown_key_in_a_section(self, tmp_path: Path) -> None:
        """A misspelt key in the file is an error naming it, with a suggestion."""
        message = load_error(write(tmp_path, '[server]\nurll = "ws://x/"\n'))
        assert "server.urll: is not a known key (did you mean url?)" in message
        assert str(tmp_path / "agent.toml") in message

    def test_unknown_section(self, tmp_path: Path) -> None:
        """A misspelt section is an error."""
        message = load_error(write(tmp_path, '[serverr]\nurl = "ws://x/"\n'))
        assert "serverr: is not a known section (did you mean server?)" in message

    def test_settings_arguments_are_not_keys(self, tmp_path: Path) -> None:
        """pydantic-settings constructor arguments in the file are unknown keys, not options."""
        message = load_error(write(tmp_path, '_secrets_dir = "/tmp"\n'))
        assert "_secrets_dir: is not a known section" in message

    def test_unknown_key_in_a_channel_table(self, tmp_path: Path) -> None:
        """An unknown key in a [[channels]] table names the channel index."""
        text = '[[channels]]\nname = "adt"\nlisten = "0.0.0.0:2575"\nacks = "commit"\n'
        message = load_error(write(tmp_path, text))
        assert "channels[0].acks: is not a known key (did you mean ack?)" in message

    def test_a_channel_error_names_the_channel_too(self, tmp_path: Path) -> None:
        """By index and by name: with several channels, the name is what the operator looks for."""
        text = ('[[channels]]\nname = "adt"\nlisten = "0.0.0.0:2575"\n'
                '[[channels]]\nname = "lab"\nlisten = "0.0.0.0:2576"\npartition_key = "PID-3.1,"\n')
        message = load_error(write(tmp_path, text))
        assert "channels[1].partition_key: 'PID-3.1,' has an empty path" in message
        assert "(channel lab)" in message

    def test_unknown_key_in_env_channels(self) -> None:
        """An unknown key inside HL7_AGENT_CHANNELS names that variable."""
        env = {"HL7_AGENT_CHANNELS": '[{"name": "a", "listen": "0.0.0.0:1", "colour": 1}]'}
        message = load_error(None, env)
        assert "channels[0].colour: is not a known key" in message
        assert "(env HL7_AGENT_CHANNELS)" in message

    @pytest.mark.parametrize(
        ("name", "suggestion"),
        [
            ("HL7_AGENT_SERVER__URLL", "HL7_AGENT_SERVER__URL"),
            ("HL7_AGENT_SERVERR__URL", "HL7_AGENT_SERVER__URL"),
            ("HL7_AGENT_SERVER_URL", "HL7_AGENT_SERVER__URL"),
            ("HL7_AGENT_CHANNEL", "HL7_AGENT_CHANNELS"),
        ],
    )
    def test_unknown_env_key(self, name: str, suggestion: str) -> None:
        """An unknown HL7_AGENT_ variable is an error naming it and the likely intended one."""
        message = load_error(None, {name: "ws://x/"})
        assert message == (f"config error: {name} is not a known key (did you mean {suggestion}?)")

    def test_same_key_twice_in_env(self) -> None:
        """Two spellings of one variable are ambiguous and refused."""
        message = load_error(None, {"HL7_AGENT_AGENT__ID": "a", "hl7_agent_agent__id": "b"})
        assert "set the same key" in message


class TestSources:
    """Where pydantic-settings' own sources would differ from the documented rules."""

    def test_config_from_a_pipe(self) -> None:
        """A named file that is not a regular file (--config <(...)) is read, not skipped."""
        read_end, write_end = os.pipe()
        try:
            os.write(write_end, b'[agent]\nid = "from-pipe"\n')
            os.close(write_end)
            write_end = -1
            settings = load_settings(f"/dev/fd/{read_end}", {})
        finally:
            os.close(read_end)
            if write_end >= 0:
                os.close(write_end)
        assert settings.agent.id == "from-pipe"

    def test_section_names_are_exact_in_the_file(self, tmp_path: Path) -> None:
        """[SERVER] is an unknown section, not [server]; two spellings are not merged."""
        message = load_error(write(tmp_path, '[SERVER]\nurl = "ws://x/"\n'))
        assert message.startswith("config error: SERVER: is not a known section")
        text = '[server]\nurl = "ws://x/"\n[Server]\nurl = "ws://y/"\n'
        message = load_error(write(tmp_path, text))
        assert "Server: is not a known section (did you mean server?)" in message

    def test_key_names_are_exact_in_the_file(self, tmp_path: Path) -> None:
        """URL in [server] is an unknown key, whatever the case of the variables."""
        message = load_error(write(tmp_path, '[server]\nURL = "ws://x/"\n'))
        assert message.startswith("config error: server.URL: is not a known key")

    def test_first_error_in_file_order(self, tmp_path: Path) -> None:
        """With errors in two sections, the one earlier in the file is reported."""
        text = '[admin]\nlisten = "x"\n[server]\nurl = "http://x/"\n'
        assert load_error(write(tmp_path, text)).startswith("config error: admin.listen: ")

    def test_env_channels_null(self) -> None:
        """HL7_AGENT_CHANNELS=null is refused, not taken as "no channels set"."""
        message = load_error(None, {"HL7_AGENT_CHANNELS": "null"})
        assert "HL7_AGENT_CHANNELS must be a JSON list of channel objects" in message

    def test_blank_env_channels_keep_the_file_channels(self, tmp_path: Path) -> None:
        """An empty HL7_AGENT_CHANNELS is not set: the file's channels stay."""
        settings = load_settings(str(write(tmp_path, MINIMAL)), {"HL7_AGENT_CHANNELS": " "})
        assert [c.name for c in settings.channels] == ["adt", "lab"]

    def test_section_values_are_text_not_json(self) -> None:
        """A section variable's value is taken as written, never decoded as JSON."""
        settings = load_settings(
            None, {"HL7_AGENT_AGENT__ID": "007", "HL7_AGENT_SERVER__TOKEN": "[1]"}
        )
        assert settings.agent.id == "007"
        assert settings.server.token_value() == "[1]"

    def test_env_over_a_non_table_in_the_file(self, tmp_path: Path) -> None:
        """A section variable replaces a file's non-table value for that section."""
        path = write(tmp_path, 'server = "x"\n')
        settings = load_settings(str(path), {"HL7_AGENT_SERVER__URL": "ws://a:1/"})
        assert settings.server.url == "ws://a:1/"


class TestValues:
    @pytest.mark.parametrize(
        ("text", "seconds"),
        [
            (30, 30.0),
            (1.5, 1.5),
            ("45", 45.0),
            ("500ms", 0.5),
            ("30s", 30.0),
            ("5m", 300.0),
            ("2h", 7200.0),
            ("7d", 604800.0),
            ("1h30m", 5400.0),
            (" 10 S ", 10.0),
            (0, 0.0),
            ("36500d", 36500 * 86400.0),
        ],
    )
    def test_durations(self, text: object, seconds: float) -> None:
        """Durations take seconds or a unit suffix."""
        assert parse_duration(text) == seconds

    @pytest.mark.parametrize("text", ["", "soon", "5x", "-1", -1, True, "1h30", "nan", [1],
                                      "36501d", "999999999999d", 1e300])
    def test_bad_durations(self, text: object) -> None:
        """Anything else is refused."""
        with pytest.raises(ValueError, match="duration"):
            parse_duration(text)

    @pytest.mark.parametrize(
        ("text", "size"),
        [
            (1048576, 1048576),
            ("2048", 2048),
            ("64KiB", 65536),
            ("10MiB", 10 * 1024**2),
            ("1GiB", 1024**3),
            ("10MB", 10_000_000),
            ("1kb", 1000),
            ("1.5 KiB", 1536),
        ],
    )
    def test_byte_sizes(self, text: object, size: int) -> None:
        """Sizes take bytes or a decimal/binary unit."""
        assert parse_byte_size(text) == size

    @pytest.mark.parametrize("text", ["10M", "lots", "-5", -5, False, 1.5])
    def test_bad_byte_sizes(self, text: object) -> None:
        """Ambiguous units, negatives and fractions of a byte are refused."""
        with pytest.raises(ValueError, match="size|>= 0"):
            parse_byte_size(text)

    def test_duration_keys_in_file(self, tmp_path: Path) -> None:
        """Duration and size keys accept their string forms in the file."""
        text = (
            '[queue]\ndedupe_window = "1d"\nretention = "2d"\nmin_free_disk_bytes = "1GiB"\n'
            '[[channels]]\nname = "a"\nlisten = "0.0.0.0:1"\nmax_message_bytes = "64KiB"\n'
            'idle_timeout = "5m"\n'
        )
        settings = load_settings(str(write(tmp_path, text)), {})
        assert settings.queue.dedupe_window == 86400.0
        assert settings.queue.min_free_disk_bytes == 1024**3
        assert settings.channels[0].max_message_bytes == 65536
        assert settings.channels[0].idle_timeout == 300.0

    def test_bad_duration_in_env_names_the_variable(self) -> None:
        """A bad value from the environment names the variable it came from."""
        message = load_error(None, {"HL7_AGENT_SERVER__CONNECT_TIMEOUT": "soon"})
        assert message.startswith("config error: server.connect_timeout: 'soon' is not a duration")
        assert message.endswith("(env HL7_AGENT_SERVER__CONNECT_TIMEOUT)")

    def test_max_message_bytes_bounds(self, tmp_path: Path) -> None:
        """max_message_bytes must lie within 1 KiB and 64 MiB."""
        for size in ("512", "65MiB"):
            text = f'[[channels]]\nname = "a"\nlisten = "0.0.0.0:1"\nmax_message_bytes = "{size}"\n'
            assert "channels[0].max_message_bytes" in load_error(write(tmp_path, text))

    @pytest.mark.parametrize(
        "encoding",
        ["utf-16", "UNICODE UTF-16", "utf-32-le", "klingon",
         # Python codecs that are no character set, or none of table 0211.
         "idna", "rot13", "punycode", "base64", "zlib", "uu", "hex", "raw_unicode_escape", "utf-7", "cp1252"],
    )
    def test_bad_encoding(self, tmp_path: Path, encoding: str) -> None:
        """UTF-16/32 (forbidden by HL7 over MLLP), transforms and unknown character sets are refused."""
        text = f'[[channels]]\nname = "a"\nlisten = "0.0.0.0:1"\nencoding = "{encoding}"\n'
        message = load_error(write(tmp_path, text))
        assert "channels[0].encoding" in message
        assert repr(encoding) in message
        assert "table 0211" in message

    @pytest.mark.parametrize("encoding", ["8859/1", "UNICODE UTF-8", "latin-1", "ascii", "utf8", "ISO-8859-15"])
    def test_good_encoding(self, encoding: str) -> None:
        """HL7 table 0211 names and Python names of those encodings are accepted as written."""
        assert ChannelSettings(name="a", listen="0.0.0.0:1", encoding=encoding).encoding == encoding

    def test_allowed_sources_are_cidrs(self) -> None:
        """allowed_sources take addresses and networks, normalised; junk is refused."""
        channel = ChannelSettings(
            name="a", listen="0.0.0.0:1", allowed_sources=["10.1.0.0/16", "192.0.2.7", "::1"]
        )
        assert channel.allowed_sources == ["10.1.0.0/16", "192.0.2.7/32", "::1/128"]
        env = {
            "HL7_AGENT_CHANNELS": '[{"name":"a","listen":"0.0.0.0:1","allowed_sources":["10.0/x"]}]'
        }
        assert "channels[0].allowed_sources" in load_error(None, env)

    def test_allowed_sources_as_peers_are_compared(self) -> None:
        """An IPv4-mapped entry becomes the IPv4 network peers are compared with (it never matched);
        one with host bits is kept as written, for the start's warning (allowed_source_host_bits)."""
        channel = ChannelSettings(name="a", listen="0.0.0.0:1",
                                  allowed_sources=["::ffff:127.0.0.1/128", "::ffff:10.0.0.0/104", "10.1.2.3/8"])
        assert channel.allowed_sources == ["127.0.0.1/32", "10.0.0.0/8", "10.1.2.3/8"]

    def test_literals_are_case_insensitive(self) -> None:
        """Enumerated values accept any case."""
        settings = load_settings(
            None, {"HL7_AGENT_QUEUE__SYNCHRONOUS": "NORMAL", "HL7_AGENT_LOGGING__FORMAT": "Console"}
        )
        assert (settings.queue.synchronous, settings.logging.format) == ("normal", "console")

    def test_bad_literal(self) -> None:
        """An enumerated key lists its valid values."""
        message = load_error(None, {"HL7_AGENT_LOGGING__LEVEL": "verbose"})
        assert "'debug', 'info', 'warning' or 'error'" in message

    def test_bad_agent_id(self) -> None:
        """agent.id is limited to [A-Za-z0-9._-]{1,64}."""
        assert "agent.id: 'edge 01'" in load_error(None, {"HL7_AGENT_AGENT__ID": "edge 01"})


class TestRelativePaths:
    def test_relative_to_the_config_folder(self, tmp_path: Path) -> None:
        """Relative paths are resolved against the config file's folder."""
        folder = tmp_path / "etc"
        folder.mkdir()
        (folder / "token").write_text("t0k\n", encoding="utf-8")
        text = '[agent]\ndata_dir = "../var"\n[server]\ntoken_file = "token"\n'
        settings = load_settings(str(write(folder, text)), {})
        assert settings.agent.data_dir == tmp_path / "var"
        assert settings.server.token_file == folder / "token"
        # Shown normalised everywhere (check-config, queue stats, errors): resolved once at load.
        assert settings.db_path == tmp_path / "var" / "queue.db"

    def test_data_dir_is_shown_normalised(self, tmp_path: Path) -> None:
        """check-config shows the data_dir without ``..`` (the path the queue commands and logs name)."""
        folder = tmp_path / "config"
        folder.mkdir()
        settings = load_settings(str(write(folder, '[agent]\ndata_dir = "../data"\n')), {})
        rendered = render_effective(settings)
        assert f"data_dir = {json.dumps(str(tmp_path / 'data'))}" in rendered
        assert "/../" not in rendered

    def test_relative_to_cwd_without_file(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """With no file, relative paths are resolved against the working directory."""
        monkeypatch.chdir(tmp_path)
        settings = load_settings(None, {"HL7_AGENT_AGENT__DATA_DIR": "data"})
        assert settings.agent.data_dir == tmp_path / "data"
        assert settings.agent.data_dir.is_absolute()

    def test_relative_env_path_with_file(self, tmp_path: Path) -> None:
        """An env override of a path is relative to the config folder too."""
        path = write(tmp_path, "")
        settings = load_settings(str(path), {"HL7_AGENT_AGENT__DATA_DIR": "q"})
        assert settings.agent.data_dir == tmp_path / "q"

    def test_absolute_paths_stay(self, tmp_path: Path) -> None:
        """Absolute paths are kept as written."""
        settings = load_settings(str(write(tmp_path, '[agent]\ndata_dir = "/srv/q"\n')), {})
        assert settings.agent.data_dir == Path("/srv/q")

    def test_missing_certificate_file(self, tmp_path: Path) -> None:
        """A certificate path that does not exist is an error at load, naming the key."""
        message = load_error(write(tmp_path, '[server]\nca_file = "ca.pem"\n'))
        assert f"server.ca_file: file {tmp_path / 'ca.pem'} does not exist" in message


class TestChannels:
    @pytest.mark.parametrize("name", ["ADT", "a b", "adt!", ""])
    def test_bad_channel_name(self, tmp_path: Path, name: str) -> None:
        """Channel names must match [a-z0-9_-]+."""
        text = f'[[channels]]\nname = "{name}"\nlisten = "0.0.0.0:2575"\n'
        message = load_error(write(tmp_path, text))
        assert f"channels[0].name: {name!r} must match [a-z0-9_-]+" in message

    def test_duplicate_names(self, tmp_path: Path) -> None:
        """Two channels may not share a name."""
        text = (
            '[[channels]]\nname = "adt"\nlisten = "0.0.0.0:2575"\n'
            '[[channels]]\nname = "adt"\nlisten = "0.0.0.0:2576"\n'
        )
        message = load_error(write(tmp_path, text))
        assert "channels[1].name: 'adt' is already used by channels[0]" in message

    @pytest.mark.parametrize(
        ("first", "second"),
        [
            ("0.0.0.0:2575", "0.0.0.0:2575"),
            ("0.0.0.0:2575", "127.0.0.1:2575"),
            ("[::]:2575", "10.0.0.1:2575"),
        ],
    )
    def test_duplicate_listen(self, tmp_path: Path, first: str, second: str) -> None:
        """Two channels may not share a listen address (a wildcard overlaps every host)."""
        text = (
            f'[[channels]]\nname = "a"\nlisten = "{first}"\n'
            f'[[channels]]\nname = "b"\nlisten = "{second}"\n'
        )
        assert "channels[1].listen" in load_error(write(tmp_path, text))

    def test_outbound_channel_loads(self, tmp_path: Path) -> None:
        """connect instead of listen: an outbound channel, with its TLS files made absolute."""
        text = ('[[channels]]\nname = "ref"\nconnect = "reflab.example.org:6661"\ntls_server_ca = "ca.pem"\n'
                'tls_cert = "me.pem"\ntls_key = "me.key"\nreconnect_cap = "10s"\n')
        for name in ("me.pem", "me.key"):
            (tmp_path / name).write_text("-", encoding="ascii")
        assert "channels[0].tls_server_ca: file" in load_error(write(tmp_path, text)), "a missing CA file is refused"
        (tmp_path / "ca.pem").write_text("-", encoding="ascii")
        (channel,) = load_settings(str(write(tmp_path, text)), {}).channels
        assert channel.outbound and channel.listen is None and (channel.host, channel.port) == ("reflab.example.org", 6661)
        assert channel.tls_server_ca == tmp_path / "ca.pem" and channel.reconnect_cap == 10.0

    @pytest.mark.parametrize(("keys", "says"), [
        ('listen = "0.0.0.0:2575"\nconnect = "a.example:1"', "set either listen"),
        ("", "set listen (senders connect to us) or connect"),
        ('connect = "a.example"', "connect 'a.example': missing port"),
        ('connect = "a.example:0"', "port must be 1-65535"),
        ('connect = "a.example:1"\nallowed_sources = ["10.0.0.0/8"]', "allowed_sources is for a listening channel"),
        ('connect = "a.example:1"\ntls_client_ca = "ca.pem"', "tls_client_ca is for a listening channel"),
        ('connect = "a.example:1"\nmax_connections = 4', "max_connections is for a listening channel"),
        ('connect = "a.example:1"\ntls_cert = "c.pem"\ntls_key = "c.key"', "set tls_server_ca too"),
        ('connect = "a.example:1"\ntls_server_name = "a"', "tls_server_name needs tls_server_ca"),
        ('listen = "0.0.0.0:2575"\ntls_server_ca = "ca.pem"', "tls_server_ca is for an outbound channel"),
        ('connect = "a.example:1"\nreconnect_initial = "1m"', "reconnect_initial (1m) must be <= reconnect_cap (30s)"),
    ])
    def test_outbound_keys_checked(self, tmp_path: Path, keys: str, says: str) -> None:
        """A listener's security keys on an outbound channel (or the reverse) are refused, never ignored."""
        message = load_error(write(tmp_path, f'[[channels]]\nname = "a"\n{keys}\n'))
        assert says in message, message

    def test_channel_and_admin_clash(self) -> None:
        """A channel may not listen on the admin address."""
        env = {"HL7_AGENT_CHANNELS": '[{"name": "a", "listen": "127.0.0.1:9575"}]'}
        assert "overlaps admin.listen" in load_error(None, env)

    @pytest.mark.parametrize(
        "listen",
        [
            "0.0.0.0",
            "0.0.0.0:",
            "0.0.0.0:0",
            "0.0.0.0:65536",
            "0.0.0.0:-1",
            ":2575",
            "::1:2575",
            "[::1]",
            "[::1:2575",
            "[nothost]:2575",
            "bad_host:2575",
        ],
    )
    def test_bad_listen(self, tmp_path: Path, listen: str) -> None:
        """Missing port, port 0 or > 65535, missing host and unbracketed IPv6 are refused."""
        text = f'[[channels]]\nname = "a"\nlisten = "{listen}"\n'
        assert "channels[0].listen" in load_error(write(tmp_path, text))

    @pytest.mark.parametrize(
        ("listen", "host", "port"),
        [
            ("0.0.0.0:2575", "0.0.0.0", 2575),
            ("[::1]:2575", "::1", 2575),
            ("[::]:1", "::", 1),
            ("localhost:65535", "localhost", 65535),
            ("edge-01.example.org:2575", "edge-01.example.org", 2575),
        ],
    )
    def test_good_listen(self, listen: str, host: str, port: int) -> None:
        """host:port and [v6]:port parse into host and port."""
        assert parse_listen(listen) == (host, port)

    def test_admin_listen_is_checked(self) -> None:
        """admin.listen follows the same rules."""
        assert "admin.listen" in load_error(None, {"HL7_AGENT_ADMIN__LISTEN": "127.0.0.1"})

    def test_tls_pair(self) -> None:
        """tls_cert without tls_key is refused."""
        with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
            ChannelSettings(name="a", listen="0.0.0.0:1", tls_cert=Path("/c.pem"))


class TestCrossChecks:
    def test_retention_below_dedupe_window(self) -> None:
        """retention must be >= dedupe_window, and the error says which values clash."""
        message = load_error(None, {"HL7_AGENT_QUEUE__RETENTION": "1d"})
        assert "queue: retention (1d) must be >= dedupe_window (7d)" in message
        assert "HL7_AGENT_QUEUE__RETENTION" in message

    def test_heartbeat_below_ttl(self, tmp_path: Path) -> None:
        """dispatch.lease_heartbeat must be below lease_ttl."""
        message = load_error(write(tmp_path, "[dispatch]\nlease_ttl = 10\nlease_heartbeat = 10\n"))
        assert "lease_heartbeat (10s) must be below lease_ttl (10s)" in message

    def test_url_scheme(self) -> None:
        """server.url must be ws:// or wss://."""
        for url in ("http://x/agent", "ws:///nohost", "x"):
            assert "server.url" in load_error(None, {"HL7_AGENT_SERVER__URL": url})

    def test_url_port_in_range(self) -> None:
        """A port urlsplit cannot read is caught at load, not at the first connect."""
        assert "port outside 0-65535" in load_error(None, {"HL7_AGENT_SERVER__URL": "wss://h:99999/x"})

    def test_tls_files_with_a_plain_ws_url_are_refused(self, tmp_path: Path) -> None:
        """A security setting is never silently ignored: ca_file/client_cert/client_key need wss://."""
        for name in ("ca", "cert", "key"):
            (tmp_path / name).write_text("x", encoding="utf-8")
        text = '[server]\nurl = "ws://up.example:80/agent"\nca_file = "ca"\n'
        assert "ca_file is set but url is ws:// (no TLS), so it would be ignored" in load_error(write(tmp_path, text))
        text = '[server]\nurl = "WS://up.example/agent"\nclient_cert = "cert"\nclient_key = "key"\n'
        assert "client_cert and client_key are set but url is ws://" in load_error(write(tmp_path, text))
        text = '[server]\nurl = "wss://up.example/agent"\nca_file = "ca"\n'
        assert load_settings(str(write(tmp_path, text)), {}).server.ca_file == tmp_path / "ca"

    def test_proxy(self) -> None:
        """server.proxy is "none" or an http(s) URL."""
        assert load_settings(None, {"HL7_AGENT_SERVER__PROXY": "NONE"}).server.proxy == "none"
        proxy = "http://proxy:3128"
        assert load_settings(None, {"HL7_AGENT_SERVER__PROXY": proxy}).server.proxy == proxy
        assert "server.proxy" in load_error(None, {"HL7_AGENT_SERVER__PROXY": "socks5://p:1"})
        # A bad port is one line naming the key (check-config once crashed with a traceback, and run
        # never connected, saying nothing); the password in it stays masked.
        message = load_error(None, {"HL7_AGENT_SERVER__PROXY": "http://u:pw@127.0.0.1:99999"})
        assert "server.proxy" in message and "port outside 0-65535" in message and "pw" not in message


class TestToken:
    def test_token_and_token_file_together(self, tmp_path: Path) -> None:
        """Setting both token and token_file is an error."""
        (tmp_path / "tok").write_text("a\n", encoding="utf-8")
        text = '[server]\ntoken = "a"\ntoken_file = "tok"\n'
        message = load_error(write(tmp_path, text))
        assert "token and token_file are both set" in message
        assert "s3cret" not in message

    def test_token_file_is_read_fresh(self, tmp_path: Path) -> None:
        """token_value() re-reads the file each time and strips the trailing newline."""
        token = tmp_path / "tok"
        token.write_text("first\n", encoding="utf-8")
        settings = load_settings(str(write(tmp_path, '[server]\ntoken_file = "tok"\n')), {})
        assert settings.server.token_value() == "first"
        token.write_text("second\r\n", encoding="utf-8")
        assert settings.server.token_value() == "second"

    def test_missing_token_file(self, tmp_path: Path) -> None:
        """A token_file that cannot be read is a config error at load."""
        message = load_error(write(tmp_path, '[server]\ntoken_file = "nope"\n'))
        assert "server.token_file: cannot read" in message

    def test_empty_token_file(self, tmp_path: Path) -> None:
        """An empty token file is refused rather than sent as an empty bearer token."""
        (tmp_path / "tok").write_text("\n", encoding="utf-8")
        message = load_error(write(tmp_path, '[server]\ntoken_file = "tok"\n'))
        assert "is empty" in message

    def test_token_never_in_validation_errors(self, tmp_path: Path) -> None:
        """A type error on the token does not echo it."""
        message = load_error(write(tmp_path, "[server]\ntoken = 123456789\n"))
        assert "server.token" in message
        assert "123456789" not in message


class TestRender:
    def test_render_masks_secrets(self, tmp_path: Path) -> None:
        """The effective config never contains the token or a URL password."""
        path = write(tmp_path, MINIMAL.replace("ws://127.0.0.1", "ws://user:pw-123@127.0.0.1"))
        text = render_effective(load_settings(str(path), {}))
        assert "s3cret-token" not in text
        assert "pw-123" not in text
        assert 'token = "***"' in text
        assert "user:***@127.0.0.1:8080" in text

    def test_render_masks_the_url_query(self, tmp_path: Path) -> None:
        """A query may carry a credential (?token=…): its values are masked as logs and the page drop it."""
        path = write(tmp_path, MINIMAL.replace("/agent", "/agent?token=QTOKEN-55&site=north"))
        text = render_effective(load_settings(str(path), {}))
        assert "QTOKEN-55" not in text and "token=***&site=***" in text

    def test_render_shows_token_file_path(self, tmp_path: Path) -> None:
        """token_file is shown as its path, never its content."""
        (tmp_path / "tok").write_text("file-secret\n", encoding="utf-8")
        path = write(tmp_path, '[server]\ntoken_file = "tok"\n')
        text = render_effective(load_settings(str(path), {}))
        assert f'token_file = "{tmp_path / "tok"}"' in text
        assert "file-secret" not in text

    def test_render_has_every_key(self, tmp_path: Path) -> None:
        """Every key of every section and channel is rendered, defaults included."""
        settings = load_settings(str(write(tmp_path, MINIMAL)), {})
        text = render_effective(settings)
        for name, model in config_module._SECTIONS.items():
            assert f"[{name}]" in text
            for key in model.model_fields:
                assert f"{key} = " in text or f"# {key} is not set" in text, key
        assert text.count("[[channels]]") == 2
        for key in ChannelSettings.model_fields:
            assert f"{key} = " in text or f"# {key} is not set" in text, key

    def test_render_round_trips(self, tmp_path: Path) -> None:
        """The rendered TOML parses and loads back to the same settings (token masked)."""
        settings = load_settings(str(write(tmp_path, MINIMAL)), {})
        text = render_effective(settings)
        tomllib.loads(text)
        again = load_settings(str(write(tmp_path, text, "effective.toml")), {})
        assert again.model_dump(exclude={"server": {"token"}}) == settings.model_dump(
            exclude={"server": {"token"}}
        )

    def test_render_notes_env_origin(self) -> None:
        """Values set from the environment are marked with their variable."""
        text = render_effective(load_settings(None, {"HL7_AGENT_ADMIN__LISTEN": ""}))
        assert "# admin endpoint disabled; from HL7_AGENT_ADMIN__LISTEN" in text
        assert "loaded from: environment only" in text


class TestResolveConfigPath:
    def test_cli_wins(self, tmp_path: Path) -> None:
        """--config beats HL7_AGENT_CONFIG."""
        env = {"HL7_AGENT_CONFIG": "/from/env.toml"}
        assert resolve_config_path("/from/cli.toml", env) == Path("/from/cli.toml")

    def test_env_next(self) -> None:
        """HL7_AGENT_CONFIG is used when --config is absent."""
        assert resolve_config_path(None, {"HL7_AGENT_CONFIG": "/e.toml"}) == Path("/e.toml")

    def test_default_file_if_present(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """The default /etc path is used only when it exists."""
        default = tmp_path / "agent.toml"
        monkeypatch.setattr(config_module, "DEFAULT_CONFIG_PATH", default)
        assert resolve_config_path(None, {}) is None
        default.write_text("", encoding="utf-8")
        assert resolve_config_path(None, {}) == default

    def test_empty_env_value_falls_through_but_an_empty_flag_does_not(self) -> None:
        """An empty HL7_AGENT_CONFIG counts as not given (docs: an empty value unsets); ``--config ""`` is an error."""
        assert resolve_config_path(None, {"HL7_AGENT_CONFIG": ""}) is None
        with pytest.raises(ConfigError, match="--config is empty"):
            resolve_config_path("", {})


class TestSettingsInCode:
    def test_direct_construction_ignores_the_environment(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Settings(...) validates only what it is given (deterministic for tests)."""
        monkeypatch.setenv("HL7_AGENT_SERVER__URL", "ws://leaked:1/")
        settings = Settings(channels=[ChannelSettings(name="adt", listen="127.0.0.1:0")])
        assert settings.server.url is None
        assert settings.channel("adt").port == 0

"""Configuration: one TOML file plus ``HL7_AGENT_<SECTION>__<KEY>`` overrides (SPEC 3).

The models are pydantic-settings ``BaseSettings``/pydantic models. :func:`load_settings`
reads the file with pydantic-settings' ``TomlConfigSettingsSource`` and the
environment with its ``EnvSettingsSource`` (prefix ``HL7_AGENT_``, nested
delimiter ``__``, names case-insensitive) over an *explicitly passed* mapping,
so that tests, ``check-config`` and the daemon all see the same environment;
the environment wins over the file. Kept here is only what pydantic-settings
does not do: it silently ignores a prefixed variable whose section is unknown
(``HL7_AGENT_SERVERR__URL``) and lets the last of two spellings of one name
win, where every unknown key must be an error; its ``BaseSettings.__init__``
drops the validation context (below); and its errors do not say where a value
came from.

Errors are :class:`agent.errors.ConfigError` with one line naming the key, the
problem and where the value came from, e.g.::

    config error: channels[1].name: 'ADT' must match [a-z0-9_-]+ (file /etc/hl7-agent/agent.toml)

Validation context (set by :func:`load_settings` only):

- ``base_dir``: relative paths are made absolute against it (the config file's
  folder, or the working directory when there is no file);
- ``strict_ports``: ``listen`` ports must be 1-65535. Models built directly in
  code (tests) may use port 0, "any free port", which a config file may not:
  senders could never find it.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import math
import os
import re
import socket
import tomllib
from collections.abc import Mapping
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)
from pydantic_settings.sources import ConfigFileSourceType
from pydantic_settings.sources.utils import parse_env_vars

from agent.addresses import parse_listen
from agent.envelope import resolve_codec
from agent.errors import ConfigError, UnsupportedCharset

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "ENV_PREFIX",
    "NON_KEY_VARIABLES",
    "AdminSettings",
    "AgentSettings",
    "ByteSize",
    "ChannelSettings",
    "DispatchSettings",
    "Duration",
    "LoggingSettings",
    "QueueSettings",
    "ServerSettings",
    "Settings",
    "load_settings",
    "parse_byte_size",
    "parse_duration",
    "parse_listen",
    "render_effective",
    "resolve_config_path",
    "security_features_unavailable",
]

DEFAULT_CONFIG_PATH = Path("/etc/hl7-agent/agent.toml")
ENV_PREFIX = "HL7_AGENT_"
CONFIG_ENV = "HL7_AGENT_CONFIG"
CHANNELS_ENV = "HL7_AGENT_CHANNELS"
# Prefixed variables that are not configuration keys (SPEC 3). Anything else
# starting with HL7_AGENT_ must name a known <SECTION>__<KEY>.
NON_KEY_VARIABLES = frozenset({CONFIG_ENV, CHANNELS_ENV, "HL7_AGENT_DEV_TOKEN"})

KiB = 1024
MiB = 1024 * KiB

# --------------------------------------------------------------------------
# Value parsers (pure; also used by the CLI, e.g. `queue purge --older-than`)
# --------------------------------------------------------------------------

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)", re.IGNORECASE)
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def parse_duration(value: object) -> float:
    """Seconds from a number or ``500ms``/``30s``/``5m``/``2h``/``7d`` (also ``1h30m``).

    Returns float seconds because every consumer hands it to asyncio or SQLite
    timeouts. Negative and non-finite values are refused.
    """
    if isinstance(value, bool):
        # ValueError, not TypeError: pydantic reports only ValueError as a validation error.
        raise ValueError(f"{value!r} is not a duration; use seconds or 30s/5m/2h/7d")  # noqa: TRY004
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        if _NUMBER.fullmatch(text):
            seconds = float(text)
        else:
            compact = text.replace(" ", "")
            parts = _DURATION_PART.findall(compact)
            if not parts or "".join(n + u for n, u in parts).lower() != compact.lower():
                raise ValueError(f"{value!r} is not a duration; use seconds or 500ms/30s/5m/2h/7d")
            seconds = sum(float(n) * _DURATION_UNITS[u.lower()] for n, u in parts)
    else:
        raise ValueError(f"{value!r} is not a duration; use seconds or 30s/5m/2h/7d")  # noqa: TRY004
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{value!r} must be a finite duration >= 0")
    return seconds


# Decimal (SI) and binary (IEC) units; a bare K/M/G is ambiguous and refused.
_BYTE_UNITS = {
    "": 1, "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": KiB, "mib": MiB, "gib": 1024**3, "tib": 1024**4,
}  # fmt: skip
_BYTE_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]*)", re.IGNORECASE)


def parse_byte_size(value: object) -> int:
    """Bytes from an integer or ``64KiB``/``10MiB``/``1GiB``/``10MB`` (KB = 1000, KiB = 1024)."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size; use bytes or 64KiB/10MiB/1GiB")  # noqa: TRY004
    if isinstance(value, int):
        size = value
    elif isinstance(value, float) and value.is_integer():
        size = int(value)
    elif isinstance(value, str):
        match = _BYTE_SIZE.fullmatch(value.strip())
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _BYTE_UNITS:
            raise ValueError(f"{value!r} is not a size; use bytes or 64KiB/10MiB/1GiB/10MB")
        size = int(float(match.group(1)) * _BYTE_UNITS[unit])
    else:
        raise ValueError(f"{value!r} is not a size; use bytes or 64KiB/10MiB/1GiB/10MB")
    if size < 0:
        raise ValueError(f"{value!r} must be >= 0")
    return size


def _check_encoding(name: str) -> None:
    """Validate with the hot path's own resolver, so config and intake agree on names.

    Only real character sets: HL7 table 0211 names and Python names of those
    same encodings — never a Python codec that is a transform (``idna``,
    ``rot13``, ``base64``) or that HL7 forbids over MLLP (UTF-16/32).
    """
    try:
        resolve_codec("", name)
    except UnsupportedCharset as exc:
        raise ValueError(
            f"{exc.text}; use an HL7 table 0211 name (8859/1, UNICODE UTF-8, ASCII, ...) "
            "or a Python name of the same encoding (latin-1, utf-8, ...)"
        ) from None


# --------------------------------------------------------------------------
# Types
# --------------------------------------------------------------------------

Duration = Annotated[float, BeforeValidator(parse_duration)]
"""Seconds (float); accepts numbers and ``500ms``/``30s``/``5m``/``2h``/``7d``."""
PositiveDuration = Annotated[float, BeforeValidator(parse_duration), Field(gt=0)]
ByteSize = Annotated[int, BeforeValidator(parse_byte_size)]
"""Bytes (int); accepts integers and ``64KiB``/``10MiB``/``1GiB``/``10MB``."""


def _lower(value: object) -> object:
    return value.strip().lower() if isinstance(value, str) else value


def _empty_is_none(value: object) -> object:
    """An empty string unsets an optional key (lets an env variable switch it off)."""
    return None if isinstance(value, str) and not value.strip() else value


OptionalPath = Annotated[Path | None, BeforeValidator(_empty_is_none)]


def _absolute(path: Path | None, info: ValidationInfo) -> Path | None:
    """Relative paths are relative to the config file's folder (SPEC 3)."""
    if path is None or path.is_absolute():
        return path
    base = (info.context or {}).get("base_dir")
    return Path(base) / path if base is not None else path


def _default_agent_id() -> str:
    """The host name, trimmed to the id alphabet, so a fresh install has a stable id."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64]
    return name or "hl7-agent"


class _Section(BaseModel):
    """Every section refuses unknown keys (SPEC 3: a typo must not be ignored)."""

    model_config = ConfigDict(extra="forbid", validate_default=False)


# --------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------


class LoggingSettings(_Section):
    level: Annotated[Literal["debug", "info", "warning", "error"], BeforeValidator(_lower)] = "info"
    format: Annotated[Literal["json", "console"], BeforeValidator(_lower)] = "json"


class AgentSettings(_Section):
    # Stable identity sent to the server and recorded in the queue database.
    id: str = Field(default_factory=_default_agent_id)
    data_dir: Path = Path("/var/lib/hl7-agent")
    # SO_REUSEPORT is the fallback listener-sharing mode (SPEC 7).
    reuse_port: bool = False
    # Graceful stop budget; keep it below systemd's TimeoutStopSec.
    shutdown_budget: PositiveDuration = 20.0

    @field_validator("id", mode="before")
    @classmethod
    def _id_alphabet(cls, value: object) -> object:
        if isinstance(value, str) and not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", value.strip()):
            raise ValueError(f"{value!r} must be 1-64 characters of [A-Za-z0-9._-]")
        return value

    @field_validator("data_dir", mode="after")
    @classmethod
    def _resolve_data_dir(cls, value: Path, info: ValidationInfo) -> Path:
        return _absolute(value, info) or value


def _mask_url(url: str) -> str:
    """Hide a password in a URL's userinfo before it is printed."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}"
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


class ServerSettings(_Section):
    # None = intake only: messages queue up until an upstream is configured.
    url: Annotated[str | None, BeforeValidator(_empty_is_none)] = None
    token: Annotated[SecretStr | None, BeforeValidator(_empty_is_none)] = None
    token_file: OptionalPath = None
    ca_file: OptionalPath = None
    client_cert: OptionalPath = None
    client_key: OptionalPath = None
    connect_timeout: PositiveDuration = 10.0
    response_timeout: PositiveDuration = 30.0
    application_ack_timeout: PositiveDuration = 30.0
    proxy: str = "none"
    ping_interval: PositiveDuration = 20.0

    @field_validator("url")
    @classmethod
    def _ws_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value.strip())
        if parts.scheme.lower() not in ("ws", "wss") or not parts.hostname:
            raise ValueError(
                f"{_mask_url(value)!r} must be a ws:// or wss:// URL with a host, "
                "e.g. wss://hl7.example.org/agent"
            )
        return value.strip()

    @field_validator("proxy")
    @classmethod
    def _proxy(cls, value: str) -> str:
        if value.strip().lower() == "none":
            return "none"
        parts = urlsplit(value.strip())
        if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f'{_mask_url(value)!r} must be "none" or an http:// or https:// proxy URL'
            )
        return value.strip()

    @field_validator("token_file", "ca_file", "client_cert", "client_key", mode="after")
    @classmethod
    def _resolve_paths(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        return _absolute(value, info)

    @model_validator(mode="after")
    def _one_token_source(self) -> ServerSettings:
        if self.token is not None and self.token_file is not None:
            raise ValueError("token and token_file are both set; keep only one")
        if self.client_key is not None and self.client_cert is None:
            raise ValueError("client_key is set without client_cert; set both")
        return self

    def token_value(self) -> str | None:
        """The bearer token, read from ``token_file`` on every call so rotation needs no restart."""
        if self.token_file is not None:
            try:
                text = self.token_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                raise ConfigError(
                    f"config error: server.token_file: cannot read {self.token_file}: {reason}"
                ) from None
            token = text.rstrip("\r\n")
            if not token.strip():
                raise ConfigError(f"config error: server.token_file: {self.token_file} is empty")
            return token
        if self.token is not None:
            return self.token.get_secret_value()
        return None


class AdminSettings(_Section):
    # /healthz /readyz /metrics; None or "" disables the admin endpoint.
    listen: Annotated[str | None, BeforeValidator(_empty_is_none)] = "127.0.0.1:9575"

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None:
            strict = bool((info.context or {}).get("strict_ports"))
            parse_listen(value, allow_port_zero=not strict)
            return value.strip()
        return value

    @property
    def address(self) -> tuple[str, int] | None:
        """``(host, port)`` to bind, or None when disabled."""
        return parse_listen(self.listen, allow_port_zero=True) if self.listen else None


class QueueSettings(_Section):
    synchronous: Annotated[Literal["full", "normal"], BeforeValidator(_lower)] = "full"
    dedupe_window: Duration = 7 * 86400.0
    retention: Duration = 30 * 86400.0
    max_db_bytes: ByteSize = 0  # 0 = no cap
    min_free_disk_bytes: ByteSize = 256 * MiB
    busy_timeout: PositiveDuration = 5.0
    checkpoint_interval: PositiveDuration = 60.0
    retention_interval: PositiveDuration = 300.0

    @model_validator(mode="after")
    def _retention_covers_dedupe(self) -> QueueSettings:
        # SPEC 6: purging a row must never forget a dedupe key before its window.
        if self.retention < self.dedupe_window:
            raise ValueError(
                f"retention ({_human(self.retention)}) must be >= dedupe_window "
                f"({_human(self.dedupe_window)})"
            )
        return self


class DispatchSettings(_Section):
    lease_ttl: PositiveDuration = 30.0
    lease_heartbeat: PositiveDuration = 10.0
    lease_acquire_interval: PositiveDuration = 2.0
    retry_initial: PositiveDuration = 1.0
    retry_cap: PositiveDuration = 60.0

    @model_validator(mode="after")
    def _ordering(self) -> DispatchSettings:
        # A heartbeat at or above the TTL lets the lease lapse between renewals.
        if self.lease_heartbeat >= self.lease_ttl:
            raise ValueError(
                f"lease_heartbeat ({_human(self.lease_heartbeat)}) must be below lease_ttl "
                f"({_human(self.lease_ttl)})"
            )
        if self.retry_initial > self.retry_cap:
            raise ValueError(
                f"retry_initial ({_human(self.retry_initial)}) must be <= retry_cap "
                f"({_human(self.retry_cap)})"
            )
        return self


class ChannelSettings(_Section):
    name: str
    listen: str
    ack: Annotated[Literal["commit", "application"], BeforeValidator(_lower)] = "commit"
    guaranteed_delivery: bool = False
    max_message_bytes: Annotated[ByteSize, Field(ge=KiB, le=64 * MiB)] = 1048576
    encoding: str = "utf-8"
    assign_sequence_numbers: bool = False
    on_reject: Annotated[Literal["continue", "pause"], BeforeValidator(_lower)] = "continue"
    max_attempts: int = Field(default=0, ge=0)  # 0 = retry forever
    tls_cert: OptionalPath = None
    tls_key: OptionalPath = None
    tls_client_ca: OptionalPath = None
    allowed_sources: list[str] = Field(default_factory=list)
    max_connections: int = Field(default=64, ge=1)
    idle_timeout: Duration = 0.0  # 0 = never close an idle connection
    # One sender address holds at most this many of the channel's connections
    # (16: a quarter of the default channel, far above the 1-4 an interface
    # engine opens), so one host's busy connections cannot fill a channel.
    max_connections_per_source: int = Field(default=16, ge=1)
    # A started frame must complete within this (slowloris). 60 s carries a
    # 1 MiB message over a ~150 kbit/s link; never 0: the guard cannot be off.
    frame_timeout: PositiveDuration = 60.0
    # What the channel accepts (SPEC 4: AR/CR with ERR-3 200-203 otherwise);
    # empty = anything. "ADT" allows every ADT event, "ADT^A01" only that one.
    accept_message_types: list[str] = Field(default_factory=list)
    accept_processing_ids: list[str] = Field(default_factory=list)
    accept_versions: list[str] = Field(default_factory=list)  # "2.5" also admits "2.5.1"

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not re.fullmatch(r"[a-z0-9_-]+", value):
            raise ValueError(f"{value!r} must match [a-z0-9_-]+")
        return value

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str, info: ValidationInfo) -> str:
        strict = bool((info.context or {}).get("strict_ports"))
        parse_listen(value, allow_port_zero=not strict)
        return value.strip()

    @field_validator("encoding")
    @classmethod
    def _encoding(cls, value: str) -> str:
        _check_encoding(value)
        return value

    @field_validator("accept_message_types")
    @classmethod
    def _message_types(cls, value: list[str]) -> list[str]:
        cleaned = [item.strip().upper() for item in value]
        for item in cleaned:
            if not re.fullmatch(r"[A-Z0-9]{3}(\^[A-Z0-9]{1,7})?", item):
                raise ValueError(f"{item!r} must be a message code or code^event, e.g. ADT or ADT^A01")
        return cleaned

    @field_validator("accept_processing_ids", "accept_versions")
    @classmethod
    def _plain_values(cls, value: list[str]) -> list[str]:
        cleaned = [item.strip() for item in value]
        if any(not item for item in cleaned):
            raise ValueError("entries must not be empty")
        return cleaned

    @field_validator("allowed_sources")
    @classmethod
    def _cidrs(cls, value: list[str]) -> list[str]:
        networks = []
        for item in value:
            try:
                networks.append(str(ipaddress.ip_network(item.strip(), strict=False)))
            except ValueError:
                raise ValueError(
                    f"{item!r} is not an IP address or CIDR network, e.g. 10.1.0.0/16"
                ) from None
        return networks

    @field_validator("tls_cert", "tls_key", "tls_client_ca", mode="after")
    @classmethod
    def _resolve_paths(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        return _absolute(value, info)

    @model_validator(mode="after")
    def _tls_pair(self) -> ChannelSettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together; set both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca needs tls_cert and tls_key")
        return self

    @property
    def host(self) -> str:
        """The listen host, IPv6 brackets removed."""
        return parse_listen(self.listen, allow_port_zero=True)[0]

    @property
    def port(self) -> int:
        return parse_listen(self.listen, allow_port_zero=True)[1]


_WILDCARDS = frozenset({"0.0.0.0", "::"})


def _addresses_clash(a: tuple[str, int], b: tuple[str, int]) -> bool:
    """Same port and same host, or either side binds every address."""
    if a[1] != b[1] or a[1] == 0:
        return False
    return a[0] == b[0] or a[0] in _WILDCARDS or b[0] in _WILDCARDS


class Settings(BaseSettings):
    """The whole configuration. Build it with :func:`load_settings`.

    ``Settings(...)`` validates only the values it is given (no environment,
    no file): deterministic for tests; :func:`load_settings` adds the file and
    the environment with SPEC 3's strictness.
    """

    # Keys are matched exactly: the file's [SERVER] is an unknown section, not
    # [server]. Variable names are case-insensitive: see _EnvironSource.
    model_config = SettingsConfigDict(case_sensitive=True, extra="forbid")

    agent: AgentSettings = Field(default_factory=AgentSettings)
    server: ServerSettings = Field(default_factory=ServerSettings)
    admin: AdminSettings = Field(default_factory=AdminSettings)
    logging: LoggingSettings = Field(default_factory=LoggingSettings)
    queue: QueueSettings = Field(default_factory=QueueSettings)
    dispatch: DispatchSettings = Field(default_factory=DispatchSettings)
    channels: list[ChannelSettings] = Field(default_factory=list)

    _config_path: Path | None = PrivateAttr(default=None)
    _env_sources: dict[str, str] = PrivateAttr(default_factory=dict)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Only what is passed in. load_settings runs the file and environment
        # sources itself, so that the sections are validated with its context.
        return (init_settings,)

    @model_validator(mode="after")
    def _channels_distinct(self) -> Settings:
        seen_names: dict[str, int] = {}
        seen_addrs: list[tuple[int, tuple[str, int]]] = []
        for index, channel in enumerate(self.channels):
            if channel.name in seen_names:
                raise ValueError(
                    f"channels[{index}].name: {channel.name!r} is already used by "
                    f"channels[{seen_names[channel.name]}]; channel names must be unique"
                )
            seen_names[channel.name] = index
            address = (channel.host, channel.port)
            for other_index, other in seen_addrs:
                if _addresses_clash(address, other):
                    raise ValueError(
                        f"channels[{index}].listen: {channel.listen!r} overlaps "
                        f"channels[{other_index}].listen; give each channel its own port"
                    )
            if self.admin.address is not None and _addresses_clash(address, self.admin.address):
                raise ValueError(
                    f"channels[{index}].listen: {channel.listen!r} overlaps admin.listen "
                    f"{self.admin.listen!r}"
                )
            seen_addrs.append((index, address))
        return self

    @property
    def config_path(self) -> Path | None:
        """The file this was loaded from (None: environment only). Not a key."""
        return self._config_path

    @property
    def db_path(self) -> Path:
        return self.agent.data_dir / "queue.db"

    def channel(self, name: str) -> ChannelSettings:
        """The channel called ``name``; ConfigError (a usage error, exit 2) if there is none."""
        for channel in self.channels:
            if channel.name == name:
                return channel
        known = ", ".join(c.name for c in self.channels) or "none"
        raise ConfigError(f"config error: no channel named {name!r} (configured: {known})")


def security_features_unavailable(settings: Settings) -> list[str]:
    """Security keys set before their feature exists (SPEC 3); the lead decides which."""
    return []


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------

_SECTIONS: dict[str, type[BaseModel]] = {
    "agent": AgentSettings,
    "server": ServerSettings,
    "admin": AdminSettings,
    "logging": LoggingSettings,
    "queue": QueueSettings,
    "dispatch": DispatchSettings,
}


_SECTION_MODELS: dict[str, type[BaseModel]] = {**_SECTIONS, "channels": ChannelSettings}


def _env_name(section: str, key: str) -> str:
    return f"{ENV_PREFIX}{section.upper()}__{key.upper()}"


def _known_env_names() -> list[str]:
    names = [_env_name(s, k) for s, model in _SECTIONS.items() for k in model.model_fields]
    return [*names, *sorted(NON_KEY_VARIABLES)]


def _suggest(word: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else ""


def resolve_config_path(
    cli_value: str | None, environ: Mapping[str, str] = os.environ
) -> Path | None:
    """``--config``, else ``HL7_AGENT_CONFIG``, else the default file if it exists, else None.

    An explicitly named file is returned even when missing: :func:`load_settings`
    reports that as an error rather than silently running on defaults.
    """
    if cli_value:
        return Path(cli_value)
    from_env = _env_lookup(environ, CONFIG_ENV)
    if from_env:
        return Path(from_env)
    if DEFAULT_CONFIG_PATH.is_file():
        return DEFAULT_CONFIG_PATH
    return None


def _env_lookup(environ: Mapping[str, str], name: str) -> str | None:
    """Case-insensitive variable lookup (SPEC 3 names are case-insensitive)."""
    for key, value in environ.items():
        if key.upper() == name:
            return value
    return None


class _NamedTomlFile(TomlConfigSettingsSource):
    """pydantic-settings' TOML source for the one file that was named.

    pydantic-settings skips a file that is missing or not a regular file; the
    named file is read whatever it is (``--config <(envsubst <agent.toml.in)``
    is a pipe), so a missing one is an error, never a silent fall-back to defaults.
    """

    @staticmethod
    def _existing_files(files: ConfigFileSourceType | None) -> list[Path | Traversable]:
        if isinstance(files, Path):
            return [files]
        return TomlConfigSettingsSource._existing_files(files)


class _EnvironSource(EnvSettingsSource):
    """pydantic-settings' environment source over ``environ`` instead of ``os.environ``."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self._environ = environ  # read by _load_env_vars, which the base __init__ calls
        super().__init__(
            Settings, case_sensitive=False, env_prefix=ENV_PREFIX, env_nested_delimiter="__"
        )

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(
            self._environ, self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str
        )


def _read_file(path: Path, named_by: str) -> dict[str, Any]:
    """The file's tables, in the file's order (the first error reported is the first in it)."""
    try:
        source = _NamedTomlFile(Settings, toml_file=path)
    except FileNotFoundError:
        # An explicitly named file is never silently replaced by defaults.
        raise ConfigError(
            f"config error: config file {path} does not exist (named by {named_by})"
        ) from None
    except IsADirectoryError:
        raise ConfigError(f"config error: config file {path} is a directory") from None
    except OSError as exc:
        raise ConfigError(f"config error: cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config error: {path} is not valid TOML: {exc}") from None
    values = source()
    return {key: values[key] for key in source.toml_data if key in values} | values


def _screen_environment(environ: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """The ``HL7_AGENT_`` variables that set keys, and key -> variable name; ConfigError otherwise."""
    variables: dict[str, str] = {}
    sources: dict[str, str] = {}
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX):
            continue
        value = environ[name]
        if upper == CHANNELS_ENV:
            if value.strip():
                variables[name] = value
                sources["channels"] = name
            continue
        if upper in NON_KEY_VARIABLES:
            continue
        section, sep, key = upper[len(ENV_PREFIX) :].lower().partition("__")
        model = _SECTIONS.get(section)
        if not sep or model is None or key not in model.model_fields:
            hint = _suggest(upper, _known_env_names())
            raise ConfigError(f"config error: {name} is not a known key{hint}")
        dotted = f"{section}.{key}"
        if dotted in sources:
            raise ConfigError(
                f"config error: {name} and {sources[dotted]} set the same key; keep one"
            )
        variables[name] = value
        sources[dotted] = name
    return variables, sources


_CHANNELS_EXAMPLE = '[{"name": "adt", "listen": "0.0.0.0:2575"}]'


def _read_environment(environ: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Section overrides and the channel list from ``environ``, and key -> variable name."""
    variables, sources = _screen_environment(environ)
    try:
        values = _EnvironSource(variables)()
    except SettingsError as exc:
        # Only the channel list is JSON (every section key is a scalar).
        cause = exc.__cause__
        if "channels" not in sources or not isinstance(cause, json.JSONDecodeError):
            raise ConfigError(f"config error: {exc}: {cause}") from None
        raise ConfigError(
            f"config error: {sources['channels']} is not valid JSON "
            f"({cause.msg} at column {cause.colno}); expected a list like {_CHANNELS_EXAMPLE}"
        ) from None
    if "channels" in sources:
        channels = values.get("channels")  # JSON null: the source leaves it out
        if not isinstance(channels, list) or not all(isinstance(c, dict) for c in channels):
            raise ConfigError(
                f"config error: {sources['channels']} must be a JSON list of channel objects, "
                f"e.g. {_CHANNELS_EXAMPLE}"
            )
    return values, sources


def _merge(
    file_values: dict[str, Any], env_values: dict[str, Any], sources: dict[str, str]
) -> dict[str, Any]:
    """The environment over the file: a section key by key, the channel list whole.

    Sections the file does not have follow in the order of their variables' names,
    the channel list last.
    """
    data = dict(file_values)
    order = dict.fromkeys([*(k.partition(".")[0] for k in sources if k != "channels"), "channels"])
    for section in order:
        if section not in env_values:
            continue
        value = env_values[section]
        current = data.get(section)
        # A section the file gives as a non-table value is replaced by the environment's.
        if isinstance(current, dict) and isinstance(value, dict):
            value = {**current, **value}
        data[section] = value
    return data


def load_settings(
    cli_value: str | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Load the file (SPEC 3 fallback order) and apply the environment; ConfigError if invalid."""
    env = os.environ if environ is None else environ
    path = resolve_config_path(cli_value, env)
    named_by = (
        "--config" if cli_value else (CONFIG_ENV if _env_lookup(env, CONFIG_ENV) else "default")
    )
    file_values = _read_file(path, named_by) if path is not None else {}
    env_values, sources = _read_environment(env)
    data = _merge(file_values, env_values, sources)
    base_dir = path.absolute().parent if path is not None else Path.cwd()
    settings = _validate(data, {"base_dir": base_dir, "strict_ports": True}, path, sources)
    settings._config_path = path
    settings._env_sources = sources
    if settings.server.token_file is not None:
        settings.server.token_value()  # a missing or empty token file is a config error now
    _check_files_exist(settings, sources, path)
    return settings


def _check_files_exist(settings: Settings, sources: dict[str, str], path: Path | None) -> None:
    """Certificate files must exist at start, not at the first TLS handshake hours later."""
    checks: list[tuple[str, Path | None]] = [
        (f"server.{key}", getattr(settings.server, key))
        for key in ("ca_file", "client_cert", "client_key")
    ]
    for index, channel in enumerate(settings.channels):
        checks += [
            (f"channels[{index}].{key}", getattr(channel, key))
            for key in ("tls_cert", "tls_key", "tls_client_ca")
        ]
    for dotted, file in checks:
        if file is not None and not file.is_file():
            origin = _origin(dotted, sources, path)
            raise ConfigError(f"config error: {dotted}: file {file} does not exist{origin}")


def _validate(
    data: dict[str, Any], context: dict[str, Any], path: Path | None, sources: dict[str, str]
) -> Settings:
    """Validate section by section with ``context``, then the whole.

    ``Settings.model_validate(data, context=...)`` would lose the context:
    BaseSettings has its own ``__init__``, which pydantic calls without it. The
    sections are plain models, so they are validated here and handed over as
    instances (not validated again).
    """
    parts: dict[str, Any] = {}
    for key, value in data.items():
        prefix: tuple[int | str, ...] = (key,)
        try:
            if key == "channels" and isinstance(value, list):
                channels = []
                for index, item in enumerate(value):
                    prefix = (key, index)
                    channels.append(ChannelSettings.model_validate(item, context=context))
                parts[key] = channels
            elif key in _SECTIONS:
                parts[key] = _SECTIONS[key].model_validate(value, context=context)
            elif key == "channels":
                parts[key] = value  # wrong shape: Settings reports it
            else:
                # Reported here: Settings(**parts) would take "_env_file" and the like
                # as pydantic-settings arguments instead of unknown keys.
                hint = _suggest(key, list(Settings.model_fields))
                origin = f" (file {path})" if path is not None else ""
                raise ConfigError(f"config error: {key}: is not a known section{hint}{origin}")
        except ValidationError as exc:
            raise ConfigError(_describe(exc, path, sources, prefix)) from None
    try:
        return Settings(**parts)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, path, sources)) from None


def _origin(dotted: str, sources: dict[str, str], path: Path | None) -> str:
    """Where the failing value came from: the file, or the variable that set it."""
    if dotted.startswith("channels") and "channels" in sources:
        return f" (env {sources['channels']})"
    if dotted in sources:
        return f" (env {sources[dotted]})"
    # A section-level check (e.g. retention vs dedupe_window) may mix both;
    # a whole-config check (duplicate channels) may involve HL7_AGENT_CHANNELS.
    if not dotted and "channels" in sources:
        return f" (env {sources['channels']})"
    scope = f"{dotted}." if dotted else "channels"
    env_vars = [var for key, var in sources.items() if key.startswith(scope)]
    places = ([f"file {path}"] if path is not None else []) + [f"env {v}" for v in env_vars]
    return f" ({', '.join(places)})" if places else ""


def _loc_text(loc: tuple[int | str, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


_SECRET_KEYS = frozenset({"token"})


def _describe(
    exc: ValidationError,
    path: Path | None,
    sources: dict[str, str],
    prefix: tuple[int | str, ...] = (),
) -> str:
    """One line for the first error: key, problem, fix, origin."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    loc = prefix + tuple(first["loc"])
    dotted = _loc_text(loc)
    message = str(first["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if first["type"] == "extra_forbidden":
        parent: type[BaseModel] | None = Settings
        for part in loc[:-1]:
            if isinstance(part, str) and parent is not None:
                parent = _SECTION_MODELS.get(part)
        known = list(parent.model_fields) if parent is not None else []
        what = "section" if len(loc) == 1 else "key"
        message = f"is not a known {what}{_suggest(str(loc[-1]), known)}"
    elif first["type"] == "missing":
        message = "is required"
    elif (
        first["type"] not in ("value_error", "assertion_error") and not set(loc[-1:]) & _SECRET_KEYS
    ):
        given = repr(first.get("input"))
        message = f"{message} (got {given[:60]})"
    if not dotted:
        # Cross-key checks name their keys in the message themselves.
        line = f"config error: {message}"
    else:
        line = f"config error: {dotted}: {message}"
    origin = _origin(dotted, sources, path)
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return line + origin + more


# --------------------------------------------------------------------------
# Rendering (`hl7-agent check-config`)
# --------------------------------------------------------------------------


def _human(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        # A JSON string is a valid TOML basic string (same escapes).
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot render {type(value).__name__} as TOML")


def _render_section(model: BaseModel, prefix: str, sources: dict[str, str]) -> list[str]:
    lines = []
    for key in type(model).model_fields:
        value = getattr(model, key)
        origin = sources.get(f"{prefix}.{key}")
        note = f"  # from {origin}" if origin else ""
        if isinstance(value, SecretStr):
            lines.append(f'{key} = "***"{note}')
        elif key in ("url", "proxy") and isinstance(value, str):
            lines.append(f"{key} = {_toml_value(_mask_url(value))}{note}")
        elif value is None and prefix == "admin" and key == "listen":
            lines.append(f'listen = ""  # admin endpoint disabled{note.replace("  #", ";")}')
        elif value is None:
            lines.append(f"# {key} is not set{note.replace('  #', ';')}")
        else:
            lines.append(f"{key} = {_toml_value(value)}{note}")
    return lines


def render_effective(settings: Settings) -> str:
    """The effective configuration as TOML: every key, defaults included, secrets masked.

    Durations are rendered in seconds and sizes in bytes, so the output loads
    back as the same configuration (apart from the masked token).
    """
    sources = settings._env_sources
    origin = str(settings.config_path) if settings.config_path else "environment only"
    lines = [
        "# hl7-agent effective configuration (secrets masked)",
        f"# loaded from: {origin}",
        "# durations in seconds, sizes in bytes",
    ]
    for name in _SECTIONS:
        lines += ["", f"[{name}]", *_render_section(getattr(settings, name), name, sources)]
    channel_note = f"  # from {sources['channels']}" if "channels" in sources else ""
    if not settings.channels:
        lines += ["", f"# no channels configured: nothing will be received{channel_note}"]
    for channel in settings.channels:
        lines += ["", f"[[channels]]{channel_note}", *_render_section(channel, "channels", {})]
    return "\n".join(lines) + "\n"

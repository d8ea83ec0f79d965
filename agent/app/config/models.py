"""The configuration models: one pydantic model per section, channels, and the whole.

Over 400 lines on purpose: it is the configuration reference in code, one class
per section, read side by side with docs/configuration.md.

Validation context (set by :func:`agent.app.config.load_settings` only):

- ``base_dir``: relative paths are made absolute against it (the config file's
  folder, or the working directory when there is no file);
- ``strict_ports``: ``listen`` ports must be 1-65535. Models built directly in
  code (tests) may use port 0, "any free port", which a config file may not:
  senders could never find it.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from agent.app.config.values import (
    ByteSize,
    Duration,
    KiB,
    MiB,
    OptionalPath,
    PositiveDuration,
    _check_encoding,
    _empty_is_none,
    _human,
    _lower,
    _mask_url,
)
from agent.core.addresses import parse_listen
from agent.core.partition import PartitionKey, parse_partition_key
from agent.errors import ConfigError
from agent.storage.conninfo import dsn_has_password, mask_dsn


def _absolute(path: Path | None, info: ValidationInfo) -> Path | None:
    """Relative paths are relative to the config file's folder (docs/configuration.md#value-formats)."""
    if path is None or path.is_absolute():
        return path
    base = (info.context or {}).get("base_dir")
    return Path(base) / path if base is not None else path


def _default_agent_id() -> str:
    """The host name, trimmed to the id alphabet, so a fresh install has a stable id."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64]
    return name or "hl7-agent"


class _Section(BaseModel):
    """Every section refuses unknown keys (a typo must not be ignored silently)."""

    model_config = ConfigDict(extra="forbid", validate_default=False)


class LoggingSettings(_Section):
    level: Annotated[Literal["debug", "info", "warning", "error"], BeforeValidator(_lower)] = "info"
    format: Annotated[Literal["json", "console"], BeforeValidator(_lower)] = "json"


class AgentSettings(_Section):
    # Stable identity sent to the server and recorded in the queue database.
    id: str = Field(default_factory=_default_agent_id)
    data_dir: Path = Path("/var/lib/hl7-agent")
    # SO_REUSEPORT is the fallback listener-sharing mode (docs/deploy.md#how-the-listening-sockets-outlive-a-process).
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
        """Resolved once at load (``config/../data`` becomes ``data``), so every command,
        log line and error shows the one path where the queue really is.

        Only this path: a ``token_file`` may be a symlink that is swapped on
        rotation (a Kubernetes secret), so it must be followed on every read.
        """
        path = _absolute(value, info) or value
        if (info.context or {}).get("base_dir") is not None:
            path = path.resolve()
        return path


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
        try:
            parts.port  # noqa: B018 - urlsplit checks the port only when asked
        except ValueError:
            raise ValueError(f"{_mask_url(value)!r} has a port outside 0-65535") from None
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
        try:
            parts.port  # noqa: B018 - urlsplit checks the port only when asked
        except ValueError:
            raise ValueError(f"{_mask_url(value)!r} has a port outside 0-65535") from None
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
        tls = [name for name in ("ca_file", "client_cert", "client_key") if getattr(self, name) is not None]
        if tls and self.url is not None and urlsplit(self.url).scheme.lower() == "ws":
            # A security setting is never silently ignored: ws:// would send
            # the messages (and the token) in the clear.
            one = len(tls) == 1
            raise ValueError(
                f"{' and '.join(tls)} {'is' if one else 'are'} set but url is ws:// (no TLS), so "
                f"{'it' if one else 'they'} would be ignored; use a wss:// URL, or remove {'it' if one else 'them'}"
            )
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


#: Keys that tune the SQLite file and mean nothing on a database server: refused with
#: backend = "postgresql" rather than silently ignored.
#: What a channel's ``name`` may be (it names metrics labels, log fields and CLI arguments).
CHANNEL_NAME = re.compile(r"[a-z0-9_-]+")



def channel_name(item: object) -> str | None:
    """A raw channel table's ``name``, when it is a valid one: errors name the channel by it, not by position."""
    name = item.get("name") if isinstance(item, dict) else None
    return name if isinstance(name, str) and CHANNEL_NAME.fullmatch(name) else None


SQLITE_ONLY_KEYS = ("synchronous", "max_db_bytes", "min_free_disk_bytes", "checkpoint_interval")


class QueueSettings(_Section):
    # "sqlite": queue.db in data_dir (one host). "postgresql": a database several
    # hosts share (docs/ha.md), reached with dsn.
    backend: Annotated[Literal["sqlite", "postgresql"], BeforeValidator(_lower)] = "sqlite"
    # libpq URL or key/value conninfo; a password in it is masked wherever it is shown.
    dsn: Annotated[str | None, BeforeValidator(_empty_is_none)] = None
    # The database password, read at every connect (never on a command line).
    password_file: OptionalPath = None
    synchronous: Annotated[Literal["full", "normal"], BeforeValidator(_lower)] = "full"
    dedupe_window: Duration = 7 * 86400.0
    retention: Duration = 30 * 86400.0
    max_db_bytes: ByteSize = 0  # 0 = no cap
    min_free_disk_bytes: ByteSize = 256 * MiB
    # SQLite's busy timeout; PostgreSQL's lock_timeout on the agent's sessions.
    busy_timeout: PositiveDuration = 5.0
    checkpoint_interval: PositiveDuration = 60.0
    retention_interval: PositiveDuration = 300.0

    @field_validator("password_file", mode="after")
    @classmethod
    def _resolve_password_file(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        return _absolute(value, info)

    @model_validator(mode="after")
    def _retention_covers_dedupe(self) -> QueueSettings:
        # docs/queue.md#dedupe: purging a row must never forget a dedupe key before its window.
        if self.retention < self.dedupe_window:
            raise ValueError(
                f"retention ({_human(self.retention)}) must be >= dedupe_window "
                f"({_human(self.dedupe_window)})"
            )
        return self

    @model_validator(mode="after")
    def _backend_keys(self) -> QueueSettings:
        if self.backend == "sqlite":
            given = [k for k in ("dsn", "password_file") if getattr(self, k) is not None]
            if given:
                raise ValueError(
                    f'{" and ".join(given)} {"applies" if len(given) == 1 else "apply"} only to '
                    'backend = "postgresql" '
                    '(the default backend "sqlite" keeps queue.db in agent.data_dir)'
                )
            return self
        sqlite_only = [k for k in SQLITE_ONLY_KEYS if k in self.model_fields_set]
        if sqlite_only:
            raise ValueError(
                f'{", ".join(sqlite_only)} {"is" if len(sqlite_only) == 1 else "are"} SQLite-only '
                'and refused with backend = "postgresql" (the database server keeps its own '
                "durability and disk); remove them"
            )
        if self.dsn is None:
            raise ValueError(
                'backend = "postgresql" needs dsn, e.g. dsn = "postgresql://hl7agent@db.example.org:5432/hl7"'
            )
        _check_dsn(self.dsn)
        if self.password_file is not None and dsn_has_password(self.dsn):
            raise ValueError("the dsn holds a password and password_file is set too; keep only one")
        return self

    @property
    def dsn_masked(self) -> str | None:
        """``dsn`` as it may be shown: a password in it replaced by ``***``."""
        return None if self.dsn is None else mask_dsn(self.dsn)


def _check_dsn(dsn: str) -> None:
    """psycopg installed, and ``dsn`` a connection string libpq can parse (without connecting)."""
    try:
        from psycopg import ProgrammingError
        from psycopg.conninfo import conninfo_to_dict
    except ImportError:
        raise ValueError(
            "backend = \"postgresql\" needs psycopg, which is not installed: "
            "pip install 'hl7-agent[postgresql]'"
        ) from None
    try:
        conninfo_to_dict(dsn)
    except ProgrammingError as exc:
        # libpq's own words, with the connection string masked (it may hold a password).
        reason = str(exc).replace(dsn, mask_dsn(dsn)).strip().splitlines()[0]
        raise ValueError(
            f"dsn {mask_dsn(dsn)!r} is not a libpq connection string ({reason}); use "
            "postgresql://user@host:5432/dbname or host=... dbname=..."
        ) from None


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
    # Exactly one of the two: listen for senders, or dial out to a sender that
    # acts as the MLLP server (an outbound channel, "client mode").
    listen: str | None = None
    connect: str | None = None
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
    # What the channel accepts (docs/acks.md#error-codes: AR/CR with ERR-3 200-203 otherwise);
    # empty = anything. "ADT" allows every ADT event, "ADT^A01" only that one.
    accept_message_types: list[str] = Field(default_factory=list)
    accept_processing_ids: list[str] = Field(default_factory=list)
    accept_versions: list[str] = Field(default_factory=list)  # "2.5" also admits "2.5.1"
    # Partitioned channels (docs/queue.md#partitioned-channels): order is kept per
    # value of these HL7 field paths ("PID-3.1", "MSH-4,PID-3.1"); None = one
    # partition, strict channel order. max_in_flight rows of different keys at once.
    partition_key: str | None = None
    max_in_flight: int = Field(default=1, ge=1, le=256)
    # Outbound channels (connect): TLS verifies the sender's certificate
    # against tls_server_ca (setting it turns TLS on) for tls_server_name (the
    # connect host by default); tls_cert/tls_key are then our client
    # certificate. A lost connection is dialled again after a capped,
    # jittered backoff (reconnect_initial doubling up to reconnect_cap).
    tls_server_ca: OptionalPath = None
    tls_server_name: str | None = None
    reconnect_initial: PositiveDuration = 1.0
    reconnect_cap: PositiveDuration = 30.0

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not CHANNEL_NAME.fullmatch(value):
            raise ValueError(f"{value!r} must match [a-z0-9_-]+")
        return value

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        strict = bool((info.context or {}).get("strict_ports"))
        parse_listen(value, allow_port_zero=not strict)
        return value.strip()

    @field_validator("connect")
    @classmethod
    def _connect(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            parse_listen(value)
        except ValueError as exc:
            raise ValueError(str(exc).replace("listen ", "connect ", 1).replace("0.0.0.0:2575", "lis.example.org:2575")
                             ) from None
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
                network = ipaddress.ip_network(item.strip(), strict=False)
            except ValueError:
                raise ValueError(
                    f"{item!r} is not an IP address or CIDR network, e.g. 10.1.0.0/16"
                ) from None
            if network.network_address != ipaddress.ip_address(item.strip().split("/")[0]):
                # "10.1.2.3/8" means 10.0.0.0/8, as written elsewhere; kept as written so
                # that the start can warn about it (allowed_source_host_bits).
                networks.append(item.strip())
                continue
            if isinstance(network, ipaddress.IPv6Network) and network.network_address.ipv4_mapped is not None \
                    and network.prefixlen >= 96:
                # Peers are compared as IPv4 (an IPv4-mapped peer counts as IPv4): say it that way.
                network = ipaddress.ip_network(
                    f"{network.network_address.ipv4_mapped}/{network.prefixlen - 96}")
            networks.append(str(network))
        return networks

    @field_validator("tls_cert", "tls_key", "tls_client_ca", "tls_server_ca", mode="after")
    @classmethod
    def _resolve_paths(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        return _absolute(value, info)

    @field_validator("partition_key", mode="before")
    @classmethod
    def _partition_key(cls, value: object) -> object:
        if isinstance(value, str):
            if not value.strip():
                raise ValueError("must name at least one HL7 field path, e.g. PID-3.1 (or leave it out)")
            return str(parse_partition_key(value))  # ValueError says what is wrong
        return value

    @model_validator(mode="after")
    def _partitions(self) -> ChannelSettings:
        if self.max_in_flight > 1 and self.partition_key is None:
            raise ValueError(
                f"max_in_flight = {self.max_in_flight} needs partition_key (e.g. \"PID-3.1\"): without it "
                "a channel keeps strict order, one message in flight"
            )
        if self.max_in_flight > 1 and self.assign_sequence_numbers:
            raise ValueError(
                "assign_sequence_numbers cannot be used with max_in_flight > 1: with several messages in "
                "flight the server would no longer receive MSH-13 in arrival order"
            )
        return self

    @property
    def partition(self) -> PartitionKey | None:
        """The parsed ``partition_key`` (None: the channel is one partition)."""
        return parse_partition_key(self.partition_key) if self.partition_key is not None else None

    @model_validator(mode="after")
    def _tls_pair(self) -> ChannelSettings:
        if (self.listen is None) == (self.connect is None):
            raise ValueError("set either listen (senders connect to us) or connect (we dial out to the sender), "
                             "not both" if self.listen is not None else
                             "set listen (senders connect to us) or connect (we dial out to the sender)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together; set both or neither")
        if self.connect is not None:
            # A security setting is never silently ignored: a listener's keys mean nothing here.
            # (Their defaults pass: check-config's output of this channel loads again.)
            for key in ("tls_client_ca", "allowed_sources", "max_connections", "max_connections_per_source"):
                default = type(self).model_fields[key].get_default(call_default_factory=True)
                if getattr(self, key) != default:
                    raise ValueError(f"{key} is for a listening channel; this channel dials out (connect)")
            if self.tls_cert is not None and self.tls_server_ca is None:
                raise ValueError("tls_cert/tls_key on an outbound channel are its client certificate: "
                                 "set tls_server_ca too (TLS to the sender)")
            if self.tls_server_name is not None and self.tls_server_ca is None:
                raise ValueError("tls_server_name needs tls_server_ca")
        else:
            if self.tls_client_ca is not None and self.tls_cert is None:
                raise ValueError("tls_client_ca needs tls_cert and tls_key")
            for key in ("tls_server_ca", "tls_server_name"):
                if getattr(self, key) is not None:
                    raise ValueError(f"{key} is for an outbound channel (connect); this channel listens")
        if self.reconnect_initial > self.reconnect_cap:
            raise ValueError(f"reconnect_initial ({_human(self.reconnect_initial)}) must be <= reconnect_cap "
                             f"({_human(self.reconnect_cap)})")
        return self

    @property
    def outbound(self) -> bool:
        """The channel dials out to its sender (``connect``) instead of listening."""
        return self.connect is not None

    @property
    def host(self) -> str:
        """The listen host (or the connect host), IPv6 brackets removed."""
        return parse_listen(self.listen or self.connect or "", allow_port_zero=True)[0]

    @property
    def port(self) -> int:
        return parse_listen(self.listen or self.connect or "", allow_port_zero=True)[1]


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
    the environment, refusing unknown keys.
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
            if channel.outbound:
                continue  # binds nothing here
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
    """Security keys set before their feature exists; the lead decides which."""
    return []


_SECTIONS: dict[str, type[BaseModel]] = {
    "agent": AgentSettings,
    "server": ServerSettings,
    "admin": AdminSettings,
    "logging": LoggingSettings,
    "queue": QueueSettings,
    "dispatch": DispatchSettings,
}


_SECTION_MODELS: dict[str, type[BaseModel]] = {**_SECTIONS, "channels": ChannelSettings}

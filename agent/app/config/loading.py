"""Loading: the file and the environment through pydantic-settings' sources, one-line errors.

:func:`load_settings` reads the file with pydantic-settings' ``TomlConfigSettingsSource``
and the environment with its ``EnvSettingsSource`` (prefix ``HL7_AGENT_``, nested
delimiter ``__``, names case-insensitive) over an *explicitly passed* mapping,
so that tests, ``check-config`` and the daemon all see the same environment;
the environment wins over the file. Kept here is only what pydantic-settings
does not do: it silently ignores a prefixed variable whose section is unknown
(``HL7_AGENT_SERVERR__URL``) and lets the last of two spellings of one name
win, where every unknown key must be an error; its ``BaseSettings.__init__``
drops the validation context (see :mod:`agent.app.config.models`); and its errors
do not say where a value came from.
"""

from __future__ import annotations

import difflib
import json
import os
import tomllib
import typing
from collections.abc import Mapping
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_settings import EnvSettingsSource, SettingsError, TomlConfigSettingsSource
from pydantic_settings.sources import ConfigFileSourceType
from pydantic_settings.sources.utils import parse_env_vars

import agent.app.config
from agent.app.config.models import (
    _SECTION_MODELS,
    _SECTIONS,
    ChannelSettings,
    Settings,
    channel_name,
)
from agent.errors import ConfigError

DEFAULT_CONFIG_PATH = Path("/etc/hl7-agent/agent.toml")


ENV_PREFIX = "HL7_AGENT_"


CONFIG_ENV = "HL7_AGENT_CONFIG"


CHANNELS_ENV = "HL7_AGENT_CHANNELS"


# Prefixed variables that are not configuration keys (docs/configuration.md). Anything else
# starting with HL7_AGENT_ must name a known <SECTION>__<KEY>.
NON_KEY_VARIABLES = frozenset({CONFIG_ENV, CHANNELS_ENV, "HL7_AGENT_DEV_TOKEN"})


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
    if cli_value is not None:
        if not cli_value.strip():
            # A script's --config "$CONF" with CONF unset must not run on another file.
            raise ConfigError("config error: --config is empty: name a configuration file, or leave --config out")
        return Path(cli_value)
    from_env = _env_lookup(environ, CONFIG_ENV)
    if from_env:
        return Path(from_env)
    # Read on the package at call time: replacing agent.app.config.DEFAULT_CONFIG_PATH
    # (tests do, to keep a real /etc file out of them) must take effect here.
    default = agent.app.config.DEFAULT_CONFIG_PATH
    if default.is_file():
        return default
    return None


def _env_lookup(environ: Mapping[str, str], name: str) -> str | None:
    """Case-insensitive variable lookup (variable names are case-insensitive: docs/configuration.md#where-the-configuration-comes-from)."""
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
        if isinstance(value, dict):
            value = _empty_means_default(section, value, env_values.get(section))
        data[section] = value
    return data


def _empty_means_default(section: str, values: dict[str, Any], env_section: Any) -> dict[str, Any]:  # noqa: ANN401
    """An empty variable unsets its key (docs/configuration.md): a key that cannot be unset gets its default.

    Keys that can be unset (None) keep the empty value, which their
    validators read as None: ``HL7_AGENT_SERVER__URL=`` overrides the file's
    URL, ``HL7_AGENT_ADMIN__LISTEN=`` disables the admin endpoint.
    """
    model = _SECTION_MODELS.get(section)
    if model is None or not isinstance(env_section, dict):
        return values
    out = dict(values)
    for key, raw in env_section.items():
        field = model.model_fields.get(key)
        if field is None or not (isinstance(raw, str) and not raw.strip()):
            continue
        if type(None) not in typing.get_args(field.annotation):
            del out[key]
    return out


def load_settings(
    cli_value: str | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Load the file (--config, then HL7_AGENT_CONFIG, then the default path) and apply the environment; ConfigError if invalid."""
    env = os.environ if environ is None else environ
    path = resolve_config_path(cli_value, env)
    named_by = (
        "--config" if cli_value is not None else (CONFIG_ENV if _env_lookup(env, CONFIG_ENV) else "default")
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
            for key in ("tls_cert", "tls_key", "tls_client_ca", "tls_server_ca")
        ]
    for dotted, file in checks:
        if file is not None and not file.is_file():
            origin = _origin(dotted, sources, path)
            what = "is a folder, not a file" if file.is_dir() else "does not exist"
            raise ConfigError(f"config error: {dotted}: file {file} {what}{origin}")


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
        channel: str | None = None
        try:
            if key == "channels" and isinstance(value, list):
                channels = []
                for index, item in enumerate(value):
                    prefix = (key, index)
                    channel = channel_name(item)
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
            raise ConfigError(_describe(exc, path, sources, prefix, channel)) from None
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
    channel: str | None = None,
) -> str:
    """One line for the first error: key, problem, fix, origin (and the channel's name, when it has one)."""
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
    if channel is not None:
        line += f" (channel {channel})"
    origin = _origin(dotted, sources, path)
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return line + origin + more

"""Configuration: one TOML file plus ``HL7_AGENT_<SECTION>__<KEY>`` overrides (docs/configuration.md).

- :mod:`agent.app.config.values`: parsers of durations, sizes and encodings;
- :mod:`agent.app.config.models`: the pydantic models, one per section, and ``Settings``;
- :mod:`agent.app.config.loading`: :func:`load_settings` (pydantic-settings' TOML and
  environment sources, unknown keys as errors, one-line messages);
- :mod:`agent.app.config.rendering`: :func:`render_effective` for ``check-config``.

Errors are :class:`agent.errors.ConfigError` with one line naming the key, the
problem and where the value came from, e.g.::

    config error: channels[1].name: 'ADT' must match [a-z0-9_-]+ (file /etc/hl7-agent/agent.toml)
"""

from __future__ import annotations

from agent.app.config.loading import (
    DEFAULT_CONFIG_PATH,
    ENV_PREFIX,
    NON_KEY_VARIABLES,
    load_settings,
    resolve_config_path,
)
from agent.app.config.models import _SECTIONS as _SECTIONS
from agent.app.config.models import (
    AdminSettings,
    AgentSettings,
    ChannelSettings,
    DispatchSettings,
    LoggingSettings,
    QueueSettings,
    ServerSettings,
    Settings,
    security_features_unavailable,
)
from agent.app.config.rendering import render_effective
from agent.app.config.values import (
    ByteSize,
    Duration,
    parse_byte_size,
    parse_duration,
)
from agent.core.addresses import parse_listen

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

"""Rendering ``hl7-agent check-config``: the effective configuration as TOML, secrets masked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr

from agent.app.config.models import _SECTIONS, SQLITE_ONLY_KEYS, Settings
from agent.app.config.values import _mask_url
from agent.storage.conninfo import mask_dsn


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


def _render_section(model: BaseModel, prefix: str, sources: dict[str, str],
                    unused: tuple[str, ...] = ()) -> list[str]:
    """``unused``: keys shown as a comment only (given, they would be refused)."""
    lines = []
    for key in type(model).model_fields:
        value = getattr(model, key)
        origin = sources.get(f"{prefix}.{key}")
        note = f"  # from {origin}" if origin else ""
        if key in unused:
            lines.append(f'# {key}: SQLite only, not used with backend = "postgresql"')
        elif isinstance(value, SecretStr):
            lines.append(f'{key} = "***"{note}')
        elif key in ("url", "proxy") and isinstance(value, str):
            lines.append(f"{key} = {_toml_value(_mask_url(value))}{note}")
        elif key == "dsn" and isinstance(value, str):
            lines.append(f"{key} = {_toml_value(mask_dsn(value))}{note}")
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
    back as the same configuration (apart from masked secrets: the token, and
    a password in ``dsn``, ``url`` or ``proxy``). With ``backend = "postgresql"``
    the SQLite-only keys are comments, since that backend refuses them.
    """
    sources = settings._env_sources
    origin = str(settings.config_path) if settings.config_path else "environment only"
    lines = [
        "# hl7-agent effective configuration (secrets masked)",
        f"# loaded from: {origin}",
        "# durations in seconds, sizes in bytes",
    ]
    for name in _SECTIONS:
        unused = SQLITE_ONLY_KEYS if name == "queue" and settings.queue.backend == "postgresql" else ()
        lines += ["", f"[{name}]", *_render_section(getattr(settings, name), name, sources, unused)]
    channel_note = f"  # from {sources['channels']}" if "channels" in sources else ""
    if not settings.channels:
        lines += ["", f"# no channels configured: nothing will be received{channel_note}"]
    for channel in settings.channels:
        lines += ["", f"[[channels]]{channel_note}", *_render_section(channel, "channels", {})]
    return "\n".join(lines) + "\n"

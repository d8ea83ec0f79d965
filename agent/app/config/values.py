"""Value parsers and formatters of the configuration: durations, byte sizes, encodings, URLs.

Pure functions, also used by the CLI (e.g. ``queue purge --older-than``).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit, urlunsplit

from pydantic import BeforeValidator, Field

from agent.core.charsets import resolve_codec
from agent.errors import UnsupportedCharset

KiB = 1024


MiB = 1024 * KiB


_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)", re.IGNORECASE)


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


#: The longest duration a key takes (100 years): beyond it, now + the duration overflows
#: the timestamps and timeouts it becomes (an outside audit: lease_ttl = "999999999999d"
#: passed the check, then broke `queue stats`).
MAX_DURATION_S = 36500 * 86400.0


def parse_duration(value: object) -> float:
    """Seconds from a number or ``500ms``/``30s``/``5m``/``2h``/``7d`` (also ``1h30m``).

    Returns float seconds because every consumer hands it to asyncio or SQLite
    timeouts. Negative and non-finite values are refused.
    """
    if isinstance(value, bool):
        # ValueError, not TypeError: pydantic reports only ValueError as a validation error.
        raise ValueError(f"{value!r} is not a duration; use seconds or 500ms/30s/5m/2h/7d/1w")  # noqa: TRY004
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
                raise ValueError(f"{value!r} is not a duration; use seconds or 500ms/30s/5m/2h/7d/1w")
            seconds = sum(float(n) * _DURATION_UNITS[u.lower()] for n, u in parts)
    else:
        raise ValueError(f"{value!r} is not a duration; use seconds or 500ms/30s/5m/2h/7d/1w")  # noqa: TRY004
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{value!r} must be a finite duration >= 0")
    if seconds > MAX_DURATION_S:
        # A time that far ahead no longer fits a timestamp, a timeout or a date the CLI prints.
        raise ValueError(f"{value!r} is longer than 100 years (36500d), the longest duration taken")
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


def _mask_url(url: str) -> str:
    """Hide a password in a URL's userinfo, and every query value (``?token=…``), before it is printed."""
    parts = urlsplit(url)
    if parts.query:
        masked = "&".join(f"{pair.partition('=')[0]}=***" if "=" in pair else pair
                          for pair in parts.query.split("&"))
        parts = parts._replace(query=masked)
    if parts.password is not None:
        # The host and port as written (a port out of range must still be shown, not raise).
        parts = parts._replace(netloc=f"{parts.username or ''}:***@{parts.netloc.rpartition('@')[2]}")
    return urlunsplit(parts)


def _human(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"

"""``listen`` addresses (docs/configuration.md#value-formats): ``host:port`` or ``[v6]:port``. Standard library only.

One parser for the config, the admin server and ``hl7-agent health`` (which
must stay light: it runs as a Docker HEALTHCHECK every few seconds).
"""

from __future__ import annotations

import ipaddress
import re

_HOSTNAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?")


def parse_listen(value: str, *, allow_port_zero: bool = False) -> tuple[str, int]:
    """Split ``host:port`` / ``[v6]:port`` into ``(host, port)`` (brackets removed).

    The host must be explicit (``0.0.0.0`` for every IPv4 address, ``[::]`` for
    every address); port 0 is refused unless ``allow_port_zero`` (tests bind
    an ephemeral port). Raises ValueError naming the text and the fix.
    """
    text = value.strip()
    example = "write host:port, e.g. 0.0.0.0:2575 or [::1]:2575"
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError(f"listen {value!r}: missing ']' after the IPv6 address; {example}")
        host, rest = text[1:end], text[end + 1 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"listen {value!r}: {host!r} is not an IPv6 address; {example}") from None
        if not rest.startswith(":"):
            raise ValueError(f"listen {value!r}: missing port; {example}")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ValueError(f"listen {value!r}: missing port; {example}")
        if ":" in host:
            raise ValueError(f"listen {value!r}: put an IPv6 address in brackets, e.g. [::1]:2575")
        if not host:
            raise ValueError(f"listen {value!r}: missing host; {example}")
        if not _HOSTNAME.fullmatch(host):
            raise ValueError(f"listen {value!r}: {host!r} is not a host name or address; {example}")
    if not port_text.isdigit() or not port_text.isascii():
        raise ValueError(f"listen {value!r}: port {port_text!r} is not a number; {example}")
    port = int(port_text)
    low = 0 if allow_port_zero else 1
    if not low <= port <= 65535:
        raise ValueError(f"listen {value!r}: port must be {low}-65535")
    return host, port


def format_listen(host: str, port: int) -> str:
    """The inverse of :func:`parse_listen` (brackets around IPv6 hosts)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def format_peer(peer: object) -> str:
    """A socket address (``getpeername()``) as ``host:port`` (``[v6]:port``); anything else as text."""
    if isinstance(peer, tuple) and len(peer) >= 2:
        return format_listen(str(peer[0]), int(peer[1]))
    return str(peer or "unknown")

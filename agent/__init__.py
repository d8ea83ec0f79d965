"""hl7-agent: durable HL7 v2 MLLP intake, forwarded in order over a WebSocket."""

from __future__ import annotations

__version__ = "0.1.0"

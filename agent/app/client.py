"""``hl7-agent send``: a small MLLP client for operators and tests (docs/operations.md).

Blocking sockets on purpose: it sends one message, waits for its ACK, and
moves on, exactly as the lab machines it stands in for. With ``--tls`` it
speaks MLLP over TLS like a channel with ``tls_cert`` expects: the server's
certificate is verified against ``--ca`` (else the system's trust store) for
the name given as ``--host``, and ``--cert``/``--key`` present a client
certificate to a channel that requires one (``tls_client_ca``).
"""

from __future__ import annotations

import re
import socket
import ssl
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from agent.core import mllp
from agent.core.acks import read_ack_code
from agent.core.batch import is_batch, split_batch
from agent.core.charsets import resolve_codec
from agent.core.envelope import read_msh
from agent.errors import HL7Error
from agent.runtime.tls_files import load_pair, verifying_context

_LINE_ENDINGS = re.compile(rb"\r\n|\n")
_UTF8_BOM = b"\xef\xbb\xbf"
_MSH_START = re.compile(rb"(?:^|\r)(?=MSH)")
_BETWEEN_FRAMES = re.compile(rb"(\x1c\r)[ \t\r\n]+(?=\x0b|$)")


def split_messages(data: bytes) -> list[bytes]:
    """Messages in a file: MLLP-framed, or plain text split at lines starting ``MSH``.

    Plain text gets ``\\n``/``\\r\\n`` turned into ``\\r`` (HL7 segments end with CR); a
    file that starts with ``FHS`` or ``BHS`` is an HL7 batch, sent as one frame.
    """
    data = data.removeprefix(_UTF8_BOM)  # files saved by Windows editors
    if mllp.START_BLOCK in data:
        # A line break after each frame is how many tools export MLLP: not junk.
        data = _BETWEEN_FRAMES.sub(rb"\1", data).lstrip(b" \t\r\n")
        decoder = mllp.MllpDecoder(max(len(data), 1))
        events = decoder.feed(data)
        skipped = sum(e.count for e in events if isinstance(e, mllp.JunkSkipped)) + decoder.buffered_bytes()
        if skipped:
            print(f"hl7-agent: send: {skipped} bytes outside complete MLLP frames were not sent "
                  "(each frame must end with 0x1C 0x0D)", file=sys.stderr)
        return [e.payload for e in events if isinstance(e, mllp.Frame)]
    text = _LINE_ENDINGS.sub(b"\r", data)
    if is_batch(text):
        return [text.strip(b"\r\n \t") + b"\r"]
    messages = []
    for chunk in _MSH_START.split(text):
        chunk = chunk.strip(b"\r")
        if chunk.startswith(b"MSH"):
            messages.append(chunk + b"\r")
    return messages


def decode_ack(ack: bytes) -> str:
    """An ACK's text in the character set its MSH-18 names (UTF-8 when none, Latin-1 as a last resort)."""
    try:
        codec = resolve_codec(read_msh(ack).charset, "utf-8")
        return ack.decode(codec)
    except (HL7Error, UnicodeDecodeError, LookupError):
        try:
            return ack.decode("utf-8")
        except UnicodeDecodeError:
            return ack.decode("latin-1")


def answered_control_id(message: bytes, ack: bytes) -> tuple[str, str] | None:
    """(sent MSH-10, the ACK's MSA-2) when they differ: the ACK is for another message. None otherwise.

    Only for a single message and an ACK that can be read; a batch's ACK is
    a batch, and a receiver that leaves MSA-2 empty says nothing either way.
    """
    if is_batch(message):
        return None
    try:
        sent = read_msh(message).control_id.strip()
    except HL7Error:
        return None
    for segment in re.split(rb"\r\n|\r|\n", ack):
        if segment.startswith(b"MSA") and len(segment) > 3:
            fields = segment.split(segment[3:4])
            answered = fields[2].decode("latin-1").strip() if len(fields) > 2 else ""
            return (sent, answered) if answered and sent and answered != sent else None
    return None


def ack_accepted(ack: bytes) -> bool:
    """An ACK says AA/CA; an ACK batch (the answer to a batch) says so for every message in it."""
    batch = split_batch(ack)
    if batch is None:
        return read_ack_code(ack) in ("AA", "CA")
    return batch.problem is None and all(read_ack_code(m) in ("AA", "CA") for m in batch.members)


class AckTimeout(Exception):
    pass


@dataclass(frozen=True, slots=True)
class ClientTls:
    """``send --tls``: whom to trust (``ca``: a PEM bundle; None: the system store) and who we are."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def context(self) -> ssl.SSLContext:
        """Verifying context (certificate and host name, TLS 1.2+); OSError/SSLError on a bad file."""
        context = verifying_context(self.ca, setting="--ca")
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.cert is not None:
            load_pair(context, self.cert, self.key, cert_key="--cert", key_key="--key")
        return context


def _tls_error(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"certificate verify failed: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        return (exc.reason or str(exc)).lower().replace("_", " ")
    return str(exc.strerror if isinstance(exc, OSError) and exc.strerror else exc)


def _connect(host: str, port: int, timeout: float, tls: ClientTls | None) -> socket.socket | None:
    """A connected socket (TLS-wrapped when asked), or None after one line on stderr."""
    context = None
    if tls is not None:
        try:
            context = tls.context()
        except (OSError, ValueError) as exc:  # a missing or unreadable --ca/--cert/--key
            which = "--ca" if tls.cert is None else "--ca/--cert/--key"
            print(f"hl7-agent: send: cannot load {which}: {_tls_error(exc)}", file=sys.stderr)
            return None
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        print(f"hl7-agent: send: cannot connect to {where}: {exc.strerror or exc}", file=sys.stderr)
        return None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if context is None:
        return sock
    try:
        # --host is the name the certificate must carry (an IP address matches an IP SAN).
        return context.wrap_socket(sock, server_hostname=host)
    except (OSError, ValueError) as exc:
        sock.close()
        print(f"hl7-agent: send: TLS handshake with {where} failed: {_tls_error(exc)}",
              file=sys.stderr)
        return None


def read_ack(sock: socket.socket, decoder: mllp.MllpDecoder, timeout: float) -> bytes:
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AckTimeout
        sock.settimeout(remaining)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            raise AckTimeout from None
        if not data:
            raise ConnectionError("connection closed before the ACK arrived")
        for event in decoder.feed(data):
            if isinstance(event, mllp.Frame):
                return event.payload


def send_files(host: str, port: int, files: list[str], *, timeout: float = 30.0,
               tls: ClientTls | None = None) -> int:
    """Send every message of every file; print each ACK; 1 if any ACK is missing or not AA/CA.

    A message left without an ACK (timeout, connection lost) is reported and
    the rest still go, over a new connection: a late ACK on the old one must
    never be read as the next message's. Only when no new connection can be
    made are the rest reported as not sent.
    """
    messages: list[tuple[str, int, bytes]] = []
    for name in files:
        try:
            data = Path(name).read_bytes()
        except OSError as exc:
            print(f"hl7-agent: send: cannot read {name}: {exc.strerror}", file=sys.stderr)
            return 1
        found = split_messages(data)
        if not found:
            print(f"hl7-agent: send: no HL7 message (no line starting MSH) in {name}", file=sys.stderr)
            return 1
        messages.extend((name, n, m) for n, m in enumerate(found, 1))
    failures = 0
    sock: socket.socket | None = None
    decoder: mllp.MllpDecoder  # one per connection, made with it
    try:
        for position, (name, index, message) in enumerate(messages):
            if sock is None:
                sock = _connect(host, port, timeout, tls)
                if sock is None:  # said why in one line; after a lost connection, also what is left
                    left = len(messages) - position
                    if position:
                        print(f"# {name} message {index}: not sent, nor the {left - 1} after it" if left > 1
                              else f"# {name} message {index}: not sent", file=sys.stderr)
                    return 1
                decoder = mllp.MllpDecoder(64 * 1024 * 1024)
            try:
                sock.sendall(mllp.encode_frame(message))
                ack = read_ack(sock, decoder, timeout)
            except (AckTimeout, OSError) as exc:
                why = f"no ACK within {timeout:g}s" if isinstance(exc, AckTimeout) else str(exc)
                print(f"# {name} message {index}: {why}", file=sys.stderr)
                failures += 1
                sock.close()
                sock = None  # the next message goes over a new connection
                continue
            text = decode_ack(ack)
            for segment in re.split(r"\r\n|\r|\n", text):
                if segment:
                    print(segment)
            mismatch = answered_control_id(message, ack)
            if mismatch is not None:
                print(f"# {name} message {index}: warning: the ACK answers control id {mismatch[1]!r}, "
                      f"not {mismatch[0]!r} (MSA-2): it acknowledges another message", file=sys.stderr)
            if not ack_accepted(ack):
                failures += 1
            print()
    finally:
        if sock is not None:
            sock.close()
    return 1 if failures else 0

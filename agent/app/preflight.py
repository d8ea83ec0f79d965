"""Before the daemon starts: the checks ``run`` and ``check-config`` share, and the one
``agent_start_failed`` event a failed start logs.

A data directory the service user cannot write is the most common first-day
failure (a folder created by root, a volume with the wrong owner, a
read-only mount). Found here, it is one message naming the key, the path,
the user and the fix — not an ``[Errno 13]`` from deep inside SQLite.
"""

from __future__ import annotations

import os
import pwd
import re
import ssl
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from agent.errors import ConfigError

log = structlog.get_logger(__name__)

#: The database and the side files SQLite opens next to it (WAL mode).
_DB_FILES = ("queue.db", "queue.db-wal", "queue.db-shm")


def running_user() -> tuple[str, int]:
    """The effective user's name (its uid when it has none, e.g. a container's 10001) and uid."""
    uid = os.geteuid()
    try:
        return pwd.getpwuid(uid).pw_name, uid
    except KeyError:
        return str(uid), uid


@dataclass(frozen=True, slots=True)
class DataDirProblem:
    """Why the running user cannot use ``data_dir``: the path at fault, what is wrong, the fix."""

    data_dir: Path
    path: Path
    error: str
    fix: str

    def message(self) -> str:
        name, uid = running_user()
        return f"agent.data_dir: {self.path} {self.error} (running as user {name}, uid {uid}); {self.fix}"


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _not_writable(path: Path) -> str:
    return "is on a read-only file system" if _read_only(path) else "is not writable"


def data_dir_problem(data_dir: Path) -> DataDirProblem | None:
    """None when the running user can create (if missing) and write ``data_dir`` and its database.

    Uses ``os.access`` (the real uid, which is the effective one here: the
    agent is never setuid), so it answers for whoever runs the check — the
    service user under systemd, or the operator running ``check-config``.
    """
    name, _uid = running_user()
    if os.path.lexists(data_dir):
        if not data_dir.is_dir():
            return DataDirProblem(data_dir, data_dir, "is not a directory",
                                  "set agent.data_dir to a folder (it is created when missing)")
        if not os.access(data_dir, os.W_OK | os.X_OK):
            return DataDirProblem(
                data_dir, data_dir, _not_writable(data_dir),
                f"make it that user's (chown -R {name} {data_dir}; chmod 0700 {data_dir}) "
                "or set agent.data_dir to a folder it can write",
            )
        for file_name in _DB_FILES:
            file = data_dir / file_name
            if file.exists() and not os.access(file, os.R_OK | os.W_OK):
                return DataDirProblem(
                    data_dir, file, "is not readable and writable",
                    f"the queue belongs to another user: run the agent as its owner, or "
                    f"chown {name} {data_dir}/queue.db*",
                )
        return None
    parent = data_dir.parent
    while not os.path.lexists(parent) and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return DataDirProblem(data_dir, parent, "is not a directory, so the folder cannot be created",
                              "set agent.data_dir to a path under an existing folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        return DataDirProblem(
            data_dir, parent, f"{_not_writable(parent)}, so {data_dir} cannot be created",
            f"have root create it for that user (install -d -m 0700 -o {name} {data_dir}) "
            "or set agent.data_dir to a folder it can write",
        )
    # Permission bits do not tell everything (root may write anywhere, but not
    # make folders in /proc or on a read-only mount): make one, and remove it.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".hl7-agent-check-", dir=parent))
    except OSError as exc:
        return DataDirProblem(data_dir, parent, f"takes no new folder ({exc.strerror or exc}), "
                              f"so {data_dir} cannot be created",
                              "set agent.data_dir to a folder on a writable file system")
    return None


def tls_problem(settings: Any) -> tuple[str, str] | None:  # noqa: ANN401 - Settings (no import cycle)
    """The first TLS file set that does not load as ``run`` loads it: (key, "<key>: cannot load …"), or None.

    A key that does not match its certificate, a key where the certificate
    belongs, a CA file without a certificate: each loads only when a context
    is built, which for the upstream is the first connect (the daemon would
    start and fail every connect). ``check-config`` and ``run`` find it first.
    """
    from agent.runtime.mllp_server import build_server_ssl
    from agent.runtime.outbound import build_client_ssl
    from agent.runtime.upstream import safe_url, upstream_ssl_context

    for index, channel in enumerate(settings.channels):
        build = build_client_ssl if channel.outbound else build_server_ssl
        key = "tls_cert" if channel.tls_cert is not None else "tls_server_ca"  # a listener without it has no TLS
        try:
            build(channel)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError; TlsFileError names its key
            key = getattr(exc, "key", key)
            return (f"channels[{index}].{key}",
                    f"channels[{index}].{key}: cannot load the TLS files of channel {channel.name!r}: {exc}")
    server = settings.server
    try:
        upstream_ssl_context(server.url, server.ca_file, server.client_cert, server.client_key)
    except (OSError, ValueError) as exc:
        key = getattr(exc, "key", "client_cert" if server.client_cert is not None else "ca_file")
        return f"server.{key}", f"server.{key}: cannot load the TLS files for {safe_url(server.url or '')}: {exc}"
    return None


#: A certificate of ours this close to its end is warned about at start.
CERT_EXPIRY_WARNING_S = 14 * 86400


def file_warnings(settings: Any, now: float) -> list[tuple[str, str]]:  # noqa: ANN401 - Settings (no import cycle)
    """(key, words) for what would not stop a start but should be fixed: secrets any local user can
    read, and certificates of ours that expired or expire within two weeks (every handshake then fails
    with a reason that does not say whose certificate it is)."""
    server, queue = settings.server, settings.queue
    secrets = [("server.client_key", server.client_key), ("server.token_file", server.token_file),
               ("queue.password_file", queue.password_file)]
    certs = [("server.client_cert", server.client_cert)]
    for index, channel in enumerate(settings.channels):
        secrets.append((f"channels[{index}].tls_key", channel.tls_key))
        certs.append((f"channels[{index}].tls_cert", channel.tls_cert))
    found: list[tuple[str, str]] = []
    for key, path in secrets:
        try:
            mode = path.stat().st_mode if path is not None else 0
        except OSError:
            continue
        if mode & 0o004:
            found.append((key, f"{path} is readable by every user of this host (mode {mode & 0o777:04o}): "
                               f"chmod o-r {path}, or 0600 for the agent's user"))
    for key, path in certs:
        expires = _not_after(path) if path is not None else None
        if expires is None:
            continue
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(expires))
        if expires <= now:
            found.append((key, f"the certificate {path} expired on {when}: every TLS handshake with it fails"))
        elif expires - now <= CERT_EXPIRY_WARNING_S:
            found.append((key, f"the certificate {path} expires on {when}: renew it before then"))
    return found


def _not_after(path: Path) -> float | None:
    """The first certificate's expiry in ``path`` (seconds since the epoch), None when it cannot be read."""
    try:
        # The ssl module's own PEM decoder (the one its tests use): no other dependency.
        decoded = ssl._ssl._test_decode_cert(str(path))  # type: ignore[attr-defined]
        return float(ssl.cert_time_to_seconds(decoded["notAfter"]))
    except (OSError, ValueError, KeyError, AttributeError, ssl.SSLError):
        return None


def log_start_failure(exc: Exception) -> None:
    """One ``agent_start_failed`` error event: the key to fix, the path, the running user, the error.

    A log reader (journald, Docker) gets the reason as one structured line
    before ``agent_stopped``; the CLI still prints its one-line message.
    """
    name, uid = running_user()
    key = getattr(exc, "key", None)
    if key is None and isinstance(exc, ConfigError):
        # "config error: channels[1].name: …" names its key first.
        found = re.match(r"config error: ([A-Za-z0-9_.\[\]]+):", str(exc))
        key = found.group(1) if found else None
    log.error(
        "agent_start_failed",
        key=key,
        path=getattr(exc, "path", None),
        user=name,
        uid=uid,
        error=getattr(exc, "error", None) or str(exc) or type(exc).__name__,
        message=str(exc) or type(exc).__name__,
    )

"""The agent's exceptions, in one tree.

Local errors are our own fault or our host's (storage, configuration); remote
errors are the peer's (a sender's malformed HL7, the upstream server breaking
protocol). The split mirrors HL7's own: a remote error earns the sender an AE/CE,
a local one an AR/CE "resend later".

    AgentError
    ├── ConfigError                 invalid configuration (exit 2)
    │   ├── UsageError              a command-line flag or combination that cannot work
    │   └── AdminListenInUse        the admin address is taken (overlap: one each)
    ├── LocalError                  our side failed; the peer may retry
    │   ├── StorageError            the queue database refused or failed an operation
    │   │   ├── DatabaseUnavailable the database server is away or read-only, for now
    │   │   └── DatabaseLocked      busy beyond busy_timeout
    │   ├── IncompatibleDatabase    schema too new, or another agent.id owns it
    │   ├── LeaseLost               the dispatch lease moved; stop dispatching
    │   ├── HandoverError           listening sockets could not be handed over
    │   └── StartupError            the daemon cannot start: names the key to fix
    └── RemoteError                 the peer broke a rule
        ├── HL7Error                a message we cannot accept as sent
        │   ├── EnvelopeError       MSH missing or malformed (ERR-3 101/102)
        │   └── UnsupportedCharset  MSH-18 / channel encoding unusable (ERR-3 102/103)
        └── ProtocolError           the upstream server broke protocol v1
"""

from __future__ import annotations


class AgentError(Exception):
    """Root of every error the agent raises on purpose."""


class ConfigError(AgentError):
    """The configuration is invalid; the message names the key and the fix."""


class UsageError(ConfigError):
    """A flag value or combination a command cannot use (exit 2, like any usage error)."""


class AdminListenInUse(ConfigError):
    """The admin address is taken: two overlapping versions each need their own (docs/deploy.md#bluegreen-pair-and-upgrades)."""


class LocalError(AgentError):
    """Something on our side failed; the peer did nothing wrong."""


class StorageError(LocalError):
    """The queue database refused or failed an operation."""


class DatabaseUnavailable(StorageError):
    """The database server cannot be reached (or takes no writes) now; it may later."""


class DatabaseLocked(StorageError):
    """Another process held the database lock past busy_timeout."""


class IncompatibleDatabase(LocalError):
    """The database file belongs to another agent or a newer schema."""


class LeaseLost(LocalError):
    """This process no longer holds the dispatch lease (fenced write matched nothing)."""


class HandoverError(LocalError):
    """Listening sockets could not be handed from one process to the next."""


class StartupError(LocalError):
    """The daemon cannot start; ``key`` is the setting to fix (``agent.data_dir``), ``path`` the file."""

    def __init__(self, message: str, *, key: str | None, path: str | None = None,
                 error: str | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.path = path
        self.error = error or message


class RemoteError(AgentError):
    """The peer broke a rule of HL7, MLLP or protocol v1."""


class HL7Error(RemoteError):
    """A message we cannot accept as sent.

    ``error_code`` is the HL7 table 0357 code for ERR-3 (or ERR-1 / MSA-6 on
    versions before 2.5).
    """

    error_code: int = 207

    def __init__(self, text: str, *, error_code: int | None = None) -> None:
        super().__init__(text)
        self.text = text
        if error_code is not None:
            self.error_code = error_code


class EnvelopeError(HL7Error):
    """MSH missing or malformed: 101 required field missing, 102 data type error."""

    error_code = 101


class UnsupportedCharset(HL7Error):
    """The declared or configured character set cannot be used (UTF-16/32, unknown)."""

    error_code = 102


class ProtocolError(RemoteError):
    """The upstream server sent something protocol v1 does not allow."""

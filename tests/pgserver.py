"""A real PostgreSQL server for the tests, started by the tests themselves.

Debian's server binaries (``/usr/lib/postgresql/<version>/bin``: ``initdb``,
``pg_ctl``) run a throwaway cluster in a temporary directory, listening on
127.0.0.1 only, on a free port, with its Unix socket in that directory. The
server never runs as root: when the tests do (CI), the cluster belongs to an
unprivileged user (``postgres`` when Debian's package made it, else
``nobody``) and every server command runs as that user; otherwise it runs as
whoever runs the tests.

Each test gets its own database (``fresh_database``) so tests never see each
other's rows; ``stop``/``start``/``restart`` are the real thing (a database
outage as the agent sees it). Nothing here is a fake.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from agenttest import free_port  # below the ephemeral range: see there

__all__ = ["PgDatabase", "PostgresServer", "find_bin_dir", "unavailable_reason"]

_databases = itertools.count(1)


def find_bin_dir() -> Path | None:
    """The newest ``/usr/lib/postgresql/N/bin`` holding ``pg_ctl``, or ``$PG_BIN``."""
    explicit = os.environ.get("PG_BIN")
    if explicit:
        return Path(explicit) if (Path(explicit) / "pg_ctl").exists() else None
    root = Path("/usr/lib/postgresql")
    if not root.is_dir():
        return None
    versions = sorted((p for p in root.iterdir() if (p / "bin" / "pg_ctl").exists()),
                      key=lambda p: int(p.name) if p.name.isdigit() else 0)
    return versions[-1] / "bin" if versions else None


def unavailable_reason() -> str | None:
    """Why a server cannot be started here (None: it can)."""
    if find_bin_dir() is None:
        return ("PostgreSQL server binaries not found (apt-get install postgresql; "
                "or set PG_BIN to the directory holding pg_ctl)")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install -e '.[test]' installs it)"
    return None


def _server_user() -> pwd.struct_passwd | None:
    """The unprivileged account the server runs as when the tests run as root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise RuntimeError("running as root and no unprivileged user (postgres, nobody) to run PostgreSQL as")


def _parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rfind(")") + 2:].split()[1])


class PostgresServer:
    """One throwaway cluster: ``start()``, ``dsn(db)``, ``fresh_database()``, ``stop()``."""

    def __init__(self, base: Path | None = None, *, port: int | None = None) -> None:
        bin_dir = find_bin_dir()
        if bin_dir is None:
            raise RuntimeError(unavailable_reason() or "no PostgreSQL")
        self.bin = bin_dir
        self._own_base = base is None
        self.base = Path(tempfile.mkdtemp(prefix="hl7-agent-pg-")) if base is None else base
        self.data = self.base / "data"
        self.sockets = self.base / "sock"
        self.log = self.base / "server.log"
        self.port = port or free_port()
        self.user = "hl7agent"
        self.password = "test-password-not-secret"
        self._account = _server_user()
        self.running = False

    # -- running server commands as the right user ---------------------------

    def _run(self, *argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        account = self._account
        kwargs: dict[str, object] = {}
        if account is not None:
            uid, gid = account.pw_uid, account.pw_gid

            def demote() -> None:
                os.setgid(gid)
                os.setuid(uid)

            kwargs["preexec_fn"] = demote
        env = {"PATH": f"{self.bin}:/usr/bin:/bin", "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8",
               "HOME": str(self.base)}
        return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=timeout,
                              env=env, **kwargs)  # type: ignore[call-overload]

    def _chown(self, path: Path) -> None:
        if self._account is not None:
            os.chown(path, self._account.pw_uid, self._account.pw_gid)

    # -- lifecycle -------------------------------------------------------------

    def init(self) -> PostgresServer:
        self.base.mkdir(parents=True, exist_ok=True)
        self._chown(self.base)
        self.sockets.mkdir(exist_ok=True)
        self._chown(self.sockets)
        pwfile = self.base / "pw"
        pwfile.write_text(self.password + "\n")
        self._chown(pwfile)
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", self.user,
                  "--pwfile", str(pwfile), "--auth", "scram-sha-256", "-E", "UTF8", "--no-instructions")
        pwfile.unlink()
        conf = self.data / "postgresql.conf"
        with conf.open("a") as f:
            f.write(
                "\n# hl7-agent tests: loopback only, a socket in the test dir\n"
                "listen_addresses = '127.0.0.1'\n"
                f"port = {self.port}\n"
                f"unix_socket_directories = '{self.sockets}'\n"
                "max_connections = 200\n"
                "shared_buffers = 32MB\n"
                # Durable as in production: the agent's ACK-after-commit promise is
                # tested against a server that really flushes its WAL.
                "fsync = on\n"
                "synchronous_commit = on\n"
                "log_min_messages = warning\n"
            )
        return self

    def start(self, timeout: float = 60) -> PostgresServer:
        if not self.data.exists():
            self.init()
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w",
                  "-t", str(int(timeout)), "start", timeout=timeout + 10)
        self.running = True
        return self

    def stop(self, mode: str = "fast", timeout: float = 60) -> None:
        """Stop the server (``fast``: abort sessions, clean shutdown; ``immediate``: like a crash)."""
        if not self.running:
            return
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w",
                  "-t", str(int(timeout)), "stop", check=False, timeout=timeout + 10)
        self.running = False

    def restart(self) -> None:
        self.stop()
        self.start()

    def destroy(self) -> None:
        self.stop("immediate")
        if self._own_base:
            shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    # -- addresses ---------------------------------------------------------------

    def dsn(self, database: str = "postgres", *, password: bool = False) -> str:
        """A libpq URL for ``database`` on 127.0.0.1 (with the password only when asked)."""
        auth = f"{self.user}:{self.password}" if password else self.user
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{database}"

    def connect(self, database: str = "postgres", **kwargs: object):  # type: ignore[no-untyped-def]
        import psycopg

        return psycopg.connect(self.dsn(database, password=True), autocommit=True, **kwargs)

    def fresh_database(self, prefix: str = "t") -> str:
        """A new empty database; its name."""
        name = f"{prefix}_{os.getpid()}_{next(_databases)}"
        with self.connect() as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return name

    def wait_accepting(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            result = self._run(str(self.bin / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port),
                               check=False)
            if result.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"PostgreSQL not accepting after {timeout}s: {result.stdout}")
            time.sleep(0.1)

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """The server and every backend stopped with SIGSTOP for the block (a frozen host or VM),
        its TCP connections kept; SIGCONT after. The kernel still accepts and acknowledges."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        pids = [postmaster] + [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                               and _parent_of(int(p.name)) == postmaster]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    @contextlib.contextmanager
    def stopped(self) -> Iterator[None]:
        """The server down for the duration of the block (a real outage), then up again."""
        self.stop()
        try:
            yield
        finally:
            self.start()


@dataclass(frozen=True)
class PgDatabase:
    """One test's own place on the session's server: a database, or a schema in a shared one.

    ``dsn`` reaches it with libpq's own means (``options=-c search_path=…``
    for a schema), as an operator sharing a database between applications would.
    """

    server: PostgresServer
    name: str
    schema: str | None = None

    def _with(self, base: str) -> str:
        if self.schema is None:
            return base
        return f"{base}?options=-csearch_path%3D{self.schema}"

    @property
    def dsn(self) -> str:
        """A libpq URL with the password in it."""
        return self._with(self.server.dsn(self.name, password=True))

    @property
    def dsn_without_password(self) -> str:
        return self._with(self.server.dsn(self.name))

    def queue_toml(self, directory: Path) -> str:
        """The ``[queue]`` table of an agent on this database: the dsn without its password,
        the password in a ``password_file`` written to ``directory``."""
        secret = directory / "db-password"
        secret.write_text(self.server.password + "\n", encoding="utf-8")
        return (f'\n[queue]\nbackend = "postgresql"\ndsn = "{self.dsn_without_password}"\n'
                f'password_file = "{secret}"\n')

    def rows(self, sql: str, params: tuple[object, ...] | dict[str, object] = ()) -> list[tuple[object, ...]]:
        """Read (or change) the database directly, as an operator with psql would."""
        import psycopg

        with psycopg.connect(self.dsn, autocommit=True) as conn:
            cur = conn.execute(sql, params)  # type: ignore[arg-type]
            return list(cur.fetchall()) if cur.description else []

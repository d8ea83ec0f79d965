"""Shared test helpers: the daemon as a subprocess, an MLLP client, a dev server on a thread.

Real parts only: the daemon runs as ``python -m agent run`` with a real config
file and data dir, talks real TCP on 127.0.0.1, and is stopped by its PID.
Waiting is by polling with a deadline, never a bare sleep.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Coroutine, Iterable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from agent.app.devserver import Answer, DevServer
from agent.core import mllp

REPO_ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")

SAMPLE_ADT = (
    "MSH|^~\\&|LAB|NORTH|EHR|CENTRAL|20260101120000||ADT^A01^ADT_A01|{cid}|P|2.5.1\r"
    "EVN|A01|20260101120000\r"
    "PID|1||{pid}^^^MRN||DOE^JANE||19800101|F\r"
    "PV1|1|I|WARD^1^1\r"
)


def hl7_message(control_id: str, *, pid: str = "12345", sending_app: str = "LAB",
                msh15: str = "", msh16: str = "", version: str = "2.5.1") -> bytes:
    """A small ADT^A01 with the given MSH-10 (and optional MSH-15/16)."""
    msh = (f"MSH|^~\\&|{sending_app}|NORTH|EHR|CENTRAL|20260101120000||ADT^A01^ADT_A01|{control_id}|P|{version}"
           + (f"|||{msh15}|{msh16}" if (msh15 or msh16) else ""))
    return (msh + "\rEVN|A01|20260101120000\r"
            f"PID|1||{pid}^^^MRN||DOE^JANE||19800101|F\rPV1|1|I|WARD^1^1\r").encode()


def batch_of(*messages: bytes, fhs: bool = False, count: int | None = None) -> bytes:
    """An HL7 batch frame payload (BHS … BTS, inside FHS … FTS with ``fhs``) of ``messages``."""
    head = b"FHS|^~\\&|LAB|NORTH|EHR|CENTRAL|20260101||||F-IN\r" if fhs else b""
    n = len(messages) if count is None else count
    body = head + b"BHS|^~\\&|LAB|NORTH|EHR|CENTRAL|20260101||||B-IN\r" + b"".join(messages) + b"BTS|%d\r" % n
    return body + (b"FTS|1\r" if fhs else b"")


def members_of(ack_batch: bytes) -> list[bytes]:
    """The ACKs inside an ACK batch, in order (AssertionError when it is no well-formed batch)."""
    from agent.core.batch import split_batch

    batch = split_batch(ack_batch)
    assert batch is not None and batch.problem is None, ack_batch
    return list(batch.members)


@functools.cache
def _first_ephemeral_port() -> int:
    """Where the kernel's local ports for outgoing connections begin (ip(7): ip_local_port_range)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_port_picks = random.Random()
#: Ports handed out lately: a caller binds them later, so a free one may be handed out twice.
_handed_out: collections.deque[int] = collections.deque(maxlen=2000)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 below the ephemeral range.

    A port the kernel hands out for bind(0) comes from the range it also
    gives outgoing connections: between this call and the daemon's bind,
    any connect() (the daemon before, its database, a dev server) may take
    it as its local port, and the bind fails with EADDRINUSE. Below that
    range only another listener can take it.
    """
    top = min(_first_ephemeral_port(), 65536) - 1
    for _ in range(200 if top >= 4096 else 0):
        port = _port_picks.randint(min(20000, top - 2000), top)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.append(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # nothing free below it: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02,
             what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def ack_code(ack: bytes) -> str:
    for segment in ack.replace(b"\n", b"\r").split(b"\r"):
        if segment.startswith(b"MSA"):
            return segment.split(segment[3:4])[1].decode()
    return ""


def msa2(ack: bytes) -> str:
    for segment in ack.replace(b"\n", b"\r").split(b"\r"):
        if segment.startswith(b"MSA"):
            fields = segment.split(segment[3:4])
            return fields[2].decode() if len(fields) > 2 else ""
    return ""


def err3(ack: bytes) -> str:
    for segment in ack.split(b"\r"):
        if segment.startswith(b"ERR"):
            fields = segment.split(b"|")
            return fields[3].split(b"^")[0].decode() if len(fields) > 3 else ""
    return ""


class MllpClient:
    """A blocking MLLP client: one connection, send a frame, read one ACK frame."""

    def __init__(self, port: int, host: str = "127.0.0.1", timeout: float = 10.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.decoder = mllp.MllpDecoder(64 * 1024 * 1024)
        self.pending: list[bytes] = []
        self.timeout = timeout

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, message: bytes) -> None:
        self.sock.sendall(mllp.encode_frame(message))

    def read_ack(self, timeout: float | None = None) -> bytes:
        deadline = time.monotonic() + (timeout or self.timeout)
        while not self.pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no ACK frame")
            self.sock.settimeout(remaining)
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("connection closed by the agent")
            self.pending.extend(e.payload for e in self.decoder.feed(data) if isinstance(e, mllp.Frame))
        return self.pending.pop(0)

    def exchange(self, message: bytes, timeout: float | None = None) -> bytes:
        self.send(message)
        return self.read_ack(timeout)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> MllpClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def toml_config(data_dir: Path, channels: Iterable[dict[str, Any]], *, agent_id: str = "test-agent",
                server_url: str | None = None, token: str = "test-token", admin_port: int | None = None,
                extra: str = "") -> str:
    lines = ["[agent]", f'id = "{agent_id}"', f'data_dir = "{data_dir}"', "shutdown_budget = 10", ""]
    lines += ["[admin]", f'listen = "127.0.0.1:{admin_port}"' if admin_port else 'listen = ""', ""]
    if server_url:
        lines += ["[server]", f'url = "{server_url}"', f'token = "{token}"', "response_timeout = 5",
                  "connect_timeout = 5", ""]
    lines += ["[dispatch]", "lease_ttl = 6", "lease_heartbeat = 2", "lease_acquire_interval = 0.5",
              "retry_initial = 0.2", "retry_cap = 1", ""]
    for channel in channels:
        lines.append("[[channels]]")
        for key, value in channel.items():
            lines.append(f"{key} = {json.dumps(value)}")
        lines.append("")
    return "\n".join(lines) + "\n" + extra


class Daemon:
    """``python -m agent run`` as a subprocess with its own config, log file and PID."""

    def __init__(self, tmp: Path, config_text: str, *, name: str = "agent",
                 env: dict[str, str] | None = None, preexec_fn: Callable[[], None] | None = None) -> None:
        self.dir = tmp
        self.config = tmp / f"{name}.toml"
        self.config.write_text(config_text)
        self.log_path = tmp / f"{name}.log"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("HL7_AGENT_")}
        self.env.update(env or {})
        self.preexec_fn = preexec_fn
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Daemon:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent", "run", "--config", str(self.config)],
            stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.dir,
            preexec_fn=self.preexec_fn,  # noqa: PLW1509 - only setrlimit, in tests
        )
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def events(self) -> list[dict[str, Any]]:
        out = []
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return out
        for line in text.splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return out

    def has_event(self, name: str, **match: Any) -> bool:
        return any(e.get("event") == name and all(e.get(k) == v for k, v in match.items())
                   for e in self.events())

    def wait_started(self, timeout: float = 20.0) -> Daemon:
        def started() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.log_tail()}")
            return self.has_event("agent_started")

        wait_for(started, timeout, what="agent_started")
        return self

    def wait_event(self, name: str, timeout: float = 20.0, **match: Any) -> None:
        wait_for(lambda: self.has_event(name, **match), timeout, what=f"log event {name}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "<no log>"

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait_exit(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait; SIGKILL if it does not exit in time. Returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
                raise
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def db_rows(db_path: Path, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Read the queue database directly (a separate connection, as an operator would)."""
    conn = sqlite3.connect(f"file:{db_path}?mode=rw", uri=True, timeout=10)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - loopback only
            return int(resp.status), bytes(resp.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), bytes(exc.read())


class DevServerThread:
    """A real DevServer on its own event loop thread, for tests that run the daemon as a subprocess."""

    def __init__(self, *, token: str | None = "test-token", replay: bool = True,
                 decide: Callable[[Any], Any] | None = None, port: int = 0, **options: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="dev-server", daemon=True)
        self.server = DevServer(token=token, replay=replay, decide=decide, **options)
        self._port = port
        self.thread.start()

    def call(self, coro: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> DevServerThread:
        self.call(self.server.start("127.0.0.1", self._port))
        return self

    @property
    def port(self) -> int:
        return int(self.server.port)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/agent"

    def stop(self) -> None:
        try:
            self.call(self.server.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()

    def received_ids(self) -> list[str]:
        return [t.id for t in list(self.server.received)]


__all__ = [
    "REPO_ROOT",
    "Answer",
    "Daemon",
    "DevServerThread",
    "MllpClient",
    "ack_code",
    "db_rows",
    "err3",
    "free_port",
    "hl7_message",
    "http_get",
    "msa2",
    "toml_config",
    "wait_for",
]


def make_test_pki(directory: Path) -> Path:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate (openssl CLI)."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=30)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
            "-subj", "/CN=hl7-agent test CA")
    (directory / "server.ext").write_text("subjectAltName=IP:127.0.0.1\n", encoding="ascii")
    (directory / "client.ext").write_text("extendedKeyUsage=clientAuth\n", encoding="ascii")
    for name in ("server", "client"):
        openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext")
    return directory


def run_with_agent(tmp_path: Path, channel: Any, scenario: Callable[[int], Any]) -> Any:  # noqa: ANN401
    """Run the daemon in-process on port 0 with one channel, await ``scenario(port)``, stop it: its result."""
    from agent.app.config import AdminSettings, AgentSettings, Settings
    from agent.app.service import Agent

    async def main() -> Any:  # noqa: ANN401 - the scenario's
        settings = Settings(agent=AgentSettings(id="inproc", data_dir=tmp_path / "data"),
                            admin=AdminSettings(listen=None), channels=[channel])
        agent = Agent(settings)
        await agent.start()
        try:
            return await scenario(agent.listeners[0].sock.getsockname()[1])
        finally:
            agent.stop_requested.set()
            await agent.shutdown()

    return asyncio.run(main())


async def exchange(port: int, message: bytes, *, tls: Any = None, raw: bool = False) -> bytes:
    """Send one frame (or ``raw`` bytes) on a new connection; return the first ACK frame's payload."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=tls)
    try:
        writer.write(message if raw else mllp.encode_frame(message))
        await writer.drain()
        decoder = mllp.MllpDecoder(1 << 20)
        async with asyncio.timeout(10):
            while True:
                data = await reader.read(65536)
                if not data:
                    raise ConnectionError("closed without an ACK")
                frames = [e for e in decoder.feed(data) if isinstance(e, mllp.Frame)]
                if frames:
                    return frames[0].payload
    finally:
        writer.close()


def run_async(coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
    """Run one async scenario with an overall deadline, so a hang fails fast."""

    async def bounded() -> T:
        async with asyncio.timeout(timeout):
            return await coro

    return asyncio.run(bounded())


async def until(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll ``predicate`` inside a loop with a deadline (a wait, not a sleep-as-synchronisation)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


def log_events(logs: list[MutableMapping[str, Any]], name: str) -> list[MutableMapping[str, Any]]:
    """Entries of ``structlog.testing.capture_logs()`` with this event name."""
    return [entry for entry in logs if entry["event"] == name]


# -- Kill-loop helpers: a sender that resends like an interface engine ---------------------------
#
# Kept as one block of their own (tests/system/test_kill_loop.py uses them); nothing above
# depends on it.

#: MSA-1 codes that end a sender's retransmits (HL7 table 0008: AA original, CA enhanced mode).
ACCEPT_CODES = frozenset({"AA", "CA"})
#: Enhanced-mode commit ACK codes (HL7 table 0008); AA/AE/AR there are application ACKs.
COMMIT_ACK_CODES = frozenset({"CA", "CE", "CR"})


@dataclass(frozen=True, slots=True)
class AckSeen:
    """One ACK frame a sender read: whose (MSA-2), commit or application level, MSA-1, ERR-3."""

    control_id: str
    level: str  # "commit" or "application"
    code: str
    error: str
    at: float  # time.monotonic() when it was read


class ResendingSender(threading.Thread):
    """A sender like a real interface engine: one connection, unique messages, resend until accepted.

    Each message gets a new MSH-10 (``<name><n>``, MSH-3 = the name in upper case). On any
    failure — connection refused or reset, no ACK within ``ack_timeout``, a non-accept code —
    it reconnects if needed and resends the *same bytes* until it reads AA/CA for that control
    id; only then does it go on to the next message. ``stop()`` lets the current message
    finish that way, then the thread ends. ``enhanced`` senders set MSH-15/16 = AL and so
    also read the relayed application ACKs, which may arrive between commit ACKs.
    """

    def __init__(self, name: str, port: int, *, enhanced: bool = False, pace: float = 0.05,
                 ack_timeout: float = 5.0, give_up_after: float = 90.0) -> None:
        super().__init__(name=f"sender-{name}", daemon=True)
        self.sender = name
        self.port = port
        self.enhanced = enhanced
        self.pace = pace
        self.ack_timeout = ack_timeout
        self.give_up_after = give_up_after
        self._stop_sending = threading.Event()
        self._client: MllpClient | None = None
        self.accepted: list[str] = []  # control ids in send order, each accepted
        self.frames_written = 0  # every write of a message's bytes, resends included
        self.failures: dict[str, int] = {}  # refused / reset / no_ack / <MSA-1 code> -> count
        self.acks: list[AckSeen] = []  # every ACK frame read, in arrival order
        self.stray: list[AckSeen] = []  # commit-level ACKs for another control id than the current one
        self.error: BaseException | None = None
        #: Set while a written message waits for its commit ACK (a kill point for the loop).
        self.awaiting_ack = threading.Event()

    def message(self, n: int) -> tuple[str, bytes]:
        control_id = f"{self.sender}{n:06d}"
        mode = "AL" if self.enhanced else ""
        return control_id, hl7_message(control_id, pid=str(100000 + n), sending_app=self.sender.upper(),
                                       msh15=mode, msh16=mode)

    def stop(self) -> None:
        self._stop_sending.set()

    def run(self) -> None:
        try:
            n = 0
            while not self._stop_sending.is_set():
                n += 1
                control_id, message = self.message(n)
                self._deliver(control_id, message)
                self.accepted.append(control_id)
                self._stop_sending.wait(self.pace)  # the sender's own rate, not a synchronisation
        except Exception as exc:  # noqa: BLE001 - kept for the test, which joins the thread and reports it
            self.error = exc
        finally:
            self._disconnect()

    def _fail(self, why: str) -> None:
        self.failures[why] = self.failures.get(why, 0) + 1

    def _disconnect(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _deliver(self, control_id: str, message: bytes) -> None:
        deadline = time.monotonic() + self.give_up_after
        while True:
            if time.monotonic() > deadline:
                raise AssertionError(f"{control_id} not accepted within {self.give_up_after}s "
                                     f"(failures so far: {self.failures})")
            if self._client is None:
                try:
                    self._client = MllpClient(self.port, timeout=self.ack_timeout)
                except OSError:
                    self._fail("refused")
                    time.sleep(0.02)  # reconnect backoff of the sender, not a synchronisation
                    continue
            try:
                self._client.send(message)
                self.frames_written += 1
                self.awaiting_ack.set()
                code = self._read_commit_ack(control_id)
            except TimeoutError:
                self._fail("no_ack")
                self._disconnect()
                continue
            except OSError:  # ConnectionError (closed, reset) included
                self._fail("reset")
                self._disconnect()
                continue
            finally:
                self.awaiting_ack.clear()
            if code in ACCEPT_CODES:
                return
            self._fail(code or "no_msa")
            time.sleep(0.05)  # "resend later" backoff of the sender, not a synchronisation

    def _read_commit_ack(self, control_id: str) -> str:
        """Read frames until the commit-level ACK for ``control_id``; record application ACKs on the way."""
        assert self._client is not None
        while True:
            ack = self._client.read_ack()
            code = ack_code(ack)
            level = "application" if self.enhanced and code not in COMMIT_ACK_CODES else "commit"
            seen = AckSeen(msa2(ack), level, code, err3(ack), time.monotonic())
            self.acks.append(seen)
            if level == "application":
                continue
            if seen.control_id != control_id:
                self.stray.append(seen)
                continue
            return code

"""Shared parts of the benches: the load generator, the processes under test, /proc readings.

Everything a bench starts is a real process (the daemon as ``python -m agent
run``, the baseline server, the upstream server, the C load generator),
talks real TCP on 127.0.0.1 and is stopped by its PID. Only the outside of
the daemon is used — its configuration file, its listeners, ``/readyz``, its
JSON log lines and ``hl7-agent queue stats --json`` — so the benches keep
working while the inside is rebuilt. The one exception is ``fill_queue``
(bench/backlog.py), which writes rows through the store's own intake path.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import platform
import resource
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
# The in-process parts (fill_queue, wal_frames.py) import this tree's agent, not
# whatever checkout an editable install points at: a bench run from a worktree measures that tree.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
BUILD = BENCH / ".build"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")

#: The load generator's built-in message (bench/loadgen.c), for code that writes rows itself.
ADT_TEMPLATE = (
    "MSH|^~\\&|LOADGEN|NORTH|EHR|CENTRAL|20260101120000||ADT^A01^ADT_A01|{cid}|P|2.5.1\r"
    "EVN|A01|20260101120000\r"
    "PID|1||123456^^^MRN^MR||DOE^JANE^Q||19800101|F|||1 MAIN ST^^SPRINGFIELD^IL^62701\r"
    "PV1|1|I|WARD^101^1||||1234^SMITH^JOHN\r"
)


class BenchError(SystemExit):
    """A bench that cannot produce a trustworthy figure stops with a reason (exit 1)."""

    def __init__(self, message: str) -> None:
        print(f"bench error: {message}", file=sys.stderr, flush=True)
        super().__init__(1)


# -- the load generator ----------------------------------------------------------


def build_loadgen() -> Path:
    """Compile bench/loadgen.c once per source version into bench/.build/ (cc -O2 -pthread)."""
    source = BENCH / "loadgen.c"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise BenchError("the load generator needs a C compiler: apt-get install gcc (or set CC)")
    flags = ["-O2", "-pthread", "-Wall"]
    digest = hashlib.sha256(source.read_bytes() + " ".join([cc, *flags]).encode()).hexdigest()[:12]
    binary = BUILD / f"loadgen-{digest}"
    if binary.exists():
        return binary
    BUILD.mkdir(exist_ok=True)
    tmp = BUILD / f".loadgen-{digest}.{os.getpid()}"
    result = subprocess.run([cc, *flags, "-o", str(tmp), str(source)], capture_output=True, text=True,
                            timeout=120, check=False)
    if result.returncode != 0:
        raise BenchError(f"cannot compile {source}:\n{result.stderr}")
    os.replace(tmp, binary)  # atomic: two benches building at once both end with a whole binary
    for old in BUILD.glob("loadgen-*"):
        if old != binary:
            with contextlib.suppress(OSError):
                old.unlink()
    return binary


def loadgen_command(ports: Sequence[int], connections: int, *, duration: float | None = None,
                    count: int | None = None, warmup: float = 0.0, timeout: float = 30.0,
                    prefix: str | None = None, reconnect: bool = False, patients: int = 0,
                    template: Path | None = None) -> list[str]:
    cmd = [str(build_loadgen()), "--port", ",".join(str(p) for p in ports),
           "--connections", str(connections), "--warmup", str(warmup), "--timeout", str(timeout)]
    if (duration is None) == (count is None):
        raise ValueError("give exactly one of duration and count")
    cmd += ["--duration", str(duration)] if duration is not None else ["--count", str(count)]
    if prefix:
        cmd += ["--prefix", prefix]
    if reconnect:
        cmd.append("--reconnect")
    if patients:
        cmd += ["--patients", str(patients)]
    if template is not None:
        cmd += ["--template", str(template)]
    return cmd


def run_loadgen(ports: Sequence[int], connections: int, **kwargs: Any) -> dict[str, Any]:
    """Run the load generator to the end; its JSON report."""
    cmd = loadgen_command(ports, connections, **kwargs)
    limit = (kwargs.get("duration") or 0) + kwargs.get("warmup", 0) + 4 * kwargs.get("timeout", 30) + 300
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, check=False)
    if result.returncode != 0 or not result.stdout.strip():
        raise BenchError(f"loadgen failed ({result.returncode}): {result.stderr.strip()}")
    report: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return report


def check_all_accepted(report: dict[str, Any], what: str, accept: Sequence[str] = ("AA", "CA")) -> None:
    """A run with errors or non-accept ACKs measured something else: stop rather than print it."""
    codes = report["ack_codes"]
    bad = {code: n for code, n in codes.items() if code not in accept}
    if report["errors"] or bad or report["ack_mismatched"] or report["acked"] != report["sent"]:
        raise BenchError(
            f"{what}: errors {report['errors']} {report['error_kinds']}, ACK codes {codes}, "
            f"ACKs for another MSH-10 {report['ack_mismatched']}, sent {report['sent']} acked {report['acked']}"
        )


def acked_control_ids(report: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Every MSH-10 the load generator got an ACK for -> (connection, n)."""
    out: dict[str, tuple[int, int]] = {}
    for index, conn in enumerate(report["per_connection"]):
        for n in range(conn["acked"]):
            out[f"{report['prefix']}.{index}.{n}"] = (index, n)
    return out


# -- processes ---------------------------------------------------------------------


def stop_on_sigterm() -> None:
    """SIGTERM ends a bench like Ctrl-C: its ``finally`` blocks stop every process it started."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def free_port() -> int:
    """A free port on 127.0.0.1 that no outgoing connection can take first (tests/agenttest.py)."""
    tests = str(BENCH.parent / "tests")  # this checkout's, whatever REPO points at
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from agenttest import free_port as below_the_ephemeral_range

    return below_the_ephemeral_range()


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HL7_AGENT_")}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class Process:
    """A child process stopped by its PID: SIGTERM, then SIGKILL after ``grace`` seconds."""

    def __init__(self, cmd: list[str], *, log: Path | None = None, stdout_pipe: bool = False,
                 cwd: Path | None = None, preexec_fn: Callable[[], None] | None = None) -> None:
        self.cmd = cmd
        self.log = log
        out: Any = subprocess.PIPE if stdout_pipe else (log.open("ab") if log else subprocess.DEVNULL)
        err: Any = log.open("ab") if log else subprocess.DEVNULL
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=cwd, env=_clean_env(),
                                     preexec_fn=preexec_fn)  # noqa: PLW1509 - only setrlimit
        for f in (out, err):
            if hasattr(f, "close") and f is not subprocess.PIPE:
                f.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace: float = 30.0, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode

    def tail(self, lines: int = 30) -> str:
        if self.log is None:
            return ""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "<no log>"


class JsonLineServer(Process):
    """A bench server that prints JSON lines on stdout: ``{"listening": port}`` first."""

    def __init__(self, cmd: list[str], log: Path) -> None:
        super().__init__(cmd, log=log, stdout_pipe=True)
        self.lines: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, name="server-stdout", daemon=True)
        self._reader.start()
        try:
            first = self.wait_line(lambda d: "listening" in d, 20)
        except BaseException:
            self.stop(5)
            raise
        self.port = int(first["listening"])

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                line = json.loads(raw)
            except json.JSONDecodeError:
                continue
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_line(self, predicate: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in reversed(self.lines):
                    if predicate(line):
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise BenchError(f"{self.cmd[1]}: no expected output in {timeout}s:\n{self.tail()}")
                self._cond.wait(min(left, 0.5))

    def stop_and_collect(self) -> dict[str, Any]:
        self.stop()
        self._reader.join(10)
        return self.lines[-1] if self.lines else {}


def start_baseline(workdir: Path) -> JsonLineServer:
    return JsonLineServer([sys.executable, str(BENCH / "baseline_server.py"), "--port", "0"],
                          workdir / "baseline.log")


class Upstream(JsonLineServer):
    """bench/upstream_server.py: progress lines ``{"t", "received", "sessions"}`` every 0.25 s."""

    def __init__(self, workdir: Path, *, delay_ms: float = 0.0, records: Path | None = None) -> None:
        cmd = [sys.executable, str(BENCH / "upstream_server.py"), "--port", "0", "--delay-ms", str(delay_ms)]
        if records is not None:
            cmd += ["--records", str(records)]
        self.records_path = records
        super().__init__(cmd, workdir / "upstream.log")

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/agent"

    def received(self) -> int:
        with self._cond:
            for line in reversed(self.lines):
                if "received" in line:
                    return int(line["received"])
        return 0

    def progress(self) -> list[tuple[float, int]]:
        with self._cond:
            return [(float(d["t"]), int(d["received"])) for d in self.lines if "t" in d]

    def wait_received(self, n: int, timeout: float) -> bool:
        try:
            self.wait_line(lambda d: int(d.get("received", -1)) >= n, timeout)
        except BenchError:
            return False
        return True

    def wait_session(self, timeout: float = 30) -> None:
        self.wait_line(lambda d: int(d.get("sessions", 0)) >= 1, timeout)

    def read_records(self) -> list[tuple[float, str, int, int, str, str, str]]:
        out = []
        assert self.records_path is not None
        for line in self.records_path.read_text(encoding="utf-8").splitlines():
            t, channel, seq, attempt, cid, mid, pid3 = line.split("\t")
            out.append((float(t), channel, int(seq), int(attempt), cid, mid, pid3))
        return out


def agent_config(data_dir: Path, channels: Sequence[dict[str, Any]], *, admin_port: int,
                 server_url: str | None = None, agent_id: str = "bench-agent",
                 queue: Sequence[str] = ('synchronous = "full"',)) -> str:
    """A production-like configuration: defaults except where a bench needs something else.

    ``queue``: the ``[queue]`` keys (:func:`queue_database` gives them per backend).
    """
    lines = ["[agent]", f'id = "{agent_id}"', f'data_dir = "{data_dir}"', "",
             "[admin]", f'listen = "127.0.0.1:{admin_port}"', "",
             "[logging]", 'level = "info"', 'format = "json"', "",
             "[queue]", *queue, ""]
    if server_url:
        lines += ["[server]", f'url = "{server_url}"', 'token = "bench-token"', ""]
    for channel in channels:
        lines.append("[[channels]]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in channel.items()]
        lines.append("")
    return "\n".join(lines)


BACKENDS = ("sqlite", "postgresql")


@contextlib.contextmanager
def queue_database(workdir: Path, backend: str, dsn: str | None = None) -> Iterator[list[str]]:
    """The ``[queue]`` keys of the agent under test, on ``backend``.

    ``sqlite``: ``synchronous = "full"`` (queue.db in the data dir). ``postgresql``:
    the database of ``dsn`` as it is (give an empty one: the agent creates its
    tables there, and rows left by an earlier run would be delivered too), or,
    without one, a fresh database on a throwaway local cluster
    (tests/pgserver.py, fsync and synchronous_commit on) whose data lives in
    the work dir, so the work dir decides the disk here too; its password
    goes into a ``password_file``.
    """
    if backend == "sqlite":
        yield ['synchronous = "full"']
        return
    if dsn is not None:
        yield ['backend = "postgresql"', f"dsn = {json.dumps(dsn)}"]
        return
    sys.path.insert(0, str(REPO / "tests"))
    from pgserver import PostgresServer, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        raise BenchError(f"--backend postgresql without --dsn starts a local server: {reason}")
    if os.geteuid() == 0:
        workdir.chmod(0o755)  # the server runs as an unprivileged user under it
    server = PostgresServer(workdir / "pg")
    try:
        server.start()
        secret = workdir / "db-password"
        secret.write_text(server.password + "\n")
        yield ['backend = "postgresql"', f"dsn = {json.dumps(server.dsn(server.fresh_database('bench')))}",
               f"password_file = {json.dumps(str(secret))}"]
    finally:
        server.destroy()


def channels_on_ports(count: int, **extra: Any) -> list[dict[str, Any]]:
    """``count`` channels ``ch0``..; ``ack = "commit"`` (the accept ACK follows the commit)."""
    return [{"name": f"ch{i}", "listen": f"127.0.0.1:{free_port()}", "ack": "commit", **extra}
            for i in range(count)]


def channel_ports(channels: Sequence[dict[str, Any]]) -> list[int]:
    return [int(str(c["listen"]).rsplit(":", 1)[1]) for c in channels]


class Agent(Process):
    """``python -m agent run`` with its own config file, data dir and log file."""

    def __init__(self, workdir: Path, config_text: str, *, name: str = "agent",
                 preexec_fn: Callable[[], None] | None = None) -> None:
        self.config = workdir / f"{name}.toml"
        self.config.write_text(config_text)
        self.admin = _admin_listen(config_text)
        super().__init__([sys.executable, "-m", "agent", "run", "--config", str(self.config)],
                         log=workdir / f"{name}.log", cwd=workdir, preexec_fn=preexec_fn)

    def readyz(self) -> int:
        try:
            with urllib.request.urlopen(f"http://{self.admin}/readyz", timeout=2) as r:
                return int(r.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except OSError:
            return 0

    def wait_ready(self, timeout: float = 60.0) -> dict[str, float]:
        """Seconds from process start to ``/readyz`` 200 and to the ``agent_started`` line."""
        deadline = time.monotonic() + timeout
        ready_at = started_at = None
        while ready_at is None or started_at is None:
            if not self.alive():
                raise BenchError(f"the agent exited with {self.proc.returncode}:\n{self.tail()}")
            now = time.monotonic()
            if now > deadline:
                raise BenchError(f"the agent was not ready within {timeout}s:\n{self.tail()}")
            if ready_at is None and self.readyz() == 200:
                ready_at = time.monotonic()
            if started_at is None and self.has_event("agent_started"):
                started_at = time.monotonic()
            time.sleep(0.005)
        return {"readyz_s": ready_at - self.started_at, "agent_started_s": started_at - self.started_at}

    def has_event(self, name: str) -> bool:
        assert self.log is not None
        try:
            data = self.log.read_bytes()
        except FileNotFoundError:
            return False
        return f'"event": "{name}"'.encode() in data or f'"event":"{name}"'.encode() in data

    def queue_stats(self) -> dict[str, Any]:
        result = subprocess.run([sys.executable, "-m", "agent", "queue", "stats", "--json", "--config",
                                 str(self.config)], capture_output=True, text=True, timeout=60,
                                env=_clean_env(), check=False)
        if result.returncode != 0:
            raise BenchError(f"queue stats failed: {result.stderr.strip()}")
        stats: dict[str, Any] = json.loads(result.stdout)
        return stats


def _admin_listen(config_text: str) -> str:
    for line in config_text.splitlines():
        if line.startswith("listen = ") and "127.0.0.1" in line:
            return line.split('"')[1]
    raise ValueError("the bench configuration has no admin address")


def check_config(config_text: str, workdir: Path) -> tuple[int, str]:
    """``hl7-agent check-config``: (exit code, error text) for this configuration."""
    path = workdir / "check.toml"
    path.write_text(config_text)
    result = subprocess.run([sys.executable, "-m", "agent", "check-config", "--config", str(path)],
                            capture_output=True, text=True, timeout=60, env=_clean_env(), check=False)
    return result.returncode, (result.stderr or result.stdout).strip()


# -- /proc ---------------------------------------------------------------------------


def user_system_seconds(stat: str) -> tuple[float, float]:
    """(utime, stime) in seconds from the text of a /proc .../stat file (fields 14 and 15)."""
    fields = stat[stat.rfind(")") + 2 :].split()  # after the command name, which may hold spaces
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc/PID/stat."""
    return sum(user_system_seconds(Path(f"/proc/{pid}/stat").read_text()))


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds per thread name (/proc/PID/task/*/stat), threads of one name summed."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            stat = (task / "stat").read_text()
        except OSError:
            continue
        out[name] = out.get(name, 0.0) + sum(user_system_seconds(stat))
    return out


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def socket_fds(pid: int) -> int:
    n = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            if os.readlink(fd).startswith("socket:"):
                n += 1
    return n


class CpuSampler:
    """Samples CPU seconds of some PIDs every ``interval`` on a thread, with CLOCK_MONOTONIC stamps."""

    def __init__(self, pids: dict[str, int], interval: float = 0.1) -> None:
        self.pids = pids
        self.interval = interval
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while True:
            row: dict[str, float] = {}
            for name, pid in self.pids.items():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    row[name] = cpu_seconds(pid)
            self.samples.append((time.monotonic(), row))
            if self._stop.wait(self.interval):
                return

    def seconds(self, name: str, t0: float, t1: float) -> float:
        """CPU seconds ``name`` used between t0 and t1 (the samples nearest inside), NaN without two."""
        inside = [(t, row[name]) for t, row in self.samples if t0 <= t <= t1 and name in row]
        if len(inside) < 2:
            return float("nan")
        return inside[-1][1] - inside[0][1]

    def share(self, name: str, t0: float, t1: float) -> float:
        """CPU seconds per wall second of ``name`` between t0 and t1 (1.0 = one full core)."""
        inside = [(t, row[name]) for t, row in self.samples if t0 <= t <= t1 and name in row]
        if len(inside) < 2:
            inside = [(t, row[name]) for t, row in self.samples if name in row]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return float("nan")
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


# -- the disk ------------------------------------------------------------------------


def fsync_rate(directory: Path, seconds: float) -> float:
    """4 KiB write + fsync per loop on ``directory``'s file system: the floor of one commit per message.

    The writes overwrite a preallocated file in turn, as SQLite rewrites its
    WAL from the start after each checkpoint: appending would also journal
    the file's new size on every fsync and understate the disk.
    """
    path = directory / "fsync-probe.bin"
    size = 4 << 20
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, bytes(size))
        os.fsync(fd)
        n = offset = 0
        page = b"x" * 4096
        started = time.perf_counter()
        while time.perf_counter() - started < seconds or n < 5:
            os.pwrite(fd, page, offset)
            os.fsync(fd)
            offset = (offset + len(page)) % size
            n += 1
        return n / (time.perf_counter() - started)
    finally:
        os.close(fd)
        path.unlink()


def filesystem_of(path: Path) -> str:
    """'device (fstype) at mountpoint' for the mount that holds ``path``."""
    best = ("?", "?", "/")
    target = str(path.resolve())
    for line in Path("/proc/mounts").read_text().splitlines():
        dev, mnt, fstype = line.split()[:3]
        if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[2]):
            best = (dev, fstype, mnt)
    return f"{best[0]} ({best[1]}) at {best[2]}"


def machine(workdir: Path) -> dict[str, Any]:
    cpu = "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "disk": filesystem_of(workdir),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
    }


def print_machine(info: dict[str, Any]) -> None:
    print(f"machine: {info['nproc']} x {info['cpu']}, Linux {info['kernel']}, Python {info['python']}, "
          f"SQLite {info['sqlite']}; data on {info['disk']}; load average {' '.join(info['loadavg'])}; "
          f"{info['date']}", flush=True)


# -- workdir, profiling, numbers -------------------------------------------------------


@contextlib.contextmanager
def workdir(path: str | None, keep: bool) -> Iterator[Path]:
    """The bench's directory (data dirs, logs): a fresh temp dir removed at the end unless kept."""
    if path:
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        yield root
        return
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="hl7-agent-bench-"))
    try:
        yield root
    finally:
        if keep:
            print(f"kept {root}", flush=True)
        else:
            shutil.rmtree(root, ignore_errors=True)


def py_spy(pid: int, out: Path, seconds: float, *, native: bool = True) -> Process:
    """``py-spy record`` of ``pid`` for ``seconds`` into ``out`` (collapsed stacks, per thread).

    ``--idle`` keeps the samples of waiting threads too, so every thread has
    one sample per tick and bench/profile_summary.py can split wall time
    into running, waiting for I/O, for the disk and for the GIL.
    """
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        raise BenchError("--profile needs py-spy: pip install py-spy (into the bench's venv)")
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", "200",
           "--format", "raw", "--threads", "--idle", "--full-filenames", "-o", str(out)]
    if native:
        cmd.append("--native")
    return Process(cmd, log=out.with_suffix(".py-spy.log"))


def raise_nofile(want: int) -> int:
    """Raise RLIMIT_NOFILE (soft) to ``want`` or the hard limit; returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def mib(n: float) -> float:
    return n / (1024 * 1024)


def write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=2) + "\n")


def verdict(ok: bool) -> str:
    return "MET" if ok else "NOT MET"

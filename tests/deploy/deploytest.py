"""Helpers for the deployment tests: real systemd, a real container engine, the doc's own commands.

What they run on, and why each piece is real:

- **Debian 12 root filesystems** made with ``debootstrap`` from the Debian
  mirror, cached under ``/var/cache/hl7-agent-tests`` (override:
  ``HL7_AGENT_TEST_CACHE``) keyed by a hash of what goes into them, so only
  the first run pays for them (about a minute each). Each test module works
  on a throw-away overlay over the cached tree, which stays pristine.
- **systemd as PID 1** in ``systemd-nspawn`` (``--private-network``: the
  machine has only its own loopback and no internet). The tests reach into
  it with ``nsenter`` for shell commands and with ``setns(CLONE_NEWNET)`` on
  single threads of this process for TCP: the MLLP senders and the
  ``agent.app.devserver`` upstream run here, in the machine's network namespace,
  so everything stays on its 127.0.0.1.
- **podman** (daemonless, runtime runc, cgroupfs) inside a private mount and
  network namespace of its own, with its storage in the test's tmp dir: the
  doc's ``docker`` commands run verbatim (``docker`` is podman), publish
  their ports into that namespace only, and never see the host's images,
  ``/etc`` or ports.
- **The release** a user has: the repository's tracked files plus wheels
  built from them. The machines have no internet, so pip is pointed at a
  local wheelhouse of the dependencies (``/etc/pip.conf``), which is what an
  offline host does too.

Commands a user runs come from docs/deploy.md itself (``doc_block``): each is
marked there by an HTML comment ``<!-- deploy-test: NAME -->`` before its
fenced block, and is run as it stands.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from agenttest import REPO_ROOT, DevServerThread, ack_code, hl7_message, msa2, wait_for

from agent.core import mllp

T = TypeVar("T")

CACHE = Path(os.environ.get("HL7_AGENT_TEST_CACHE", "/var/cache/hl7-agent-tests"))
DEBIAN_MIRROR = os.environ.get("HL7_AGENT_TEST_DEBIAN_MIRROR", "http://deb.debian.org/debian")
DEBIAN_SUITE = "bookworm"  # Debian 12, whose python3 is 3.11
#: Bump when the way a root filesystem is made changes (it is part of the cache key).
ROOTFS_RECIPE = 1
DOC = REPO_ROOT / "docs" / "deploy.md"
#: The packages the CI host needs (.ci/run installs them).
HOST_PACKAGES = "systemd-container debootstrap podman runc"


# --------------------------------------------------------------------------
# can this machine run them at all?


def require_root_and_kernel(*tools: str) -> None:
    """Skip when the machine cannot run deployment tests; fail when it only lacks packages.

    Not root, or a kernel without mount/network/PID namespaces or overlayfs:
    nothing can be done, skip saying so. A missing tool is a missing
    package, which ``.ci/run`` installs: that is a failure with the fix in it.
    """
    if os.geteuid() != 0:
        pytest.skip("deployment tests need root (systemd-nspawn, podman, mount namespaces)")
    probe = subprocess.run(
        ["unshare", "--mount", "--net", "--pid", "--fork", "true"],
        check=False, capture_output=True, text=True, timeout=30,
    )
    if probe.returncode != 0:
        pytest.skip(f"this kernel gives no mount/network/PID namespaces: {probe.stderr.strip()}")
    if "overlay" not in Path("/proc/filesystems").read_text(encoding="ascii"):
        pytest.skip("this kernel has no overlayfs")
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        pytest.fail(
            f"{', '.join(missing)} not installed: apt-get install -y {HOST_PACKAGES} "
            "(as .ci/run does), or deselect these tests with -m 'not deploy'",
            pytrace=False,
        )


# --------------------------------------------------------------------------
# cached Debian root filesystems


def debian_rootfs(name: str, packages: list[str], *, masks: tuple[str, ...] = ()) -> Path:
    """A debootstrapped Debian 12 (minbase + ``packages``), built once and cached.

    The cache key hashes the suite, the packages, the masked units and
    ``ROOTFS_RECIPE``. Concurrent runs wait on a lock file; a half-built
    tree is never visible under the final name (built aside, then renamed).
    """
    recipe = json.dumps([DEBIAN_SUITE, sorted(packages), sorted(masks), ROOTFS_RECIPE])
    key = hashlib.sha256(recipe.encode()).hexdigest()[:16]
    CACHE.mkdir(parents=True, exist_ok=True, mode=0o755)
    final = CACHE / f"{name}-{key}"
    with (CACHE / f".{name}-{key}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.is_dir():
            return final
        work = Path(tempfile.mkdtemp(prefix=f".{name}-{key}.", dir=CACHE))
        try:
            tree = work / "rootfs"
            proc = subprocess.run(
                ["debootstrap", "--variant=minbase", f"--include={','.join(packages)}",
                 DEBIAN_SUITE, str(tree), DEBIAN_MIRROR],
                check=False, capture_output=True, text=True, timeout=900,
            )
            if proc.returncode != 0:
                raise AssertionError(
                    f"debootstrap {DEBIAN_SUITE} from {DEBIAN_MIRROR} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
                )
            # Packages are in; the downloaded .debs are not needed again.
            for deb in (tree / "var/cache/apt/archives").glob("*.deb"):
                deb.unlink()
            for unit in masks:
                link = tree / "etc/systemd/system" / unit
                link.parent.mkdir(parents=True, exist_ok=True)
                link.unlink(missing_ok=True)
                link.symlink_to("/dev/null")
            tree.rename(final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final


# --------------------------------------------------------------------------
# the release: source tree, wheels, dependency wheelhouse


@dataclass
class Release:
    """What a user unpacks on the host: the tracked source tree with the wheels beside it."""

    tree: Path  # docs/, systemd/, config/, Dockerfile ... and hl7_agent-<v>-py3-none-any.whl
    wheelhouse: Path  # the dependencies (and the build backend), for offline pip
    versions: tuple[str, ...]

    def wheel(self, version: str) -> Path:
        return self.tree / f"hl7_agent-{version}-py3-none-any.whl"


def _tracked_files() -> list[str]:
    proc = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT, check=True, capture_output=True, timeout=60,
    )
    return [name for name in proc.stdout.decode().split("\0") if name]


def copy_tracked_tree(dest: Path) -> Path:
    """The repository's files as they are in the work tree, new ones too, without ignored ones."""
    for name in _tracked_files():
        src = REPO_ROOT / name
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            target.symlink_to(os.readlink(src))
        elif src.exists():
            shutil.copy2(src, target)
    return dest


def build_release(tmp: Path, versions: tuple[str, ...] = ("1.0.0", "1.1.0")) -> Release:
    """Wheels of this work tree labelled with ``versions``, and their dependencies.

    The version in a copy's pyproject.toml and agent/__init__.py is
    rewritten, so an upgrade from one to the next is visible in the daemon's
    own ``agent_started`` line.
    """
    tree = copy_tracked_tree(tmp / "release")
    wheelhouse = tmp / "wheelhouse"
    wheelhouse.mkdir()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    for version in versions:
        src = copy_tracked_tree(tmp / f"src-{version}")
        for name, key in (("pyproject.toml", "version"), ("agent/__init__.py", "__version__")):
            path = src / name
            text, n = re.subn(rf'(?m)^{key} = "[^"]+"$', f'{key} = "{version}"', path.read_text())
            assert n == 1, f"{name} has no {key} line"
            path.write_text(text)
        subprocess.run([*pip, "wheel", "--no-deps", "--wheel-dir", str(tree), str(src)],
                       check=True, capture_output=True, timeout=300)
        shutil.rmtree(src)
    # Dependencies, plus what an isolated build of the project needs (Dockerfile's builder).
    subprocess.run(
        [*pip, "wheel", "--wheel-dir", str(wheelhouse), str(tree / f"hl7_agent-{versions[0]}-py3-none-any.whl"),
         "setuptools>=77", "wheel"],
        check=True, capture_output=True, timeout=600,
    )
    for own in wheelhouse.glob("hl7_agent-*.whl"):
        own.unlink()
    return Release(tree=tree, wheelhouse=wheelhouse, versions=versions)


def offline_pip_conf(wheelhouse: str) -> str:
    """/etc/pip.conf of a host without internet: dependencies from a local directory."""
    return f"[global]\nno-index = true\nfind-links = {wheelhouse}\ndisable-pip-version-check = true\n"


# --------------------------------------------------------------------------
# the doc's commands


def doc_block(name: str, doc: Path = DOC) -> str:
    """The fenced block that follows ``<!-- deploy-test: NAME -->`` in docs/deploy.md."""
    text = doc.read_text(encoding="utf-8")
    match = re.search(
        rf"^<!-- deploy-test: {re.escape(name)} -->\n```[a-z]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL,
    )
    assert match, f"{doc.name} has no block marked <!-- deploy-test: {name} -->"
    return match.group(1)


# --------------------------------------------------------------------------
# network namespaces, one thread at a time

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def enter_netns(fd: int) -> None:
    """Move the calling thread (only it: setns(2) is per thread) into a network namespace."""
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(CLONE_NEWNET): {os.strerror(err)}")


def in_netns(fd: int, fn: Callable[[], T], timeout: float = 60.0) -> T:
    """Run ``fn`` on a fresh thread inside the namespace; its sockets stay there."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            enter_netns(fd)
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name="in-netns", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise AssertionError(f"{fn!r} in the namespace did not finish within {timeout}s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def devserver_in(fd: int, *, token: str, host: str = "127.0.0.1", port: int = 8080) -> DevServerThread:
    """The real ``agent.app.devserver`` upstream, listening inside a network namespace."""
    dev = DevServerThread(token=token, port=port)

    async def start() -> None:
        # The loop thread creates every socket of the server: move it first.
        enter_netns(fd)
        await dev.server.start(host, port)

    dev.call(start())
    return dev


def exchange_in(fd: int, port: int, message: bytes, timeout: float = 20.0) -> bytes:
    """One MLLP round trip on a new connection from inside the namespace; the ACK's payload."""

    def run() -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(mllp.encode_frame(message))
            decoder = mllp.MllpDecoder(1 << 20)
            while True:
                data = sock.recv(65536)
                if not data:
                    raise ConnectionError("closed without an ACK")
                frames = [e for e in decoder.feed(data) if isinstance(e, mllp.Frame)]
                if frames:
                    return bytes(frames[0].payload)

    return in_netns(fd, run, timeout + 5)


# --------------------------------------------------------------------------
# senders under load


@dataclass
class Sender:
    """One MLLP sender: sequential messages, each resent until it gets its AA (as senders do).

    ``persistent`` keeps one connection open across messages (the usual
    interface engine), else one connection per message. A refused connect is
    counted and retried; a connection that breaks before its ACK is reopened
    and the same message (same MSH-10) resent.
    """

    netns: int
    port: int
    prefix: str
    persistent: bool = True
    pace: float = 0.01
    acked: list[str] = field(default_factory=list)
    refused: int = 0
    broken: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Sender:
        self._thread = threading.Thread(target=self._run, name=f"sender-{self.prefix}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Finish the message in hand (until its AA), then stop."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            assert not self._thread.is_alive(), f"sender {self.prefix} did not finish its last message"

    def _run(self) -> None:
        enter_netns(self.netns)
        sock: socket.socket | None = None
        decoder = mllp.MllpDecoder(1 << 20)
        n = 0
        deadline_per_message = 90.0
        while not self._stop.is_set():
            control_id = f"{self.prefix}-{n:06d}"
            frame = mllp.encode_frame(hl7_message(control_id))
            started = time.monotonic()
            while True:  # until this message has its AA
                if time.monotonic() - started > deadline_per_message:
                    self.failures.append(f"{control_id}: no AA within {deadline_per_message}s")
                    return
                try:
                    if sock is None:
                        sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
                        decoder = mllp.MllpDecoder(1 << 20)
                    sock.sendall(frame)
                    ack = self._read_ack(sock, decoder)
                except ConnectionRefusedError:
                    self.refused += 1
                    sock = None
                    self._stop.wait(0.02)  # a sender's reconnect delay, not synchronisation
                    continue
                except OSError:
                    self.broken += 1
                    if sock is not None:
                        sock.close()
                    sock = None
                    continue
                if ack_code(ack) != "AA" or msa2(ack) != control_id:
                    self.failures.append(f"{control_id}: {ack_code(ack)} for {msa2(ack)}")
                    return
                self.acked.append(control_id)
                break
            n += 1
            if not self.persistent and sock is not None:
                sock.close()
                sock = None
            self._stop.wait(self.pace)
        if sock is not None:
            sock.close()

    @staticmethod
    def _read_ack(sock: socket.socket, decoder: mllp.MllpDecoder) -> bytes:
        while True:
            data = sock.recv(65536)
            if not data:
                raise ConnectionResetError("closed before the ACK")
            frames = [e for e in decoder.feed(data) if isinstance(e, mllp.Frame)]
            if frames:
                return bytes(frames[0].payload)


class Load:
    """Two senders per channel (one persistent connection, one connection per message)."""

    def __init__(self, netns: int, ports: dict[str, int], tag: str) -> None:
        self.tag = tag
        self.senders = [
            Sender(netns, port, f"{tag}-{channel}-{style}", persistent=(style == "p"))
            for channel, port in ports.items()
            for style in ("p", "c")
        ]

    def __enter__(self) -> Load:
        for sender in self.senders:
            sender.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for sender in self.senders:
            sender.stop()

    def wait_acked(self, count: int, timeout: float = 60.0) -> None:
        """Until every sender has had ``count`` more messages accepted than now."""
        base = {s.prefix: len(s.acked) for s in self.senders}
        wait_for(
            lambda: all(len(s.acked) >= base[s.prefix] + count for s in self.senders) or self._failed(),
            timeout, interval=0.05, what=f"{count} more AAs per sender",
        )
        assert not self._failed(), self.report()

    def _failed(self) -> bool:
        return any(s.failures for s in self.senders)

    @property
    def refused(self) -> int:
        return sum(s.refused for s in self.senders)

    @property
    def acked(self) -> int:
        return sum(len(s.acked) for s in self.senders)

    def report(self) -> str:
        return "; ".join(
            f"{s.prefix}: {len(s.acked)} acked, {s.refused} refused, {s.broken} broken {s.failures[:3]}"
            for s in self.senders
        )

    def assert_delivered_once_in_order(self, dev: DevServerThread, *, allow_resend: bool = False,
                                       timeout: float = 90.0) -> None:
        """Every AA'd message reached the server exactly once, in its sender's order.

        Per channel: one queue row per MSH-10 (a retransmitted message is not
        queued twice), the channel's sequence numbers rising without a gap,
        and no transmit sent twice, unless ``allow_resend``: after a crash the
        rows that were in flight are sent again under the same transmit id
        (at-least-once to a server that deduplicates by id), in order.
        """
        assert not self._failed(), self.report()
        wanted = {cid for s in self.senders for cid in s.acked}

        def arrived() -> bool:
            got = {t.control_id for t in list(dev.server.received)}
            return wanted <= got

        wait_for(arrived, timeout, interval=0.2, what="every accepted message at the dev-server")
        received = [t for t in list(dev.server.received) if t.control_id.startswith(self.tag + "-")]
        by_channel: dict[str, list[Any]] = {}
        for t in received:
            by_channel.setdefault(t.channel, []).append(t)
        first_arrivals: list[Any] = []
        for channel, transmits in by_channel.items():
            ids = [t.id for t in transmits]
            if not allow_resend:
                assert len(ids) == len(set(ids)), f"{channel}: a transmit reached the server twice"
            distinct, seen = [], set()
            for t in transmits:  # each transmit at its first arrival
                if t.id not in seen:
                    seen.add(t.id)
                    distinct.append(t)
            cids = [t.control_id for t in distinct]
            assert len(cids) == len(set(cids)), f"{channel}: an MSH-10 was queued twice"
            seqs = [t.seq for t in distinct]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"{channel}: seq gap or reorder {seqs[:20]}"
            first_arrivals += distinct
        for sender in self.senders:
            mine = [t.control_id for t in first_arrivals if t.control_id.startswith(sender.prefix + "-")]
            assert mine == sender.acked, f"{sender.prefix}: order or loss"


# --------------------------------------------------------------------------
# systemd in systemd-nspawn


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


class NspawnMachine:
    """Debian 12 booted with systemd as PID 1, on an overlay over a cached root filesystem."""

    PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

    def __init__(self, lower: Path, tmp: Path, name: str) -> None:
        self.name = name
        self.tmp = tmp
        self.root = tmp / "root"
        for d in ("upper", "work", "root"):
            (tmp / d).mkdir(parents=True)
        subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o",
             f"lowerdir={lower},upperdir={tmp / 'upper'},workdir={tmp / 'work'}", str(self.root)],
            check=True, capture_output=True, timeout=30,
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.leader = 0
        self.netns = -1
        self.console = tmp / "console.log"

    # -- lifecycle --

    def boot(self, timeout: float = 90.0) -> NspawnMachine:
        env = {"PATH": self.PATH, "SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1", "LANG": "C.UTF-8"}
        with self.console.open("wb") as console:
            self.proc = subprocess.Popen(
                ["systemd-nspawn", "--quiet", "--boot", "--register=no", "--keep-unit",
                 "--private-network", "--console=passive", f"--machine={self.name}",
                 f"--directory={self.root}"],
                stdin=subprocess.DEVNULL, stdout=console, stderr=subprocess.STDOUT, env=env,
            )

        def leader() -> int:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"systemd-nspawn exited {self.proc.returncode}:\n{self.console_tail()}")
            for child in _children(self.proc.pid):
                with contextlib.suppress(OSError):
                    if Path(f"/proc/{child}/comm").read_text().strip() == "systemd":
                        return child
            return 0

        self.leader = wait_for(leader, 30, interval=0.05, what="the machine's PID 1")
        self.netns = os.open(f"/proc/{self.leader}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        def booted_state() -> str | None:
            # "offline": systemctl reached no systemd yet (its bus not up this early in
            # the boot; seen once in CI) — not an end state, ask again.
            state = self.sh("systemctl is-system-running --wait", check=False, timeout=timeout).stdout.strip()
            return None if state in ("", "offline", "initializing", "starting") else state

        state = wait_for(booted_state, timeout, what="systemd in the machine to finish booting")
        assert state in ("running", "degraded"), f"boot ended {state}:\n{self.sh('systemctl --failed', check=False).stdout}"
        return self

    def poweroff(self, timeout: float = 60.0) -> None:
        """Orderly shutdown (SIGTERM makes nspawn ask PID 1 to power off); SIGKILL by PID if stuck."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                if self.leader:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.leader, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                self.proc.wait(30)
        if self.netns >= 0:
            os.close(self.netns)
            self.netns = -1
        subprocess.run(["umount", "--lazy", str(self.root)], check=False, capture_output=True, timeout=60)

    def console_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.console.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no console output>"

    # -- inside --

    def sh(self, script: str, *, check: bool = True, timeout: float = 120.0, cwd: str = "/root",
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run a bash script as root inside the machine, with a clean login-like environment."""
        clean = {"PATH": self.PATH, "HOME": "/root", "LANG": "C.UTF-8", "TERM": "dumb", **(env or {})}
        proc = subprocess.run(
            ["nsenter", "-t", str(self.leader), "-m", "-u", "-i", "-n", "-p", "-C", "--",
             "/usr/bin/env", "-i", *(f"{k}={v}" for k, v in clean.items()),
             "/bin/bash", "-euo", "pipefail", "-c", f"cd {cwd}\n{script}"],
            check=False, capture_output=True, text=True, timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"in the machine, exit {proc.returncode}:\n$ {script}\n--- stdout\n{proc.stdout[-4000:]}\n"
                f"--- stderr\n{proc.stderr[-4000:]}"
            )
        return proc

    def path(self, inside: str) -> Path:
        """A path of the machine's file system, seen from the host (through the overlay)."""
        return self.root / inside.lstrip("/")

    def show(self, unit: str, prop: str) -> str:
        return self.sh(f"systemctl show -p {prop} --value {unit}").stdout.strip()

    def main_pid(self, unit: str) -> int:
        """The unit's main PID inside the machine (0 when not running)."""
        return int(self.show(unit, "MainPID") or 0)

    def host_pid(self, pid_inside: int) -> int:
        """The same process's PID as the host sees it (NSpid in /proc/PID/status)."""
        for candidate in Path("/proc").iterdir():
            if not candidate.name.isdigit():
                continue
            try:
                status = (candidate / "status").read_text()
            except OSError:
                continue
            match = re.search(r"^NSpid:\s+(.*)$", status, re.MULTILINE)
            if match:
                ids = match.group(1).split()
                if len(ids) >= 2 and int(ids[-1]) == pid_inside and self._in_machine(int(candidate.name)):
                    return int(candidate.name)
        raise AssertionError(f"no host PID for machine PID {pid_inside}")

    def _in_machine(self, host_pid: int) -> bool:
        try:
            return os.readlink(f"/proc/{host_pid}/ns/pid") == os.readlink(f"/proc/{self.leader}/ns/pid")
        except OSError:
            return False

    def journal(self, unit: str, *, priority: str | None = None, since: int | None = None) -> list[dict[str, Any]]:
        """The unit's journal entries (``journalctl -o json``), optionally by priority and after a mark.

        ``since`` is a ``mark()``; entries are filtered on their timestamp here,
        because journalctl 252 combined with matches skips the first matching
        entry after ``--after-cursor`` when the cursor's own entry does not match.
        """
        args = f"journalctl --no-pager -o json -u {unit}"
        if priority:
            args += f" -p {priority}"
        if since is not None:
            args += f" --since=@{since // 1_000_000}"
        out = self.sh(args, check=False).stdout
        entries = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        if since is not None:
            entries = [e for e in entries if int(e["__REALTIME_TIMESTAMP"]) > since]
        return entries

    def daemon_events(self, unit: str, name: str | None = None, **kwargs: Any) -> list[dict[str, Any]]:
        """The daemon's own JSON log lines in the unit's journal (event ``name`` if given)."""
        events = []
        for entry in self.journal(unit, **kwargs):
            message = entry.get("MESSAGE")
            if isinstance(message, str) and message.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    event = json.loads(message)
                    event["_PRIORITY"] = entry.get("PRIORITY")
                    event["_PID"] = entry.get("_PID")
                    if name is None or event.get("event") == name:
                        events.append(event)
        return events

    def mark(self) -> int:
        """The journal's newest timestamp (µs since the epoch), for 'what was logged after this'."""
        out = self.sh("journalctl --no-pager -n 1 -o json", check=False).stdout.strip()
        return int(json.loads(out.splitlines()[-1])["__REALTIME_TIMESTAMP"]) if out else 0


#: What the systemd machines' root filesystem holds besides minbase (part of its cache key).
SYSTEMD_PACKAGES = ["systemd", "systemd-sysv", "dbus", "python3", "python3-venv", "procps", "iproute2"]
#: No console in the machine (nspawn --console=passive): no getty on it.
MASKED_UNITS = ("console-getty.service",)
TOKEN = "deploy-test-token"
DEV_PORT = 8080
#: ``adt`` is hl7-agent.socket's port; ``lab`` has no socket unit (the daemon binds it).
PORTS = {"adt": 2575, "lab": 2576}
WHEELS = "/var/cache/hl7-agent-wheels"


def install_release(machine: NspawnMachine, release: Release) -> None:
    """The release directory as /root/release, and an offline pip (the machine has no internet)."""
    shutil.copytree(release.tree, machine.path("/root/release"), symlinks=True)
    shutil.copytree(release.wheelhouse, machine.path(WHEELS))
    machine.path("/etc/pip.conf").write_text(offline_pip_conf(WHEELS))


def edit_production_config(machine: NspawnMachine, url: str) -> None:
    """The edits docs/deploy.md asks for after ``systemd-prepare``: server URL, token, a channel."""
    config = machine.path("/etc/hl7-agent/agent.toml")
    text = config.read_text()
    text, n = re.subn(r'(?m)^url = "wss://hl7\.example\.org/agent"$', f'url = "{url}"', text)
    assert n == 1, "config/agent.production.toml has no url line to edit"
    text += '\n[[channels]]\nname = "lab"\nlisten = "0.0.0.0:2576"\nack = "commit"\n'
    config.write_text(text)
    machine.path("/etc/hl7-agent/token").write_text(TOKEN + "\n")


@contextlib.contextmanager
def booted(lower: Path, tmp: Path, name: str) -> Iterator[NspawnMachine]:
    """A booted machine, powered off and unmounted afterwards whatever happened."""
    machine = NspawnMachine(lower, tmp, name)
    try:
        machine.boot()
        yield machine
    finally:
        machine.poweroff()


@dataclass
class SystemdWorld:
    """A booted machine with the release installed as docs/deploy.md says, and its upstream."""

    machine: NspawnMachine
    dev: DevServerThread
    release: Release


@contextlib.contextmanager
def installed_systemd(tmp: Path, name: str, layout: str) -> Iterator[SystemdWorld]:
    """docs/deploy.md word for word: ``systemd-prepare``, the edits, then the ``layout`` block.

    ``layout`` is the doc block of the unit layout (``systemd-single`` or
    ``systemd-pair``). The dev server listens in the machine's network
    namespace; machine and server are stopped whatever happened.
    """
    require_root_and_kernel("systemd-nspawn", "debootstrap", "nsenter")
    lower = debian_rootfs("debian12-systemd", SYSTEMD_PACKAGES, masks=MASKED_UNITS)
    release = build_release(tmp)
    with booted(lower, tmp / "machine", name) as machine:
        install_release(machine, release)
        dev = devserver_in(machine.netns, token=TOKEN, port=DEV_PORT)
        try:
            machine.sh(doc_block("systemd-prepare"), cwd="/root/release", timeout=300)
            edit_production_config(machine, f"ws://127.0.0.1:{DEV_PORT}/agent")
            machine.sh(doc_block(layout), cwd="/root/release", timeout=300)
            yield SystemdWorld(machine, dev, release)
        finally:
            dev.stop()


# --------------------------------------------------------------------------
# podman in a namespace of its own


class PodmanSandbox:
    """A private mount + network namespace where ``docker`` is podman with throw-away storage.

    Inside: ``/etc`` is an overlay (the doc's ``/etc/hl7-agent`` never
    touches the host's), ``/run`` a tmpfs, the network only loopback plus
    podman's own bridge, podman's images, containers and volumes under the
    test's tmp dir. The engine is configured for this host: runtime runc,
    cgroup manager cgroupfs (no systemd), events to a file, and rlimits no
    higher than this process's own (root here may lack CAP_SYS_RESOURCE).
    """

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        conf = tmp / "conf"
        bin_dir = tmp / "bin"
        for d in (conf, bin_dir, tmp / "etc-upper", tmp / "etc-work", tmp / "storage"):
            d.mkdir(parents=True)
        nofile = _hard_limit("RLIMIT_NOFILE")
        nproc = min(_hard_limit("RLIMIT_NPROC"), int(Path("/proc/sys/kernel/pid_max").read_text()))
        (conf / "containers.conf").write_text(
            "[containers]\n"
            f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
            "[engine]\n"
            'cgroup_manager = "cgroupfs"\nruntime = "runc"\nevents_logger = "file"\n'
        )
        (conf / "storage.conf").write_text(
            f'[storage]\ndriver = "overlay"\ngraphroot = "{tmp / "storage"}"\nrunroot = "/run/hl7-agent-test-podman"\n'
        )
        docker = bin_dir / "docker"
        docker.write_text('#!/bin/sh\nexec podman "$@"\n')
        docker.chmod(0o755)
        self.env = {
            "PATH": f"{bin_dir}:{NspawnMachine.PATH}",
            "HOME": "/root",
            "LANG": "C.UTF-8",
            "CONTAINERS_CONF": str(conf / "containers.conf"),
            "CONTAINERS_STORAGE_CONF": str(conf / "storage.conf"),
            # podman writes OCI images by default, which have no HEALTHCHECK.
            "BUILDAH_FORMAT": "docker",
        }
        setup = (
            "set -e; mount --make-rprivate /; ip link set lo up; "
            f"mount -t overlay overlay -o lowerdir=/etc,upperdir={tmp / 'etc-upper'},workdir={tmp / 'etc-work'} /etc; "
            "mount -t tmpfs -o mode=0755 tmpfs /run; exec cat"
        )
        self.holder = subprocess.Popen(
            ["unshare", "--mount", "--net", "--propagation", "private", "bash", "-c", setup],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        wait_for(self._ready, 30, interval=0.05, what="the podman sandbox namespaces")
        self.netns = os.open(f"/proc/{self.holder.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)

    def _ready(self) -> bool:
        if self.holder.poll() is not None:
            assert self.holder.stderr is not None
            raise AssertionError(f"sandbox set-up failed: {self.holder.stderr.read().decode()}")
        try:
            return Path(f"/proc/{self.holder.pid}/comm").read_text().strip() == "cat"
        except OSError:
            return False

    def sh(self, script: str, *, check: bool = True, timeout: float = 300.0,
           cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        """Run a bash script (as root) inside the sandbox."""
        proc = subprocess.run(
            ["nsenter", "-t", str(self.holder.pid), "-m", "-n", "--",
             "/usr/bin/env", "-i", *(f"{k}={v}" for k, v in self.env.items()),
             "/bin/bash", "-euo", "pipefail", "-c", f"cd {cwd or self.tmp}\n{script}"],
            check=False, capture_output=True, text=True, timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"in the sandbox, exit {proc.returncode}:\n$ {script}\n--- stdout\n{proc.stdout[-4000:]}\n"
                f"--- stderr\n{proc.stderr[-4000:]}"
            )
        return proc

    def inspect(self, name: str, template: str) -> str:
        return self.sh(f"podman inspect -f '{template}' {name}").stdout.strip()

    def close(self) -> None:
        """Remove every container (stopping their conmon processes), then end the namespaces."""
        with contextlib.suppress(Exception):
            self.sh("podman rm --all --force --time 5 >/dev/null 2>&1 || true", check=False, timeout=120)
        if self.netns >= 0:
            os.close(self.netns)
            self.netns = -1
        if self.holder.poll() is None:
            assert self.holder.stdin is not None
            self.holder.stdin.close()
            try:
                self.holder.wait(30)
            except subprocess.TimeoutExpired:
                self.holder.kill()
                self.holder.wait(10)
        if self.holder.stderr is not None:
            self.holder.stderr.close()


def _hard_limit(name: str) -> int:
    return int(resource.getrlimit(getattr(resource, name))[1])

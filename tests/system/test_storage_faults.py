"""Storage faults with the daemon as a subprocess: a full disk, a read-only filesystem, a locked database.

Real parts only: the test mounts a small tmpfs (or an ext4 image on a loop
device) itself and fills it with a real file; the lock is held by the real
``sqlite3`` shell. Mounting needs root: without it (or where mount is
refused, e.g. in an unprivileged container) each test skips and says why.

What must hold (SPEC 4 backpressure, SPEC 6, SPEC 8 "resumes by itself"):
below ``min_free_disk_bytes`` intake answers AR with ERR-3 207, never AA;
whatever was accepted is delivered; the reserve below the floor stays for
dispatch even after a burst; space comes back once delivered rows are gone,
and intake resumes without a restart.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from agenttest import (
    Daemon,
    DevServerThread,
    MllpClient,
    ack_code,
    err3,
    free_port,
    hl7_message,
    http_get,
    toml_config,
    wait_for,
)

from agent.core import mllp
from agent.storage.store import FREE_PAGE_SLACK

pytestmark = pytest.mark.slow

MiB = 1024 * 1024


def _run(*cmd: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


@contextmanager
def tmpfs(path: Path, size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes mounted on ``path`` for the test, unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs for a full disk needs root")
    path.mkdir()
    mounted = _run("mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path))
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        if _run("umount", str(path)).returncode != 0:
            _run("umount", "-l", str(path))


def free_bytes(mount: Path) -> int:
    st = os.statvfs(mount)
    return st.f_bavail * st.f_frsize


def space_held(mount: Path) -> str:
    """Where the space is, for a failure message: the free bytes, the queue file and its WAL."""
    files = {p.name: p.stat().st_size for p in (mount / "data").glob("queue.db*")}
    return f"{free_bytes(mount) / MiB:.2f} MiB free; " + ", ".join(
        f"{name} {size / MiB:.2f} MiB" for name, size in sorted(files.items()))


def fill_to(mount: Path, leave: int) -> Path:
    """Grow (or shrink) a filler file so that about ``leave`` bytes stay free."""
    filler = mount / "filler"
    with filler.open("ab") as f:
        while (gap := free_bytes(mount) - leave) > 0:
            f.write(b"\0" * min(gap, 4 * MiB))
            f.flush()
    if free_bytes(mount) < leave:
        size = filler.stat().st_size
        os.truncate(filler, max(0, size - (leave - free_bytes(mount))))
    return filler


def delivered(dev: DevServerThread) -> set[str]:
    return {t.control_id for t in list(dev.server.received)}


def config(data_dir: Path, port: int, up_port: int, *, floor: int, admin_port: int | None = None,
           extra: str = "") -> str:
    return toml_config(data_dir, [{"name": "adt", "listen": f"127.0.0.1:{port}"}],
                       server_url=f"ws://127.0.0.1:{up_port}/agent", admin_port=admin_port,
                       extra=f"[queue]\nmin_free_disk_bytes = {floor}\n{extra}")


def test_a_full_disk_refuses_then_resumes_by_itself(tmp_path: Path) -> None:
    """Below the floor: AR 207 and never AA; once the backlog is delivered the space comes back
    and intake answers AA again, with no restart and no operator."""
    floor = 16 * MiB
    with tmpfs(tmp_path / "fs", 64 * MiB) as fs:
        port, up_port = free_port(), free_port()
        daemon = Daemon(tmp_path, config(fs / "data", port, up_port, floor=floor))
        dev: DevServerThread | None = None
        try:
            daemon.start().wait_started()
            fill_to(fs, floor + 12 * MiB)
            accepted: list[str] = []
            with MllpClient(port) as client:
                for n in range(2000):
                    ack = client.exchange(hl7_message(f"F{n:05d}", pid="X" * 20_000))
                    if ack_code(ack) == "AR":
                        assert err3(ack) == "207", ack
                        break
                    assert ack_code(ack) == "AA", ack
                    accepted.append(f"F{n:05d}")
                else:
                    raise AssertionError("the floor never refused a message")
                lowest = free_bytes(fs)
                for n in range(10):  # below the floor: never an accept
                    ack = client.exchange(hl7_message(f"R{n:05d}", pid="X" * 20_000))
                    assert (ack_code(ack), err3(ack)) == ("AR", "207"), ack
                    assert b"disk space low: message not accepted, resend later" in ack, ack
            assert len(accepted) >= 20, accepted
            assert lowest >= floor - MiB, f"intake took the disk to {lowest} bytes free, floor {floor}"
            dev = DevServerThread(port=up_port).start()
            wait_for(lambda: set(accepted) <= delivered(dev), 60, what="every accepted message delivered")
            drained_at = time.monotonic()
            with MllpClient(port) as client:
                probes = iter(range(100_000))

                def accepts_again() -> bool:
                    ack = client.exchange(hl7_message(f"P{next(probes):05d}", pid="X" * 20_000))
                    assert ack_code(ack) in ("AA", "AR"), ack
                    return ack_code(ack) == "AA"

                wait_for(accepts_again, 30, interval=0.25, what="intake to resume by itself")
            resumed_after = time.monotonic() - drained_at
            # The delivered rows' pages and the WAL go back to the filesystem
            # by themselves (no more traffic, no restart): most of the ~8 MiB
            # the backlog took.
            try:
                wait_for(lambda: free_bytes(fs) >= floor + 6 * MiB, 30, interval=0.1,
                         what="the backlog's space back on the filesystem")
            except AssertionError as exc:
                raise AssertionError(f"{exc}: {space_held(fs)}") from None
            back_after = time.monotonic() - drained_at
            back = free_bytes(fs)
            print(f"\nfull disk: {len(accepted)} accepted, lowest free {lowest / MiB:.2f} MiB "
                  f"(floor {floor / MiB:.0f} MiB); intake resumed {resumed_after:.2f} s after the "
                  f"backlog was delivered; {(back - lowest) / MiB:.2f} MiB back on the filesystem "
                  f"after {back_after:.2f} s")
            assert daemon.stop() == 0, daemon.log_tail()
        finally:
            daemon.kill()
            if dev is not None:
                dev.stop()


def test_purged_pages_go_back_to_the_filesystem_within_seconds(tmp_path: Path) -> None:
    """An operator purges delivered rows: the daemon hands the pages beyond its slack back and
    the file really shrinks within seconds, on a roomy disk too (no floor crossed).

    Releasing pages only shortens the database in the WAL; the file shrinks at the next complete
    checkpoint. Without one of its own the daemon left that to SQLite's auto-checkpoint (only
    after 1000 WAL frames, and a release writes a handful) or to ``checkpoint_interval``. The
    restart empties the WAL (a truncating checkpoint at shutdown) so the release's few frames
    cannot reach that threshold by chance.
    """
    port, up_port = free_port(), free_port()
    data = tmp_path / "data"
    db_path = data / "queue.db"
    cfg = toml_config(data, [{"name": "adt", "listen": f"127.0.0.1:{port}"}],
                      server_url=f"ws://127.0.0.1:{up_port}/agent",
                      extra="[queue]\nmin_free_disk_bytes = 0\ncheckpoint_interval = 300\n")
    dev = DevServerThread(port=up_port).start()
    daemon = Daemon(tmp_path, cfg)
    try:
        daemon.start().wait_started()
        ids = [f"G{n:04d}" for n in range(400)]
        with MllpClient(port) as client:
            for cid in ids:
                assert ack_code(client.exchange(hl7_message(cid, pid="X" * 20_000))) == "AA"
        wait_for(lambda: set(ids) <= delivered(dev), 60, what="every message delivered")
        assert daemon.stop() == 0, daemon.log_tail()
        daemon = Daemon(tmp_path, cfg, name="agent-again")
        daemon.start().wait_started()
        full = db_path.stat().st_size
        purge = subprocess.run([sys.executable, "-m", "agent", "queue", "purge", "--config", str(daemon.config),
                                "--state", "processed", "--older-than", "0"],
                               capture_output=True, text=True, timeout=60, check=False)
        assert purge.returncode == 0, purge.stderr
        # What may stay: the slack of free pages kept for the next rows and the live pages.
        bound = (FREE_PAGE_SLACK + 256) * 4096
        assert full > bound + 2 * MiB, full
        wal = db_path.with_name("queue.db-wal")

        def footprint() -> int:
            return db_path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)

        started = time.monotonic()
        wait_for(lambda: footprint() <= bound, 15, interval=0.1,
                 what=f"the purged pages back on the filesystem (file and WAL at most {bound} bytes)")
        print(f"\npurge: the file went from {full / MiB:.2f} MiB to {footprint() / MiB:.2f} MiB "
              f"(with its WAL) in {time.monotonic() - started:.2f} s")
        assert daemon.stop() == 0, daemon.log_tail()
    finally:
        daemon.kill()
        dev.stop()


def _burst(port: int, prefix: str, count: int, size: int) -> list[tuple[str, bytes]]:
    """One connection pipelining ``count`` messages in one write, then reading every ACK."""
    ids = [f"{prefix}{n:03d}" for n in range(count)]
    with MllpClient(port, timeout=60) as client:
        client.send_raw(b"".join(mllp.encode_frame(hl7_message(c, pid="X" * size)) for c in ids))
        return [(c, client.read_ack()) for c in ids]


def test_a_burst_past_the_floor_leaves_dispatch_its_reserve(tmp_path: Path) -> None:
    """Pipelined senders overshoot nothing: free space is checked per commit batch, each intake
    charged, so the reserve below the floor stays and everything accepted is delivered."""
    floor = 8 * MiB
    with tmpfs(tmp_path / "fs", 48 * MiB) as fs:
        port, up_port = free_port(), free_port()
        daemon = Daemon(tmp_path, config(fs / "data", port, up_port, floor=floor))
        dev: DevServerThread | None = None
        try:
            daemon.start().wait_started()
            fill_to(fs, floor + 7 * MiB)
            with MllpClient(port) as client:
                assert ack_code(client.exchange(hl7_message("WARM"))) == "AA"
            results: list[list[tuple[str, bytes]]] = [[] for _ in range(6)]

            def sender(i: int) -> None:
                results[i] = _burst(port, f"B{i}-", 16, 256 * 1024)

            threads = [threading.Thread(target=sender, args=(i,)) for i in range(len(results))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(90)
            answers = [a for r in results for a in r]
            assert len(answers) == 6 * 16, "a sender got no ACKs"
            codes = {(ack_code(a), err3(a)) for _, a in answers}
            assert codes <= {("AA", ""), ("AR", "207")}, codes
            accepted = ["WARM"] + [c for c, a in answers if ack_code(a) == "AA"]
            refused = len(answers) - len(accepted) + 1
            lowest = free_bytes(fs)
            assert refused > 0, "the burst (24 MiB) never reached the floor"
            assert lowest >= floor - MiB, f"the burst took the disk to {lowest} bytes free, floor {floor}"
            dev = DevServerThread(port=up_port).start()
            wait_for(lambda: set(accepted) <= delivered(dev), 60, what="every accepted message delivered")
            print(f"\nburst: {len(accepted)} accepted, {refused} refused (AR 207), "
                  f"lowest free {lowest / MiB:.2f} MiB, floor {floor / MiB:.0f} MiB")
            assert daemon.stop() == 0, daemon.log_tail()
        finally:
            daemon.kill()
            if dev is not None:
                dev.stop()


def test_a_disk_filled_to_zero_during_an_outage_then_freed_drains_and_stays_above_the_floor(tmp_path: Path) -> None:
    """The wedge an audit found: a backlog at the floor, the disk filled to 0 from outside, the
    server back, the space back, a sender at full speed. The drain's burst of large rows once
    wrote 8 MiB of WAL before the writer's next checkpoint (its estimate came from quiet
    commits): the disk was full again, no checkpoint could complete, and nothing moved, even
    after a restart. Now every accepted message is delivered and the WAL keeps to its limit."""
    floor = MiB
    with tmpfs(tmp_path / "fs", 8 * MiB) as fs:
        port, up_port = free_port(), free_port()
        daemon = Daemon(tmp_path, config(fs / "data", port, up_port, floor=floor))
        dev: DevServerThread | None = None
        wal = fs / "data" / "queue.db-wal"
        try:
            daemon.start().wait_started()
            fill_to(fs, 3 * MiB)  # below the floor with the WAL's reserve: senders get AR
            accepted: list[str] = []
            with MllpClient(port) as client:
                for n in range(50):
                    ack = client.exchange(hl7_message(f"A{n:05d}", pid="X" * 3000))
                    assert ack_code(ack) in ("AA", "AR"), ack
                    if ack_code(ack) == "AA":
                        accepted.append(f"A{n:05d}")
            with (fs / "zero").open("wb") as f, contextlib.suppress(OSError):  # the disk to 0, from outside
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            dev = DevServerThread(port=up_port).start()
            with MllpClient(port) as client:
                assert ack_code(client.exchange(hl7_message("FULL0", pid="X" * 3000))) == "AR"
            (fs / "zero").unlink()
            (fs / "filler").unlink()
            lowest, longest_wal = free_bytes(fs), 0
            with MllpClient(port) as client:
                for n in range(600):
                    ack = client.exchange(hl7_message(f"B{n:05d}", pid="X" * 3000))
                    assert ack_code(ack) in ("AA", "AR"), ack
                    if ack_code(ack) == "AA":
                        accepted.append(f"B{n:05d}")
                    lowest, longest_wal = min(lowest, free_bytes(fs)), max(longest_wal, wal.stat().st_size)
            wait_for(lambda: set(accepted) <= delivered(dev), 60,
                     what=f"every accepted message delivered ({space_held(fs)})")
            print(f"\nfull-disk outage: {len(accepted)} accepted, all delivered; lowest free "
                  f"{lowest / MiB:.2f} MiB, longest WAL {longest_wal / MiB:.2f} MiB")
            assert lowest >= floor // 2, f"the agent itself took the disk to {lowest} bytes free"
            assert longest_wal <= 4 * MiB + 512 * 1024, longest_wal
            assert daemon.stop() == 0, daemon.log_tail()
        finally:
            daemon.kill()
            if dev is not None:
                dev.stop()


def test_readyz_fails_while_a_full_disk_fails_intake_commits(tmp_path: Path) -> None:
    """No floor set, the disk full: senders get AR 207 "storage failure", and /readyz says so at
    once — its own probe, one small row, may still fit in space the WAL reuses. Free space back:
    AA and ready again."""
    with tmpfs(tmp_path / "fs", 16 * MiB) as fs:
        port, up_port, admin = free_port(), free_port(), free_port()
        daemon = Daemon(tmp_path, config(fs / "data", port, up_port, floor=0, admin_port=admin))
        try:
            daemon.start().wait_started()
            with MllpClient(port) as client:
                assert ack_code(client.exchange(hl7_message("OK1"))) == "AA"
            with (fs / "zero").open("wb") as f, contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            with MllpClient(port) as client:
                for n in range(20):  # until a message no longer fits
                    ack = client.exchange(hl7_message(f"F{n:03d}", pid="X" * 30_000))
                    if ack_code(ack) != "AA":
                        break
                assert (ack_code(ack), err3(ack)) == ("AR", "207"), ack
            status, body = http_get(f"http://127.0.0.1:{admin}/readyz")
            # Whichever fails first names it: the probe's own row, or the messages' commits.
            assert status == 503 and (b"intake commits fail" in body or b"disk is full" in body), (status, body)
            (fs / "zero").unlink()
            with MllpClient(port) as client:
                assert ack_code(client.exchange(hl7_message("OK2"))) == "AA"
            assert http_get(f"http://127.0.0.1:{admin}/readyz")[0] == 200
            assert daemon.stop() == 0, daemon.log_tail()
        finally:
            daemon.kill()


LOCK_SECONDS = 30.0
#: The fallback when the sqlite3 shell is not installed: the same lines on stdin.
_PY_SHELL = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], timeout=10, isolation_level=None)
for line in sys.stdin:
    if line.strip() and not line.startswith("."):
        for row in conn.execute(line):
            print("|".join(map(str, row)), flush=True)
    if line.startswith(".quit"):
        break
"""


@contextmanager
def operator_shell_holding_the_write_lock(db_path: Path) -> Iterator[subprocess.Popen[str]]:
    """An operator's ``sqlite3`` shell that ran BEGIN IMMEDIATE and sits there (COMMIT on exit)."""
    cmd = (["sqlite3", "-batch", str(db_path)] if shutil.which("sqlite3")
           else [sys.executable, "-c", _PY_SHELL, str(db_path)])
    shell = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    assert shell.stdin is not None and shell.stdout is not None
    try:
        shell.stdin.write(".timeout 10000\nBEGIN IMMEDIATE;\nSELECT 'locked';\n")
        shell.stdin.flush()
        assert shell.stdout.readline().strip() == "locked"
        yield shell
        shell.stdin.write("COMMIT;\n.quit\n")
        shell.stdin.flush()
        assert shell.wait(10) == 0
    finally:
        if shell.poll() is None:
            shell.kill()
            shell.wait(10)
        for pipe in (shell.stdin, shell.stdout, shell.stderr):
            if pipe is not None:
                pipe.close()


MALFORMED = b"MSH|^~\\&|LAB|NORTH|EHR|CENTRAL|20260101120000|||LOCK-BAD|P|2.5.1\rPID|1\r"


def test_a_database_locked_by_an_operator_shell(tmp_path: Path) -> None:
    """An operator's sqlite3 shell holds BEGIN IMMEDIATE for 30 s: every wait is bounded (AR 207
    after about busy_timeout), the event loop keeps answering (a reject ACK, /healthz), nothing is
    accepted while locked, and everything is delivered after."""
    port, admin = free_port(), free_port()
    dev = DevServerThread().start()
    daemon = Daemon(tmp_path, toml_config(tmp_path / "data", [{"name": "adt", "listen": f"127.0.0.1:{port}"}],
                                          server_url=dev.url, admin_port=admin,
                                          extra="[queue]\nmin_free_disk_bytes = 0\nbusy_timeout = 2\n"))
    try:
        daemon.start().wait_started()
        before = [f"L{n}" for n in range(3)]
        with MllpClient(port) as client:
            for cid in before:
                assert ack_code(client.exchange(hl7_message(cid))) == "AA"
        wait_for(lambda: set(before) <= delivered(dev), 20, what="the first messages delivered")
        refused: list[str] = []
        waits: list[float] = []
        with operator_shell_holding_the_write_lock(tmp_path / "data" / "queue.db"):
            locked_at = time.monotonic()
            with MllpClient(port, timeout=30) as client, MllpClient(port, timeout=30) as other:
                n = 0
                while time.monotonic() - locked_at < LOCK_SECONDS - 6:
                    cid = f"W{n}"
                    n += 1
                    client.send(hl7_message(cid))
                    # Meanwhile the loop answers what needs no commit, at once.
                    started = time.monotonic()
                    assert ack_code(other.exchange(MALFORMED, timeout=2)) == "AE"
                    status, _ = http_get(f"http://127.0.0.1:{admin}/healthz", timeout=2)
                    assert status == 200
                    assert time.monotonic() - started < 2
                    ack = client.read_ack()
                    waits.append(time.monotonic() - started)
                    assert (ack_code(ack), err3(ack)) == ("AR", "207"), ack
                    refused.append(cid)
            while time.monotonic() - locked_at < LOCK_SECONDS:
                time.sleep(0.2)  # not a wait for anything: the lock is held for its full 30 s
        assert refused, "no message was tried while the database was locked"
        assert max(waits) < 2 * 2 + 3, f"a sender waited {max(waits):.1f} s for its AR"
        with MllpClient(port) as client:
            def accepted(cid: str) -> bool:
                return ack_code(client.exchange(hl7_message(cid))) == "AA"

            # The senders' resends after the lock: every one is taken and delivered.
            for cid in refused:
                wait_for(lambda c=cid: accepted(c), 20, interval=0.2, what=f"{cid} accepted after the lock")
        wait_for(lambda: set(before + refused) <= delivered(dev), 40, what="everything delivered after the lock")
        print(f"\nlocked {LOCK_SECONDS:.0f} s: {len(refused)} messages answered AR 207, "
              f"longest wait {max(waits):.2f} s, all delivered after")
        assert daemon.stop() == 0, daemon.log_tail()
    finally:
        daemon.kill()
        dev.stop()


@contextmanager
def ext4_image(tmp: Path, size: int) -> Iterator[tuple[Path, Path]]:
    """An ext4 image on a loop device, mounted ``errors=remount-ro`` like a root filesystem."""
    if os.geteuid() != 0:
        pytest.skip("mounting a loop device needs root")
    image, mnt = tmp / "disk.img", tmp / "ext4"
    mnt.mkdir()
    with image.open("wb") as f:
        f.truncate(size)
    if _run("mkfs.ext4", "-q", "-F", str(image)).returncode != 0:
        pytest.skip("mkfs.ext4 is not available")
    mounted = _run("mount", "-o", "loop,errors=remount-ro", str(image), str(mnt))
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a loop device here: {mounted.stderr.strip()}")
    try:
        yield image, mnt
    finally:
        if _run("umount", str(mnt)).returncode != 0:
            _run("umount", "-l", str(mnt))


def test_a_read_only_filesystem(tmp_path: Path) -> None:
    """The data filesystem turns read-only under the daemon: AR 207 and never AA, no crash,
    /healthz answers and /readyz says why; after the repair everything accepted is delivered.

    Linux refuses ``mount -o remount,ro`` (EBUSY) while any process has a file open for
    writing there, as the daemon always has: an administrator cannot do that to it. What
    does happen is the kernel's own remount after a filesystem error (``errors=remount-ro``,
    Debian's default for /): caused here for real through ext4's ``trigger_fs_error``. It
    is final until the filesystem is unmounted and checked, so recovery is a restart.
    """
    with ext4_image(tmp_path, 64 * MiB) as (image, mnt):
        port, up_port, admin = free_port(), free_port(), free_port()
        cfg = config(mnt / "data", port, up_port, floor=0, admin_port=admin)
        daemon = Daemon(tmp_path, cfg)
        accepted = [f"RO{n}" for n in range(5)]
        try:
            daemon.start().wait_started()
            with MllpClient(port) as client:
                for cid in accepted:
                    assert ack_code(client.exchange(hl7_message(cid))) == "AA"
            assert _run("mount", "-o", "remount,ro", str(mnt)).returncode != 0  # EBUSY, as said
            device = Path(_run("findmnt", "-no", "SOURCE", str(mnt)).stdout.strip()).name
            trigger = Path(f"/sys/fs/ext4/{device}/trigger_fs_error")
            if not trigger.exists():
                pytest.skip("this kernel has no ext4 trigger_fs_error to make the filesystem fail")
            trigger.write_text("hl7-agent storage fault test\n")
            # Newer kernels show it as emergency_ro next to the unchanged "rw".
            wait_for(lambda: {"ro", "emergency_ro"} & set(_run("findmnt", "-no", "OPTIONS", str(mnt))
                                                          .stdout.strip().split(",")), 10,
                     what="the kernel's read-only remount")
            with MllpClient(port) as client:
                for n in range(5):
                    ack = client.exchange(hl7_message(f"NO{n}"), timeout=15)
                    assert (ack_code(ack), err3(ack)) == ("AR", "207"), ack
            assert http_get(f"http://127.0.0.1:{admin}/healthz")[0] == 200
            status, body = http_get(f"http://127.0.0.1:{admin}/readyz")
            assert status == 503, body
            assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log_tail()
            assert not daemon.has_event("task_crashed"), daemon.log_tail()
            assert daemon.stop() in (0, 1), daemon.log_tail()
        finally:
            daemon.kill()
        # The administrator's repair: unmount, check, mount again.
        assert _run("umount", str(mnt)).returncode == 0
        assert _run("e2fsck", "-fy", str(image), timeout=60).returncode in (0, 1, 2)
        assert _run("mount", "-o", "loop,errors=remount-ro", str(image), str(mnt)).returncode == 0
        dev = DevServerThread(port=up_port).start()
        daemon = Daemon(tmp_path, cfg, name="agent-after")
        try:
            daemon.start().wait_started()
            wait_for(lambda: set(accepted) <= delivered(dev), 30, what="every accepted message delivered")
            with MllpClient(port) as client:
                assert ack_code(client.exchange(hl7_message("AFTER"))) == "AA"
            assert daemon.stop() == 0, daemon.log_tail()
        finally:
            daemon.kill()
            dev.stop()

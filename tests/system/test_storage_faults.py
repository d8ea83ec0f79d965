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

import os
import subprocess
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
    toml_config,
    wait_for,
)

from agent import mllp

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
            wait_for(lambda: free_bytes(fs) >= floor + 6 * MiB, 30, interval=0.1,
                     what="the backlog's space back on the filesystem")
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

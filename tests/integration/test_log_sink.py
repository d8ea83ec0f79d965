"""The log sink against a real pipe that nobody reads: logging never blocks, drops are counted.

A reader that stops reading (a stuck journald stream, a stalled Docker log
driver) is a pipe whose buffer is full; here it is exactly that, made small
with F_SETPIPE_SZ so it fills in a few lines. The sink's queue bound is
lowered for the same reason: the behaviour at 50 lines is the behaviour at
the default's thousands.
"""

from __future__ import annotations

import array
import fcntl
import io
import itertools
import json
import logging
import os
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from agenttest import wait_for

from agent.runtime import logs
from agent.runtime.logs import configure_logging, flush_logs, lines_dropped

CAPACITY = 50
PIPE_BYTES = 4096


class StuckPipe:
    """A pipe with a 4 KiB buffer; its read end is read only once ``drain()`` is called."""

    def __init__(self) -> None:
        self.read_fd, write_fd = os.pipe()
        fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        self.writer: io.TextIOWrapper = os.fdopen(write_fd, "w", encoding="utf-8")
        self.received = bytearray()
        self._thread: threading.Thread | None = None

    def drain(self) -> None:
        def read() -> None:
            while chunk := os.read(self.read_fd, 65536):
                self.received.extend(chunk)

        self._thread = threading.Thread(target=read, name="pipe-reader", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._thread is None:
            self.drain()
        assert flush_logs(10.0), "the sink did not drain into a pipe that is read"
        self.writer.close()
        assert self._thread is not None
        self._thread.join(10)
        os.close(self.read_fd)

    def entries(self) -> list[dict[str, Any]]:
        """The complete lines read so far (the reader thread may be mid-chunk)."""
        text = bytes(self.received).decode()
        return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


@pytest.fixture
def pipe() -> Iterator[StuckPipe]:
    """A stuck pipe as the log stream, a small queue; afterwards the defaults again."""
    sink = logs._get_sink()
    capacity = sink.capacity
    sink.capacity = CAPACITY
    stuck = StuckPipe()
    configure_logging("info", "json", stuck.writer)
    try:
        yield stuck
    finally:
        stuck.close()
        sink.capacity = capacity
        sink.target = logs._write_fd2
        structlog.reset_defaults()
        if logs._stdlib_handler is not None:
            logging.getLogger().removeHandler(logs._stdlib_handler)
            logs._stdlib_handler = None


def log_in_thread(count: int, timeout: float = 20.0) -> float:
    """Log ``count`` lines on another thread; the slowest call in seconds.

    A thread with a deadline, so a sink that blocks fails this test instead of
    hanging it.
    """
    log = structlog.get_logger("agent.test")
    slowest = [0.0]

    def produce() -> None:
        for i in range(count):
            began = time.perf_counter()
            log.info("message_committed", seq=i)
            slowest[0] = max(slowest[0], time.perf_counter() - began)

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "a log call blocked on a stderr nobody reads"
    return slowest[0]


class TestStuckReader:
    def test_log_calls_return_while_the_pipe_is_full(self, pipe: StuckPipe) -> None:
        """With the pipe full and the queue full, every further log call returns at once."""
        before = lines_dropped()
        slowest = log_in_thread(2000)
        dropped = lines_dropped() - before
        # At most the pipe's few lines, the queue and one batch in the writer's hands got through.
        assert dropped >= 2000 - CAPACITY - PIPE_BYTES // 40 - 256
        assert slowest < 0.5, f"a log call took {slowest:.3f}s"

    def test_every_line_is_written_or_counted_and_the_gap_is_reported(self, pipe: StuckPipe) -> None:
        """Once the pipe is read again: written lines + dropped count = lines logged, and one line says how many."""
        before = lines_dropped()
        log_in_thread(1000)
        dropped = lines_dropped() - before
        assert dropped > 0
        pipe.drain()
        assert flush_logs(10.0)

        def events(name: str) -> list[dict[str, Any]]:
            return [e for e in pipe.entries() if e["event"] == name]

        wait_for(lambda: sum(n["lines"] for n in events("log_lines_dropped")) >= dropped,
                 what="the log_lines_dropped line")
        committed = events("message_committed")
        notices = events("log_lines_dropped")
        assert len(committed) + dropped == 1000
        assert sum(n["lines"] for n in notices) == dropped
        assert notices[0]["level"] == "warning" and "timestamp" in notices[0]
        seqs = [e["seq"] for e in committed]
        assert seqs == sorted(seqs), "the lines that got through keep their order"
        # After the gap the stream is healthy again: new lines arrive, no new drops.
        structlog.get_logger("agent.test").info("after_gap")
        wait_for(lambda: pipe.entries()[-1]["event"] == "after_gap", what="a line after the gap")
        assert lines_dropped() - before == dropped

    def test_stdlib_lines_go_through_the_same_queue(self, pipe: StuckPipe) -> None:
        """websockets' warnings do not block on a full pipe either; they are dropped and counted too."""
        before = lines_dropped()
        log_in_thread(CAPACITY + 500)
        began = time.perf_counter()
        logging.getLogger("websockets.client").warning("connection failed")
        assert time.perf_counter() - began < 0.5
        assert lines_dropped() - before > 0

    def test_flush_gives_up_after_its_timeout(self, pipe: StuckPipe) -> None:
        """flush_logs() waits only as long as it is told while the reader is stuck (exit stays bounded)."""
        log_in_thread(500)
        began = time.monotonic()
        assert flush_logs(0.3) is False
        assert time.monotonic() - began < 3.0
        assert logs._get_sink().stuck(), "the exit flush would wait a second time for nothing"
        pipe.drain()
        assert flush_logs(10.0) is True
        assert not logs._get_sink().stuck()


def pipe_bytes(read_fd: int) -> int:
    """How many bytes the pipe holds now (FIONREAD, taken under the pipe's lock)."""
    count = array.array("i", [0])
    fcntl.ioctl(read_fd, termios.FIONREAD, count, True)
    return count[0]


class TestWholeLines:
    def test_the_pipe_never_holds_half_a_line(self, tmp_path: Path) -> None:
        """Whenever the writer stops (blocked on a stuck reader, then the process ends), the pipe holds whole lines.

        A child process writes a 40 KB batch of lines of varying length through
        the writer's fd-2 path, its stderr a real 4 KiB pipe. Nobody reads until
        the child is blocked; then a reader reads in odd chunk sizes, and each
        time it looks, the bytes written so far (read + still in the pipe) must
        end at a line end: that is what the stream would hold if the process
        ended right then. At the end the bytes read are exactly the lines.
        """
        text = "".join(json.dumps({"event": "message_committed", "seq": i, "pad": "x" * (i % 97)}) + "\n"
                       for i in range(400))
        data = text.encode()
        # The test is only sharp if a write cut by the pipe's size would end inside a line.
        assert data[PIPE_BYTES - 1:PIPE_BYTES] != b"\n"
        batch = tmp_path / "batch"
        batch.write_bytes(data)
        read_fd, write_fd = os.pipe()
        fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", "import sys, agent.runtime.logs as L; L._write_fd2(open(sys.argv[1]).read())",
                 str(batch)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=write_fd)
        finally:
            os.close(write_fd)
        received = bytearray()
        try:
            wait_for(lambda: pipe_bytes(read_fd) > 0, timeout=30, what="the child's first write")
            sizes = itertools.cycle((1, 7, 100, 333, 4093, 13))
            while len(received) < len(data):
                written = len(received) + pipe_bytes(read_fd)
                assert data[written - 1:written] == b"\n", (
                    f"the stream would end in half a line: ...{data[written - 40:written]!r}")
                chunk = os.read(read_fd, next(sizes))
                assert chunk, "the pipe closed before every line arrived"
                received.extend(chunk)
            assert proc.wait(10) == 0
            assert os.read(read_fd, 1) == b"", "nothing after the lines"
            assert bytes(received) == data, "partial writes were continued exactly: nothing lost, nothing twice"
        finally:
            os.close(read_fd)
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)

    def test_an_exit_with_a_stuck_reader_leaves_no_half_line(self) -> None:
        """A process that logs a burst and exits while nobody reads: the reader later finds whole lines only.

        The exit flush gives up (lowered to 0.3 s) with the writer blocked on a
        full 4 KiB pipe; whatever the pipe holds then is all the reader will
        ever get of that process.
        """
        child = ("import agent.runtime.logs as L, structlog; L.EXIT_FLUSH_SECONDS = 0.3; "
                 "L.configure_logging('info', 'json'); log = structlog.get_logger('agent.test')\n"
                 "for i in range(2000): log.info('message_committed', seq=i, pad='x' * (i % 97))")
        read_fd, write_fd = os.pipe()
        fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        try:
            proc = subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=write_fd)
        finally:
            os.close(write_fd)
        try:
            assert proc.wait(30) == 0
            received = bytearray()
            while chunk := os.read(read_fd, 997):
                received.extend(chunk)
        finally:
            os.close(read_fd)
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        assert received.endswith(b"\n"), f"the stream ends in half a line: ...{bytes(received[-60:])!r}"
        seqs = [json.loads(line)["seq"] for line in received.decode().splitlines()]
        assert seqs and seqs == sorted(seqs)

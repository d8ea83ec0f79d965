"""The log sink against a real pipe that nobody reads: logging never blocks, drops are counted.

A reader that stops reading (a stuck journald stream, a stalled Docker log
driver) is a pipe whose buffer is full; here it is exactly that, made small
with F_SETPIPE_SZ so it fills in a few lines. The sink's queue bound is
lowered for the same reason: the behaviour at 50 lines is the behaviour at
the default's thousands.
"""

from __future__ import annotations

import fcntl
import io
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
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

"""Logging setup: JSON lines on stderr, stdlib routed in, context bound, bodies never logged, journald priorities."""

from __future__ import annotations

import io
import itertools
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from agent.runtime import logs
from agent.runtime.logs import bind, configure_logging, stderr_is_journal


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """Undo configure_logging: structlog defaults, the root handler and level."""
    root = logging.getLogger()
    level = root.level
    yield
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
    if logs._stdlib_handler is not None:
        root.removeHandler(logs._stdlib_handler)
        logs._stdlib_handler = None
    root.setLevel(level)


def written(stream: io.StringIO) -> str:
    """What reached the stream once the sink's writer thread has caught up."""
    assert logs.flush_logs(5.0), "log sink did not drain"
    return stream.getvalue()


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in written(stream).splitlines()]


class TestJson:
    def test_one_json_object_per_line(self) -> None:
        """Each event is one JSON line with event, level and an ISO UTC timestamp."""
        out = io.StringIO()
        configure_logging("info", "json", out)
        log = structlog.get_logger("agent.test")
        log.info("message_committed", row_id=7)
        log.warning("frame_too_large", size=9)
        first, second = lines(out)
        assert first["event"] == "message_committed"
        assert first["level"] == "info"
        assert first["row_id"] == 7
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z", first["timestamp"])
        assert second["level"] == "warning"

    def test_level_filters(self) -> None:
        """Events below the configured level are dropped."""
        out = io.StringIO()
        configure_logging("warning", "json", out)
        log = structlog.get_logger()
        log.info("not_shown")
        log.debug("not_shown_either")
        log.error("shown")
        assert [e["event"] for e in lines(out)] == ["shown"]

    def test_debug_level(self) -> None:
        """At debug, debug events are written."""
        out = io.StringIO()
        configure_logging("DEBUG", "json", out)
        structlog.get_logger().debug("lease_heartbeat")
        assert lines(out)[0]["level"] == "debug"

    def test_exceptions_are_formatted(self) -> None:
        """log.exception() carries the formatted traceback in the JSON line."""
        out = io.StringIO()
        configure_logging("info", "json", out)
        try:
            raise ZeroDivisionError("boom")
        except ZeroDivisionError:
            structlog.get_logger().exception("writer_failed")
        (entry,) = lines(out)
        assert entry["level"] == "error"
        assert "ZeroDivisionError: boom" in entry["exception"]

    def test_default_stream_is_stderr(self, capfd: pytest.CaptureFixture[str]) -> None:
        """Without a stream, logs go to fd 2, never stdout (stdout is for command output)."""
        configure_logging()
        structlog.get_logger().info("agent_started")
        assert logs.flush_logs(5.0)
        captured = capfd.readouterr()
        assert captured.out == ""
        assert json.loads(captured.err)["event"] == "agent_started"


class TestContext:
    def test_bind_adds_ids_inside_the_block_only(self) -> None:
        """bind() adds ids to every line inside the with-block and removes them after."""
        out = io.StringIO()
        configure_logging("info", "json", out)
        log = structlog.get_logger()
        with bind(channel="adt", peer="10.1.2.3:5000"):
            log.info("connection_opened")
            with bind(control_id="MSG1"):
                log.info("message_committed")
        log.info("connection_closed")
        opened, committed, closed = lines(out)
        assert (opened["channel"], opened["peer"]) == ("adt", "10.1.2.3:5000")
        assert committed["control_id"] == "MSG1"
        assert committed["channel"] == "adt"
        assert "channel" not in closed

    def test_capture_logs_sees_bound_context(self) -> None:
        """Tests can assert on events with structlog.testing.capture_logs."""
        configure_logging("info", "json", io.StringIO())
        with (
            capture_logs(processors=[structlog.contextvars.merge_contextvars]) as captured,
            bind(channel="lab"),
        ):
            structlog.get_logger().info("message_committed", row_id=1)
        assert captured == [
            {"event": "message_committed", "row_id": 1, "channel": "lab", "log_level": "info"}
        ]


class TestBodiesNeverLogged:
    @pytest.mark.parametrize("key", ["body", "raw", "payload"])
    def test_body_keys_are_redacted(self, key: str) -> None:
        """A body/raw/payload value never reaches the output, whatever a caller passes."""
        out = io.StringIO()
        configure_logging("info", "json", out)
        structlog.get_logger().info("oops", **{key: "PID|1||12345^^^HOSP||DOE^JOHN"})
        text = written(out)
        assert "DOE^JOHN" not in text
        assert lines(out)[0][key] == "<redacted>"


class TestStdlib:
    def test_stdlib_warnings_are_routed(self) -> None:
        """stdlib warnings (websockets) come out as JSON lines in the same stream."""
        out = io.StringIO()
        configure_logging("info", "json", out)
        logging.getLogger("websockets.client").warning("connection %s failed", "x")
        (entry,) = lines(out)
        assert entry["event"] == "connection x failed"
        assert entry["logger"] == "websockets.client"
        assert entry["level"] == "warning"
        assert "timestamp" in entry

    def test_stdlib_below_warning_is_dropped(self) -> None:
        """stdlib info/debug stay out, even at debug (websockets debug logs frame contents)."""
        out = io.StringIO()
        configure_logging("debug", "json", out)
        logging.getLogger("websockets.client").info("frame body")
        logging.getLogger("websockets.client").debug("frame body")
        assert written(out) == ""

    def test_stdlib_exceptions_are_formatted(self) -> None:
        """A stdlib logger.exception() carries its traceback."""
        out = io.StringIO()
        configure_logging("info", "json", out)
        try:
            raise ValueError("bad")
        except ValueError:
            logging.getLogger("asyncio").exception("task failed")
        assert "ValueError: bad" in lines(out)[0]["exception"]

    def test_reconfigure_replaces_the_handler(self) -> None:
        """Configuring twice leaves one handler, writing to the newest stream."""
        first, second = io.StringIO(), io.StringIO()
        configure_logging("info", "json", first)
        configure_logging("info", "json", second)
        logging.getLogger("x").error("once")
        assert written(first) == ""
        assert len(lines(second)) == 1


class TestConsole:
    def test_console_format_is_readable(self) -> None:
        """The console format writes human-readable lines, exceptions included."""
        out = io.StringIO()
        configure_logging("info", "console", out)
        try:
            raise KeyError("k")
        except KeyError:
            structlog.get_logger().exception("writer_failed", channel="adt")
        text = written(out)
        assert "writer_failed" in text
        assert "channel=adt" in text
        assert "KeyError" in text
        with pytest.raises(json.JSONDecodeError):
            json.loads(text.splitlines()[0])


class TestArguments:
    def test_unknown_level(self) -> None:
        """An unknown level is refused."""
        with pytest.raises(ValueError, match="unknown log level"):
            configure_logging("verbose")

    def test_unknown_format(self) -> None:
        """An unknown format is refused."""
        with pytest.raises(ValueError, match="unknown log format"):
            configure_logging("info", "xml")


def journal_stream_of(fd: int) -> str:
    """The JOURNAL_STREAM value systemd would set for ``fd``: device:inode in decimal."""
    st = os.fstat(fd)
    return f"{st.st_dev}:{st.st_ino}"


class TestJournalDetection:
    def test_matching_stream_is_the_journal(self, tmp_path: Path) -> None:
        """JOURNAL_STREAM naming the fd's own device and inode means the fd is the journal."""
        with (tmp_path / "stream").open("w") as f:
            assert stderr_is_journal({"JOURNAL_STREAM": journal_stream_of(f.fileno())}, f.fileno())

    def test_other_stream_is_not(self, tmp_path: Path) -> None:
        """An inherited JOURNAL_STREAM naming another file (stderr redirected) is not the journal."""
        with (tmp_path / "a").open("w") as a, (tmp_path / "b").open("w") as b:
            assert not stderr_is_journal({"JOURNAL_STREAM": journal_stream_of(a.fileno())}, b.fileno())

    @pytest.mark.parametrize("value", ["", "12", "12:", ":34", "a:b", "1:2:3", " 1:2", "-1:2"])
    def test_missing_or_malformed_value(self, tmp_path: Path, value: str) -> None:
        """No variable, or one that is not two decimal numbers, means no journal."""
        with (tmp_path / "stream").open("w") as f:
            assert not stderr_is_journal({"JOURNAL_STREAM": value}, f.fileno())
            assert not stderr_is_journal({}, f.fileno())

    def test_closed_fd(self, tmp_path: Path) -> None:
        """A closed stderr is not the journal (and the check does not raise)."""
        with (tmp_path / "stream").open("w") as f:
            fd = f.fileno()
            value = journal_stream_of(fd)
        assert not stderr_is_journal({"JOURNAL_STREAM": value}, fd)

    def test_default_output_gets_the_prefix_when_fd2_is_the_journal(
        self, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """configure_logging() with no stream detects the journal on fd 2 and prefixes its lines."""
        monkeypatch.setenv("JOURNAL_STREAM", journal_stream_of(2))
        configure_logging()
        structlog.get_logger().error("writer_failed")
        assert logs.flush_logs(5.0)
        line = capfd.readouterr().err.strip()
        assert line.startswith("<3>{")
        assert json.loads(line[3:])["event"] == "writer_failed"

    def test_default_output_has_no_prefix_when_fd2_is_not_the_journal(
        self, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """JOURNAL_STREAM naming another stream (here fd 1) leaves stderr's lines plain JSON."""
        monkeypatch.setenv("JOURNAL_STREAM", journal_stream_of(1))
        configure_logging()
        structlog.get_logger().error("writer_failed")
        assert logs.flush_logs(5.0)
        assert json.loads(capfd.readouterr().err)["event"] == "writer_failed"

    def test_an_explicit_stream_is_never_prefixed_by_detection(
        self, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Detection is about fd 2: a caller's own stream gets no prefix even under systemd."""
        monkeypatch.setenv("JOURNAL_STREAM", journal_stream_of(2))
        out = io.StringIO()
        configure_logging("info", "json", out)
        structlog.get_logger().error("writer_failed")
        assert lines(out)[0]["event"] == "writer_failed"


class TestJournalRendering:
    @pytest.mark.parametrize(
        ("method", "prefix"),
        [("debug", "<7>"), ("info", "<6>"), ("warning", "<4>"), ("error", "<3>"),
         ("critical", "<2>"), ("exception", "<3>")],
    )
    def test_prefix_is_the_syslog_priority(self, method: str, prefix: str) -> None:
        """Each level gets its RFC 5424 severity as <N>, and the rest of the line is the same JSON."""
        out = io.StringIO()
        configure_logging("debug", "json", out, journald=True)
        getattr(structlog.get_logger(), method)("some_event", channel="adt")
        line = written(out).strip()
        assert line.startswith(prefix + "{")
        entry = json.loads(line.removeprefix(prefix))
        assert (entry["event"], entry["channel"]) == ("some_event", "adt")

    def test_stdlib_lines_get_their_priority(self) -> None:
        """websockets' warnings and errors, routed through the same sink, carry <4> and <3>."""
        out = io.StringIO()
        configure_logging("info", "json", out, journald=True)
        logging.getLogger("websockets.client").warning("w")
        logging.getLogger("websockets.client").error("e")
        first, second = written(out).splitlines()
        assert first.startswith("<4>{") and json.loads(first[3:])["event"] == "w"
        assert second.startswith("<3>{") and json.loads(second[3:])["event"] == "e"

    def test_exception_stays_one_prefixed_json_line(self) -> None:
        """A traceback inside JSON is escaped: one line, one prefix, valid JSON."""
        out = io.StringIO()
        configure_logging("info", "json", out, journald=True)
        try:
            raise ZeroDivisionError("boom")
        except ZeroDivisionError:
            structlog.get_logger().exception("writer_failed")
        (line,) = written(out).splitlines()
        assert "ZeroDivisionError: boom" in json.loads(line.removeprefix("<3>"))["exception"]

    def test_console_traceback_lines_each_carry_the_prefix(self) -> None:
        """journald reads a prefix per line: every line of a console traceback is an error."""
        out = io.StringIO()
        configure_logging("info", "console", out, journald=True)
        try:
            raise KeyError("k")
        except KeyError:
            structlog.get_logger().exception("writer_failed")
        text_lines = written(out).splitlines()
        assert len(text_lines) > 3
        assert all(line.startswith("<3>") for line in text_lines)
        assert "writer_failed" in text_lines[0]

    def test_no_prefix_when_off(self) -> None:
        """journald=False: the line is plain JSON from its first byte."""
        out = io.StringIO()
        configure_logging("info", "json", out, journald=False)
        structlog.get_logger().error("writer_failed")
        assert written(out).startswith("{")


class TestLinePieces:
    """How a batch is cut into write(2)s: whole lines, each small enough for a pipe to take atomically."""

    def test_pieces_end_at_line_ends_and_fit_the_atomic_size(self) -> None:
        data = b"".join(b"x" * (n % 53) + b"\n" for n in range(500))
        pieces = [bytes(p) for p in logs._line_pieces(data, 128)]
        assert b"".join(pieces) == data
        assert all(p.endswith(b"\n") and len(p) <= 128 for p in pieces)
        # Lines are packed: each piece would overflow with the next line added.
        assert all(len(a) + b.index(b"\n") + 1 > 128 for a, b in itertools.pairwise(pieces))

    def test_a_line_longer_than_the_limit_is_one_piece_of_its_own(self) -> None:
        long = b"y" * 300 + b"\n"
        data = b"a\n" + long + b"b\n"
        assert [bytes(p) for p in logs._line_pieces(data, 128)] == [b"a\n", long, b"b\n"]

    def test_default_limit_is_pipe_buf(self) -> None:
        """POSIX makes a pipe write of at most PIPE_BUF bytes atomic, and no larger one."""
        read_fd, write_fd = os.pipe()
        try:
            pipe_buf = os.fpathconf(write_fd, "PC_PIPE_BUF")
        finally:
            os.close(read_fd)
            os.close(write_fd)
        assert pipe_buf == logs._ATOMIC_BYTES
        pieces = list(logs._line_pieces((b"z" * 99 + b"\n") * 1000))
        assert all(len(p) <= pipe_buf for p in pieces)
        assert len(pieces[0]) == pipe_buf // 100 * 100

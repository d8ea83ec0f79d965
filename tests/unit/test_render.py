"""How operator commands lay out what they print: fitted tables, '-' for unset, raw bodies on a terminal."""

from __future__ import annotations

from typing import Any

from agent.app.commands import render
from agent.app.commands.render import (
    DEFAULT_WIDTH,
    cell,
    error_cell,
    fit_list,
    output_width,
    raw_for_terminal,
)
from agent.storage.rows import LeaseRow


def item(message_id: str, **over: Any) -> dict[str, Any]:  # noqa: ANN401 - test data
    base: dict[str, Any] = {
        "id": message_id, "channel": "adt", "seq": 12, "state": "rejected", "control_id": "MSG00012",
        "message_type": "ADT^A01^ADT_A01", "attempts": 3, "received_at": "2026-05-01T06:12:44.031Z",
        "error_code": "422", "server_reason": "unknown patient identifier in PID-3",
    }
    base.update(over)
    return base


ID1 = "ccf67946-254e-4048-8a13-daff777ddcf6"
ID2 = "0b1d9a77-1c2e-4f6a-9d3e-5b7c8d9e0f10"


class TestFitList:
    def test_everything_whole_when_it_fits(self) -> None:
        """A wide enough table is the natural one: whole ids, milliseconds, the whole reason."""
        lines = fit_list([item(ID1), item(ID2)], 200)
        assert lines[1].startswith(ID1) and lines[1].endswith("422: unknown patient identifier in PID-3")
        assert "06:12:44.031Z" in lines[1]

    def test_ids_then_times_then_text(self) -> None:
        """Narrower: 8-character ids first, then times without milliseconds, then the error text is cut."""
        for width in (150, 130, 110, 100, 96):
            lines = fit_list([item(ID1), item(ID2)], width)
            assert max(map(len, lines)) <= width, width
            assert lines[1].split()[0] == ID1[:8]
        assert "06:12:44.031Z" in fit_list([item(ID1)], 150)[1]
        assert "06:12:44Z" in fit_list([item(ID1)], 100)[1]
        assert fit_list([item(ID1)], 100)[1].endswith("…")

    def test_prefixes_stay_unique(self) -> None:
        """Two ids sharing their first 8 characters are shown long enough to tell them apart."""
        twin = ID1[:10] + "ffff" + ID1[14:]
        lines = fit_list([item(ID1), item(twin)], DEFAULT_WIDTH)
        shown = [ln.split()[0] for ln in lines[1:]]
        assert len(set(shown)) == 2 and shown[0] == ID1[: len(shown[0])] and len(shown[0]) == 11

    def test_never_below_the_whole_columns(self) -> None:
        """Ids, seq, state, attempts and times are never cut: a tiny terminal gets long lines instead."""
        (_header, line) = fit_list([item(ID1)], 20)
        assert line.split()[0] == ID1[:8] and "rejected" in line and "2026-05-01T06:12:44Z" in line


class TestCells:
    def test_unset_is_one_dash(self) -> None:
        """None and '' are both '-'; zero is a value."""
        assert [cell(None), cell(""), cell(0), cell("x")] == ["-", "-", "0", "x"]

    def test_no_control_characters(self) -> None:
        """A value never breaks the table's line or moves the cursor."""
        assert cell("a\rb\x1b[2Jc") == "a b [2Jc"

    def test_error_cell(self) -> None:
        """The code, then the server's words when there are some."""
        assert error_cell("422", "no such patient") == "422: no such patient"
        assert error_cell("503", None) == "503" and error_cell(None, None) is None


class TestRawForTerminal:
    def test_a_segment_a_line(self) -> None:
        """CR, CRLF and LF segment ends all become one line each."""
        assert raw_for_terminal(b"MSH|a\rPID|1\r\nPV1|2\nOBX|3\r", "utf-8") == "MSH|a\nPID|1\nPV1|2\nOBX|3\n"

    def test_controls_escaped_text_decoded(self) -> None:
        """Escape sequences and other controls are shown, not obeyed; the row's character set decodes."""
        text = raw_for_terminal("PID|1||M\u00fcller\x1b[31m\x07\tx\u0085\r".encode("latin-1"), "latin-1")
        assert text == "PID|1||M\u00fcller\\x1b[31m\\x07\tx\\x85\n"


def test_output_width(monkeypatch: Any) -> None:  # noqa: ANN401 - pytest's monkeypatch
    """$COLUMNS wins; not a terminal and no $COLUMNS: 100."""
    monkeypatch.setenv("COLUMNS", "123")
    assert output_width() == 123
    monkeypatch.delenv("COLUMNS")
    assert output_width() == DEFAULT_WIDTH  # pytest's stdout is no terminal


STATS: dict[str, Any] = {"db": {"path": "/q/queue.db", "size_bytes": 4096, "wal_bytes": 0, "agent_id": "a",
                                "schema_version": 4},
                         "lease": None, "states": {}, "channels": {}}


class TestStatsLease:
    def _lease_line(self, expires_at: float, now: float) -> str:
        row = LeaseRow("a@host:42:boot", 42, "boot", "ns", 1, 7, expires_at)
        (line,) = [x for x in render.render_stats(STATS, row, now).splitlines() if x.startswith("lease")]
        return line

    def test_a_lease_past_its_expiry_says_when_it_expired(self) -> None:
        line = self._lease_line(1_000.0, now=2_000.0)
        assert "none held (last holder a@host:42:boot, epoch 7, expired 1970-01-01T00:16:40" in line

    def test_a_dead_holder_s_unexpired_lease_never_reads_expired_in_the_future(self) -> None:
        """After kill -9 the holder holds nothing though its expiry is ahead: say why, not a future 'expired'."""
        line = self._lease_line(2_020.0, now=2_000.0)
        assert line.endswith("epoch 7, its process has exited)") and "expired" not in line

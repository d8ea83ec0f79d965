"""The status page renderer: escaping, empty and degraded states, no bodies."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from typing import Any

import pytest

from agent.core.status import assess
from agent.core.timefmt import human_bytes, human_duration
from agent.runtime.plots import Line, line_plot, nice_ceiling
from agent.runtime.statuspage import render_status_page


def _stats(**channels: dict[str, Any]) -> dict[str, Any]:
    return {
        "states": {
            "queued": 0,
            "claimed": 0,
            "inflight": 0,
            "processed": 0,
            "rejected": 0,
            "failed": 0,
            "nacked": 0,
        },
        "channels": channels,
        "lease": {"holder": "edge-01:4242", "epoch": 3, "expires_at": "2025-01-01T00:00:30Z"},
        "db": {"path": "/var/lib/hl7-agent/queue.db", "size_bytes": 4096, "wal_bytes": 0},
    }


def _channel(**overrides: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "queued": 0,
        "claimed": 0,
        "inflight": 0,
        "oldest_queued_age_s": None,
        "paused": False,
    }
    row.update(overrides)
    return row


def _view(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "agent_id": "edge-01",
        "version": "0.1.0",
        "uptime_s": 192.0,
        "generated_at": "2025-01-01T00:00:00+00:00",
        "listeners_up": True,
        "upstream": {
            "configured": True,
            "connected": True,
            "url": "ws://127.0.0.1:8080/agent",
            "replay": True,
            "last_error": None,
        },
        "lease_held": True,
        "stats": _stats(adt=_channel()),
        "recent_failures": [],
        "errors": {},
    }
    data.update(overrides)
    return data


class _Collector(HTMLParser):
    """Collects tags and text, to check the page is well-formed enough to parse."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _parse(page: str) -> _Collector:
    parser = _Collector()
    parser.feed(page)
    parser.close()
    return parser


class TestEscaping:
    def test_control_id_with_markup_is_escaped(self) -> None:
        """A control id `<script>` renders as text, never as a tag."""
        failure = {
            "id": "0b7c",
            "channel": "adt",
            "control_id": "<script>alert(1)</script>",
            "message_type": "ADT^A01",
            "state": "failed",
            "error_code": "207",
            "error_text": 'bad "quote" & <b>',
            "attempts": 3,
            "updated_at": "2025-01-01T00:00:00Z",
        }
        page = render_status_page(_view(recent_failures=[failure]))
        assert "<script>" not in page
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
        assert "&quot;quote&quot; &amp; &lt;b&gt;" in page
        assert "script" not in _parse(page).tags

    def test_agent_id_and_channel_names_are_escaped(self) -> None:
        """Identity and channel names are escaped too, in the title and the table."""
        page = render_status_page(
            _view(agent_id='a"<x>', stats=_stats(**{"<ch>": _channel(queued=1)}))
        )
        assert "<x>" not in page and "<ch>" not in page
        assert "a&quot;&lt;x&gt;" in page and "&lt;ch&gt;" in page

    def test_upstream_error_is_escaped(self) -> None:
        """A server's last error text is shown escaped."""
        upstream = {
            "configured": True,
            "connected": False,
            "url": "ws://h/<a>",
            "replay": None,
            "last_error": "<img src=x>",
        }
        page = render_status_page(_view(upstream=upstream))
        assert "<img" not in page and "&lt;img src=x&gt;" in page
        assert '<div class="big">down</div>' in page  # holding the lease without a session


class TestContent:
    def test_identity_uptime_and_refresh(self) -> None:
        """Agent id, version, human uptime and the meta refresh are on the page."""
        page = render_status_page(_view(), refresh_seconds=7)
        assert "edge-01" in page and "0.1.0" in page
        assert "up 3m 12s" in page
        assert '<meta http-equiv="refresh" content="7">' in page
        assert "<script" not in page.lower()

    def test_refresh_can_be_disabled(self) -> None:
        """refresh_seconds=0 renders a page that does not reload itself."""
        assert 'http-equiv="refresh"' not in render_status_page(_view(), refresh_seconds=0)

    def test_empty_queue(self) -> None:
        """An empty queue renders zero counts and no failures."""
        page = render_status_page(_view())
        assert "0 pending" in page
        assert "<code>adt</code>" in page
        assert "Recent failures" in page and "None." in page

    def test_no_channels(self) -> None:
        """A database with no channel rows says so instead of an empty table."""
        page = render_status_page(_view(stats=_stats()))
        assert "No channels." in page

    def test_paused_channel_and_age(self) -> None:
        """A paused channel with rows is blocked by the pause; its oldest queued age in human form."""
        stats = _stats(
            adt=_channel(queued=4, oldest_queued_age_s=192.4, paused=True),
            lab=_channel(inflight=1),
        )
        page = render_status_page(_view(stats=stats))
        assert "blocked: channel paused — 4 waiting" in page
        assert "3m 12s" in page
        assert "flowing — 1 waiting" in page  # lab is not paused
        assert "dispatching" not in page  # the old badge said so whatever happened
        assert page.index("<code>adt</code>") < page.index("<code>lab</code>")

    def test_no_lease(self) -> None:
        """With lease null the page says no process holds it."""
        stats = _stats(adt=_channel())
        stats["lease"] = None
        page = render_status_page(_view(stats=stats, lease_held=False))
        assert "no holder" in page
        assert "nothing dispatches" in page

    def test_lease_holder_and_epoch(self) -> None:
        """The lease holder and its epoch are shown."""
        page = render_status_page(_view())
        assert "edge-01:4242" in page and "epoch 3" in page

    def test_failures_table_has_fields_but_no_body(self) -> None:
        """A failure row shows its fields; a stray body key is never rendered."""
        failure = {
            "id": "3f2a9c1e",
            "channel": "adt",
            "control_id": "MSG0001",
            "message_type": "ADT^A01",
            "state": "rejected",
            "error_code": "400",
            "error_text": "unknown patient",
            "attempts": 1,
            "updated_at": 1735689600.0,
            "body": "MSH|^~\\&|SECRET-PATIENT",
        }
        page = render_status_page(_view(recent_failures=[failure]))
        for text in ("3f2a9c1e", "MSG0001", "ADT^A01", "rejected", "<b>400</b> unknown patient"):
            assert text in page
        assert "2025-01-01 00:00:00Z" in page
        assert "SECRET-PATIENT" not in page

    def test_upstream_not_configured(self) -> None:
        """Intake-only mode (no server url) is shown as not configured, not as an error."""
        upstream = {
            "configured": False,
            "connected": False,
            "url": None,
            "replay": None,
            "last_error": None,
        }
        page = render_status_page(_view(upstream=upstream))
        assert "not configured" in page


class TestDegraded:
    def test_stats_unavailable(self) -> None:
        """When stats failed, the page still renders and names the reason."""
        page = render_status_page(
            _view(stats=None, errors={"stats": "OperationalError: unable to open <db>"})
        )
        assert "unavailable: OperationalError: unable to open &lt;db&gt;" in page
        _parse(page)

    def test_everything_missing(self) -> None:
        """An empty view dict still yields a whole page."""
        page = render_status_page({})
        assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")


class TestHumanFormats:
    def test_durations(self) -> None:
        """Durations show the two largest units."""
        assert human_duration(None) == "—"
        assert human_duration(0.4) == "0s"
        assert human_duration(45) == "45s"
        assert human_duration(192) == "3m 12s"
        assert human_duration(3 * 3600 + 5 * 60 + 9) == "3h 5m"
        assert human_duration(2 * 86400 + 3600) == "2d 1h"

    def test_bytes(self) -> None:
        """Sizes use binary units."""
        assert human_bytes(None) == "—"
        assert human_bytes(512) == "512 B"
        assert human_bytes(4096) == "4.0 KiB"
        assert human_bytes(5 * 1024**3) == "5.0 GiB"


# -- each state as the page renders it ---------------------------------------------

NOW = 1_767_225_600.0  # 2026-01-01T00:00:00Z
HEAD_ID = "0b7c5d1e-5f1a-4c1e-9a55-6f1e2d3c4b5a"


class _Dom(HTMLParser):
    """Every element's attributes and the text inside each element with an id."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[dict[str, str]] = []
        self.stack: list[str] = []
        self.text_by_id: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = {k: v or "" for k, v in attrs}
        found["<tag>"] = tag
        self.elements.append(found)
        if tag not in ("meta", "br", "rect", "line", "polyline", "polygon", "circle"):
            self.stack.append(found.get("id", ""))

    def handle_endtag(self, tag: str) -> None:
        if self.stack and tag not in ("meta", "br", "rect", "line", "polyline", "polygon", "circle"):
            self.stack.pop()

    def handle_data(self, data: str) -> None:
        for ident in self.stack:
            if ident:
                self.text_by_id[ident] = (self.text_by_id.get(ident, "") + " " + data).strip()

    def find(self, **attrs: str) -> list[dict[str, str]]:
        return [e for e in self.elements if all(e.get(k.replace("_", "-")) == v for k, v in attrs.items())]


def _dom(page: str) -> _Dom:
    dom = _Dom()
    dom.feed(page)
    dom.close()
    return dom


def _state_view(counts: dict[str, Any], head: dict[str, Any] | None = None, *, connected: bool = True,
                paused_at: float | None = None, reason: str | None = None,
                failures: list[dict[str, Any]] | None = None,
                history: dict[str, Any] | None = None) -> dict[str, Any]:
    stats = _stats(adt=_channel(**counts))
    activity = [{"channel": "adt", "head": head, "last_received_at": NOW - 3,
                 "last_settled": {"state": "processed", "settled_at": NOW - 75},
                 "paused": paused_at is not None, "paused_at": paused_at, "paused_reason": reason}]
    upstream = {"configured": True, "connected": connected, "url": "ws://127.0.0.1:8080/agent",
                "replay": True, "last_error": None if connected else "ConnectionRefusedError: refused",
                "since": NOW - 185}
    view = _view(stats=stats, upstream=upstream, generated_at=NOW, recent_failures=failures or [],
                 activity=activity, history=history)
    view["assessment"] = assess(stats=stats, activity=activity, upstream=upstream, lease_held=True,
                                listeners_up=True, now=NOW)
    return view


def _head(**overrides: Any) -> dict[str, Any]:
    head = {"id": HEAD_ID, "seq": 9, "state": "queued", "attempts": 0, "redrive_base": 0, "next_attempt_at": 0,
            "server_status": None, "error_code": None, "error_text": None, "received_at": NOW - 71,
            "updated_at": NOW - 1}
    head.update(overrides)
    return head


def _row(dom: _Dom) -> dict[str, str]:
    (row,) = dom.find(id="ch-adt")
    return row


class TestEachStateRenders:
    """What an operator sees in each state: the word, its class (colour), the numbers."""

    def test_idle(self) -> None:
        dom = _dom(render_status_page(_state_view({})))
        row = _row(dom)
        assert (row["data-state"], row["class"]) == ("idle", "ch lvl-ok")
        assert dom.find(**{"class": "state st-idle"})
        assert dom.text_by_id["summary"] == "all 1 channel flowing or idle"
        assert dom.find(id="summary")[0]["class"] == "banner lvl-ok"

    def test_flowing(self) -> None:
        page = render_status_page(_state_view({"queued": 3, "inflight": 1, "oldest_queued_age_s": 2.0},
                                               _head(state="inflight", attempts=1)))
        dom = _dom(page)
        assert (_row(dom)["data-state"], _row(dom)["data-level"]) == ("flowing", "ok")
        assert dom.find(**{"class": "state st-flowing"})
        assert dom.text_by_id["ch-adt"].split()[:3] == ["adt", "flowing", "4"]
        assert "3s ago" in dom.text_by_id["ch-adt"] and "1m 15s ago" in dom.text_by_id["ch-adt"]

    def test_retrying(self) -> None:
        head = _head(attempts=7, next_attempt_at=NOW + 4.2, error_code="503",
                     error_text="transient status 503; retry in 1.0s")
        page = render_status_page(_state_view({"queued": 14, "oldest_queued_age_s": 71.0}, head))
        dom = _dom(page)
        assert (_row(dom)["data-state"], _row(dom)["class"]) == ("retrying", "ch lvl-warn")
        assert dom.find(**{"class": "state st-retrying"})
        assert "retrying — attempt 7 failed, next try in 4s" in page
        assert "last error: transient status 503</li>" in page
        assert "13 waiting behind it" in page
        assert f"<code>hl7-agent queue fail {HEAD_ID}</code>" in page
        assert dom.text_by_id["summary"] == "adt retrying"
        assert dom.find(id="summary")[0]["class"] == "banner lvl-warn"
        assert dom.find(id="upstream")[0]["class"] == "card lvl-ok"  # the upstream itself is fine

    def test_paused(self) -> None:
        page = render_status_page(_state_view({"paused": True}, paused_at=NOW - 192, reason="operator (alice)"))
        dom = _dom(page)
        assert (_row(dom)["data-state"], _row(dom)["class"]) == ("paused", "ch lvl-warn")
        assert "paused by operator (alice) for 3m 12s; <code>hl7-agent channel resume adt</code> resumes it" in page

    def test_blocked_by_a_pause(self) -> None:
        page = render_status_page(_state_view({"queued": 2, "oldest_queued_age_s": 30.0, "paused": True}, _head(),
                                              paused_at=NOW - 5, reason="rejected row 3f2a (status 422)"))
        dom = _dom(page)
        assert (_row(dom)["data-state"], _row(dom)["class"]) == ("blocked", "ch lvl-bad")
        assert dom.find(**{"class": "state st-blocked"})
        assert "blocked: channel paused — 2 waiting" in page and "rejected row 3f2a (status 422)" in page
        assert dom.find(id="summary")[0]["class"] == "banner lvl-bad"

    def test_upstream_down(self) -> None:
        page = render_status_page(_state_view({"queued": 5, "oldest_queued_age_s": 9.0}, _head(), connected=False))
        dom = _dom(page)
        assert (_row(dom)["data-state"], _row(dom)["class"]) == ("upstream down", "ch lvl-bad")
        assert dom.find(**{"class": "state st-upstream-down"})
        assert dom.find(id="upstream")[0]["class"] == "card lvl-bad"
        card = dom.text_by_id["upstream"]
        assert "down for 3m 5s" in card and "since 2025-12-31T23:56:55Z" in card
        assert "last error: ConnectionRefusedError: refused" in card
        assert dom.text_by_id["summary"].startswith("upstream down for 3m 5s — 5 waiting")

    def test_failure_shows_the_servers_reason(self) -> None:
        failure = {"id": "3f2a9c1e-1111-2222-3333-444455556666", "channel": "adt", "control_id": "MSG0001",
                   "message_type": "ADT^A01", "state": "rejected", "error_code": "422",
                   "error_text": "rejected by server (status 422)", "attempts": 1, "updated_at": NOW - 60,
                   "server_reason": "unknown patient identifier in PID-3"}
        page = render_status_page(_state_view({}, failures=[failure]))
        assert '<div class="reason">unknown patient identifier in PID-3</div>' in page
        assert "<b>422</b> rejected by server (status 422)" in page
        assert "1m 0s ago" in page and "id <code>3f2a9c1e</code>" in page


class TestHistoryPlots:
    def test_in_out_and_depth_are_drawn_as_svg(self) -> None:
        """Two inline SVG plots, one polyline per series, totals in the caption, gaps for no sample."""
        history = {"minute_s": 60, "start": "2025-12-31T23:01:00Z", "counted_since": "2025-12-31T23:30:00Z",
                   "in": [0] * 57 + [5, 3, 2], "out": [0] * 57 + [1, 4, 2], "depth": [None] * 30 + [4] * 30}
        page = render_status_page(_state_view({}, history=history))
        dom = _dom(page)
        assert dom.find(id="plot-flow")[0]["<tag>"] == "svg" and dom.find(id="plot-depth")
        series = [e["data-series"] for e in dom.elements if e.get("class") == "series"]
        assert series == ["in", "out", "depth"]
        (depth_line,) = dom.find(data_series="depth")
        assert len(depth_line["points"].split()) == 30  # the 30 minutes without a sample are a gap
        assert dom.text_by_id["hist-in"] == "10" and dom.text_by_id["hist-out"] == "7"
        assert dom.text_by_id["hist-depth"] == "4"
        assert "counted by this process (since 2025-12-31T23:30:00Z)" in page
        assert dom.find(id="plot-flow")[0]["data-top"] == "5"
        assert "<script" not in page.lower() and "href=" not in page and "src=" not in page

    def test_no_history(self) -> None:
        """A view without history says so instead of drawing an empty plot."""
        assert "No history in this process." in render_status_page(_view())


class TestNarrowAndSelfContained:
    def test_readable_at_700px_by_construction(self) -> None:
        """A viewport meta, a fluid layout (no fixed widths over 700 px) and scalable SVG."""
        page = render_status_page(_state_view({}))
        assert '<meta name="viewport" content="width=device-width, initial-scale=1">' in page
        widths = [int(w) for w in re.findall(r"(?:^|[;{])\s*(?:min-)?width:(\d+)px", page)]
        assert all(w <= 700 for w in widths), widths
        assert "svg.plot{width:100%;height:auto" in page

    @pytest.mark.parametrize("refresh", [5, 30])
    def test_refresh_is_a_meta_refresh(self, refresh: int) -> None:
        """The page reloads itself without script; it says how often."""
        page = render_status_page(_state_view({}), refresh_seconds=refresh)
        assert f'<meta http-equiv="refresh" content="{refresh}">' in page
        assert f"refreshes every {refresh} s" in page


class TestPlots:
    def test_round_tops(self) -> None:
        """The y axis ends at 1, 2 or 5 times a power of ten, at least 1."""
        assert [nice_ceiling(v) for v in (0, 0.4, 1, 3, 7, 10, 11, 26, 480, 5001)] == [
            1, 1, 1, 5, 10, 10, 20, 50, 500, 10000]

    def test_a_lone_sample_is_a_dot(self) -> None:
        """One point between gaps is drawn (a one-point polyline draws nothing)."""
        svg = line_plot([Line("depth", "#000", [None, 3, None])], title="t", x_labels=[], plot_id="p")
        assert '<circle class="series" data-series="depth"' in svg and "<polyline" not in svg

    def test_labels_are_escaped(self) -> None:
        """Titles and labels are escaped like every other text."""
        svg = line_plot([Line("<in>", "#000", [1, 2])], title='a"<b>', x_labels=[(0, "<x>")], plot_id="p")
        assert "<in>" not in svg and "<b>" not in svg and "<x>" not in svg and "&lt;in&gt;" in svg

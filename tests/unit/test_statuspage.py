"""The status page renderer: escaping, empty and degraded states, no bodies."""

from __future__ import annotations

from html.parser import HTMLParser
from typing import Any

from agent.core.timefmt import human_bytes, human_duration
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
        assert "disconnected" in page


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
        """A paused channel shows a paused badge and its oldest queued age in human form."""
        stats = _stats(
            adt=_channel(queued=4, oldest_queued_age_s=192.4, paused=True),
            lab=_channel(inflight=1),
        )
        page = render_status_page(_view(stats=stats))
        assert "paused" in page
        assert "3m 12s" in page
        assert "dispatching" in page  # lab is not paused
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

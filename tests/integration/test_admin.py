"""The admin endpoint over real HTTP on 127.0.0.1, with a stand-in RuntimeView.

The view is the seam between the daemon and the admin server: here it is plain
functions over a mutable dict, so each test can flip readiness or queue depth
and watch the endpoint follow.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from agenttest import wait_for
from prometheus_client.parser import text_string_to_metric_families

from agent.app.health import check_health
from agent.core.addresses import format_listen, parse_listen
from agent.errors import ConfigError
from agent.runtime.admin import AdminListenInUse, AdminServer, RuntimeView
from agent.runtime.history import MinuteHistory
from agent.runtime.metrics import AgentMetrics


class FakeRuntime:
    """A RuntimeView's worth of state, changed by tests between requests."""

    def __init__(self) -> None:
        self.listeners = True
        self.db: tuple[bool, str] = (True, "")
        self.stats_error: Exception | None = None
        self.channels: dict[str, dict[str, Any]] = {
            "adt": {
                "queued": 2,
                "claimed": 0,
                "inflight": 1,
                "oldest_queued_age_s": 12.5,
                "paused": False,
            },
            "lab": {
                "queued": 0,
                "claimed": 0,
                "inflight": 0,
                "oldest_queued_age_s": None,
                "paused": True,
            },
        }
        self.failures: list[dict[str, Any]] = []

    def stats(self) -> dict[str, Any]:
        if self.stats_error is not None:
            raise self.stats_error
        queued = sum(c["queued"] for c in self.channels.values())
        return {
            "states": {
                "queued": queued,
                "claimed": 0,
                "inflight": 1,
                "processed": 7,
                "rejected": 0,
                "failed": len(self.failures),
                "nacked": 0,
            },
            "channels": self.channels,
            "lease": {"holder": "edge-01:99", "epoch": 3, "expires_at": "2025-01-01T00:00:30Z"},
            "db": {"path": "/tmp/queue.db", "size_bytes": 8192, "wal_bytes": 1024},
        }

    def view(self) -> RuntimeView:
        return RuntimeView(
            agent_id="edge-01",
            version="9.9.9",
            started_at=time.time() - 192,
            listeners_up=lambda: self.listeners,
            db_writable=lambda: self.db,
            upstream_state=lambda: {
                "configured": True,
                "connected": False,
                "url": "ws://127.0.0.1:1/agent",
                "replay": None,
                "last_error": "connection refused",
            },
            lease_held=lambda: True,
            stats=self.stats,
            recent_failures=lambda n: self.failures[:n],
        )


@pytest.fixture
def runtime() -> FakeRuntime:
    return FakeRuntime()


@pytest.fixture
def metrics() -> AgentMetrics:
    return AgentMetrics()


@pytest.fixture
def server(runtime: FakeRuntime, metrics: AgentMetrics) -> Iterator[AdminServer]:
    admin = AdminServer("127.0.0.1:0", runtime.view(), metrics)
    admin.start()
    try:
        yield admin
    finally:
        admin.stop()


def request(
    admin: AdminServer,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    host, port = admin.address
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def scrape(admin: AdminServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, _headers, body = request(admin, "GET", "/metrics")
    assert status == 200
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


class TestHealthz:
    def test_healthz_ok(self, server: AdminServer) -> None:
        """/healthz answers 200 ok while the process lives."""
        status, headers, body = request(server, "GET", "/healthz")
        assert (status, body) == (200, b"ok\n")
        assert headers["content-type"].startswith("text/plain")

    def test_head_has_no_body(self, server: AdminServer) -> None:
        """HEAD gets the GET headers with no body."""
        status, headers, body = request(server, "HEAD", "/healthz")
        assert status == 200 and body == b"" and headers["content-length"] == "3"

    def test_query_string_is_ignored(self, server: AdminServer) -> None:
        """A query string does not change the route."""
        assert request(server, "GET", "/healthz?probe=1")[0] == 200

    def test_unknown_path_is_404(self, server: AdminServer) -> None:
        """An unknown path is 404."""
        assert request(server, "GET", "/nope")[0] == 404

    def test_check_health_true_and_false(self, server: AdminServer) -> None:
        """check_health is True against the live server and False once it stopped."""
        listen = format_listen(*server.address)
        assert check_health(listen) is True
        server.stop()
        assert check_health(listen, timeout=1.0) is False

    def test_check_health_wildcard_probes_loopback(self, server: AdminServer) -> None:
        """A wildcard listen (0.0.0.0) is probed on loopback, where the server also answers."""
        assert check_health(f"0.0.0.0:{server.address[1]}") is True

    def test_check_health_false_on_garbage(self) -> None:
        """A malformed address is False, not an exception."""
        assert check_health("no-port-here") is False


class TestReadyz:
    def test_ready(self, server: AdminServer) -> None:
        """/readyz is 200 when listeners are up and the database takes writes."""
        status, _, body = request(server, "GET", "/readyz")
        assert (status, body) == (200, b"ready\n")

    def test_db_not_writable(self, server: AdminServer, runtime: FakeRuntime) -> None:
        """/readyz is 503 with the database's reason on one line."""
        runtime.db = (False, "disk I/O error\nsecond line")
        status, headers, body = request(server, "GET", "/readyz")
        assert status == 503
        assert headers["content-type"].startswith("text/plain")
        assert body == b"not ready: database not writable (disk I/O error second line)\n"

    def test_listeners_down(self, server: AdminServer, runtime: FakeRuntime) -> None:
        """/readyz is 503 naming the listeners when they are not up."""
        runtime.listeners = False
        status, _, body = request(server, "GET", "/readyz")
        assert status == 503 and b"listeners" in body and body.count(b"\n") == 1

    def test_probe_raising_is_not_ready(self, server: AdminServer, runtime: FakeRuntime) -> None:
        """A db_writable that raises reads as not ready, not as a 500."""

        def boom() -> tuple[bool, str]:
            raise TimeoutError("writer thread busy")

        server._view.db_writable = boom
        status, _, body = request(server, "GET", "/readyz")
        assert status == 503 and b"TimeoutError: writer thread busy" in body


class TestMetrics:
    def test_exposition_parses(self, server: AdminServer) -> None:
        """/metrics is the Prometheus text format and carries the info series."""
        status, headers, _body = request(server, "GET", "/metrics")
        assert status == 200
        assert headers["content-type"].startswith("text/plain; version=")
        samples = scrape(server)
        assert samples[("hl7_agent_info", (("agent_id", "edge-01"), ("version", "9.9.9")))] == 1

    def test_counters_move(self, server: AdminServer, metrics: AgentMetrics) -> None:
        """message_committed and friends show up in the next scrape."""
        metrics.message_received("adt")
        metrics.message_committed("adt")
        metrics.message_committed("adt")
        metrics.message_rejected("adt", "AE")
        metrics.message_settled("adt", "processed")
        metrics.observe_dispatch_latency("adt", 0.02)
        metrics.set_upstream_connected(True)
        metrics.set_lease_held(True)
        s = scrape(server)
        assert s[("hl7_agent_messages_received_total", (("channel", "adt"),))] == 1
        assert s[("hl7_agent_messages_committed_total", (("channel", "adt"),))] == 2
        assert s[("hl7_agent_messages_rejected_total", (("channel", "adt"), ("code", "AE")))] == 1
        key = ("hl7_agent_messages_settled_total", (("channel", "adt"), ("state", "processed")))
        assert s[key] == 1
        bucket = ("channel", "adt"), ("le", "0.025")
        assert s[("hl7_agent_dispatch_latency_seconds_bucket", bucket)] == 1
        assert s[("hl7_agent_dispatch_latency_seconds_count", (("channel", "adt"),))] == 1
        assert s[("hl7_agent_upstream_connected", ())] == 1
        assert s[("hl7_agent_lease_held", ())] == 1

    def test_queue_gauges_follow_stats(self, server: AdminServer, runtime: FakeRuntime) -> None:
        """Queue depth, age, pause and sizes come from stats() at each scrape."""
        s = scrape(server)
        assert s[("hl7_agent_stats_up", ())] == 1
        assert s[("hl7_agent_queue_depth", (("channel", "adt"), ("state", "queued")))] == 2
        assert s[("hl7_agent_queue_depth", (("channel", "adt"), ("state", "inflight")))] == 1
        assert s[("hl7_agent_oldest_queued_age_seconds", (("channel", "adt"),))] == 12.5
        assert s[("hl7_agent_oldest_queued_age_seconds", (("channel", "lab"),))] == 0
        assert s[("hl7_agent_channel_paused", (("channel", "lab"),))] == 1
        assert s[("hl7_agent_messages", (("state", "processed"),))] == 7
        assert s[("hl7_agent_db_size_bytes", ())] == 8192
        assert s[("hl7_agent_wal_size_bytes", ())] == 1024
        runtime.channels["adt"]["queued"] = 40
        s = scrape(server)
        assert s[("hl7_agent_queue_depth", (("channel", "adt"), ("state", "queued")))] == 40

    def test_stats_failure_keeps_scrape(
        self, server: AdminServer, runtime: FakeRuntime, metrics: AgentMetrics
    ) -> None:
        """A failing stats() yields hl7_agent_stats_up 0 and the counters still scrape."""
        metrics.message_committed("adt")
        runtime.stats_error = OSError("unable to open database file")
        s = scrape(server)
        assert s[("hl7_agent_stats_up", ())] == 0
        assert s[("hl7_agent_messages_committed_total", (("channel", "adt"),))] == 1
        assert not any(name == "hl7_agent_queue_depth" for name, _ in s)

    def test_openmetrics_negotiated(self, server: AdminServer) -> None:
        """A scraper asking for OpenMetrics gets it, ending in # EOF."""
        status, headers, body = request(
            server, "GET", "/metrics", headers={"Accept": "application/openmetrics-text"}
        )
        assert status == 200
        assert headers["content-type"].startswith("application/openmetrics-text")
        assert body.endswith(b"# EOF\n")

    def test_no_created_series_and_every_other_series_kept(
        self, server: AdminServer, metrics: AgentMetrics
    ) -> None:
        """No `_created` sample in either format; every counter, histogram and gauge series stays."""
        metrics.message_received("adt")
        metrics.message_committed("adt")
        metrics.message_rejected("adt", "AE")
        metrics.message_settled("adt", "processed")
        metrics.observe_dispatch_latency("adt", 0.02)
        metrics.connection_opened("adt")
        metrics.connection_refused("adt", "busy")
        metrics.connection_evicted("adt")
        metrics.connection_timed_out("adt", "idle")
        metrics.audit_row_not_stored("adt")
        names = {name for name, _labels in scrape(server)}
        assert not [n for n in names if n.endswith("_created")]
        expected = {
            "hl7_agent_messages_received_total", "hl7_agent_messages_committed_total",
            "hl7_agent_messages_rejected_total", "hl7_agent_messages_settled_total",
            "hl7_agent_dispatch_latency_seconds_bucket", "hl7_agent_dispatch_latency_seconds_count",
            "hl7_agent_dispatch_latency_seconds_sum", "hl7_agent_upstream_connected",
            "hl7_agent_lease_held", "hl7_agent_connections_open",
            "hl7_agent_connections_refused_total", "hl7_agent_connections_evicted_total",
            "hl7_agent_connections_timed_out_total", "hl7_agent_audit_rows_not_stored_total",
            "hl7_agent_info", "hl7_agent_stats_up", "hl7_agent_queue_depth", "hl7_agent_messages",
            "hl7_agent_oldest_queued_age_seconds", "hl7_agent_channel_paused",
            "hl7_agent_db_size_bytes", "hl7_agent_wal_size_bytes",
            "hl7_agent_log_lines_dropped_total",
        }  # fmt: skip
        assert expected <= names, expected - names
        _, _, body = request(server, "GET", "/metrics", headers={"Accept": "application/openmetrics-text"})
        assert b"_created" not in body and b"hl7_agent_messages_committed_total" in body

    def test_two_instances_do_not_collide(self) -> None:
        """Two AgentMetrics in one process keep separate registries."""
        a, b = AgentMetrics(), AgentMetrics()
        a.message_committed("adt")
        assert b'hl7_agent_messages_committed_total{channel="adt"} 1.0' in a.exposition_for(None)[0]
        assert b"hl7_agent_messages_committed_total{" not in b.exposition_for(None)[0]


class TestStatusPage:
    def test_page_lists_channels(self, server: AdminServer) -> None:
        """/ renders the HTML status page with channel names and the upstream error."""
        status, headers, body = request(server, "GET", "/")
        page = body.decode()
        assert status == 200 and headers["content-type"] == "text/html; charset=utf-8"
        assert "<code>adt</code>" in page and "<code>lab</code>" in page
        assert "connection refused" in page and "edge-01:99" in page
        assert "script-src" not in headers["content-security-policy"]

    def test_page_escapes_values(self, server: AdminServer, runtime: FakeRuntime) -> None:
        """A hostile control id reaches the page escaped."""
        runtime.failures.append(
            {
                "id": "u1",
                "channel": "adt",
                "control_id": "<script>x</script>",
                "message_type": "ADT^A01",
                "state": "failed",
                "error_code": "207",
                "error_text": "gave up",
                "attempts": 5,
                "updated_at": "2025-01-01T00:00:00Z",
            }
        )
        page = request(server, "GET", "/")[2].decode()
        assert "<script>" not in page and "&lt;script&gt;x&lt;/script&gt;" in page

    def test_page_survives_stats_failure(self, server: AdminServer, runtime: FakeRuntime) -> None:
        """With the database unreadable the page still renders and says why."""
        runtime.stats_error = OSError("unable to open database file")
        status, _, body = request(server, "GET", "/")
        assert status == 200 and b"unable to open database file" in body

    def test_status_json(self, server: AdminServer, runtime: FakeRuntime) -> None:
        """/status.json carries stats, upstream, lease and recent failures."""
        status, headers, body = request(server, "GET", "/status.json")
        data = json.loads(body)
        assert status == 200 and headers["content-type"] == "application/json"
        assert data["agent_id"] == "edge-01" and data["version"] == "9.9.9"
        assert data["stats"]["channels"]["adt"]["queued"] == 2
        assert data["upstream"]["last_error"] == "connection refused"
        assert data["lease_held"] is True and data["recent_failures"] == []
        assert data["uptime_s"] >= 192 and data["errors"] == {}


class TestClientsGoneEarly:
    def test_a_client_that_resets_before_its_answer_leaves_no_traceback(
        self, server: AdminServer, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """curl | head, a scrape timeout: the failed request is a log line, never socketserver's traceback.

        That traceback went to stderr, the daemon's JSON log: 20 such
        requests wrote 545 lines that are no JSON, and glued the next events on.
        """
        host, port = server.address
        before = threading.active_count()
        for _ in range(20):
            with socket.create_connection((host, port), timeout=5) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
                sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        wait_for(lambda: threading.active_count() <= before, 10, what="every request handled")
        assert request(server, "GET", "/healthz")[0] == 200
        err = capsys.readouterr().err
        assert "Traceback" not in err and "Exception occurred" not in err, err[:500]


class TestDepthSampler:
    def test_depth_is_sampled_into_the_history_until_stop(self, runtime: FakeRuntime) -> None:
        """The admin server samples live depth at once and on; stop() ends the sampler thread."""
        history = MinuteHistory()
        calls: list[int] = []

        def live_depth() -> int:
            calls.append(1)
            return 42

        view = dataclasses.replace(runtime.view(), live_depth=live_depth, history=history)
        admin = AdminServer("127.0.0.1:0", view, AgentMetrics())
        admin.start()
        try:
            wait_for(lambda: history.series()["depth"][-1] == 42, 5, what="a depth sample")
        finally:
            admin.stop()
        assert not [t for t in threading.enumerate() if t.name == "admin-depth"]
        assert len(calls) == 1  # the next one is DEPTH_SAMPLE_INTERVAL away

    def test_a_failing_sample_leaves_a_gap(self, runtime: FakeRuntime) -> None:
        """A database error while sampling is a missing point, not a dead thread or a failed page."""
        history = MinuteHistory()
        failed: list[int] = []

        def live_depth() -> int:
            failed.append(1)
            raise OSError("disk I/O error")

        view = dataclasses.replace(runtime.view(), live_depth=live_depth, history=history)
        admin = AdminServer("127.0.0.1:0", view, AgentMetrics())
        admin.start()
        try:
            wait_for(lambda: failed, 5, what="a failed sample")
            assert history.series()["depth"][-1] is None
            assert [t for t in threading.enumerate() if t.name == "admin-depth" and t.is_alive()]
            status, _, _ = request(admin, "GET", "/")
            assert status == 200
            assert history.series()["depth"][-1] == 3  # the page's own stats read is a sample too
        finally:
            admin.stop()


class TestMethodsAndBinding:
    @pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
    def test_other_methods_405(self, server: AdminServer, method: str) -> None:
        """Anything but GET/HEAD is 405 with an Allow header."""
        status, headers, _ = request(server, method, "/healthz", body=b"x=1")
        assert status == 405 and headers["allow"] == "GET, HEAD"

    def test_address_in_use(self, runtime: FakeRuntime) -> None:
        """A taken admin address fails start() with the one-line fix."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            port = holder.getsockname()[1]
            admin = AdminServer(f"127.0.0.1:{port}", runtime.view(), AgentMetrics())
            with pytest.raises(AdminListenInUse) as info:
                admin.start()
        message = str(info.value)
        assert message == (
            f"admin listen 127.0.0.1:{port} is in use — give each overlapping version "
            "its own HL7_AGENT_ADMIN__LISTEN"
        )
        assert isinstance(info.value, ConfigError)
        admin.stop()  # never started: a no-op

    def test_bad_listen_is_config_error(self, runtime: FakeRuntime) -> None:
        """A malformed listen string is a ConfigError naming admin.listen."""
        admin = AdminServer("localhost", runtime.view(), AgentMetrics())
        with pytest.raises(ConfigError, match="admin.listen"):
            admin.start()

    def test_ipv6_loopback(self, runtime: FakeRuntime) -> None:
        """A [::1]:0 listen binds IPv6 loopback and check_health reaches it."""
        if not socket.has_ipv6:
            pytest.skip("no IPv6")
        admin = AdminServer("[::1]:0", runtime.view(), AgentMetrics())
        try:
            admin.start()
        except ConfigError:
            pytest.skip("IPv6 loopback unavailable here")
        try:
            host, port = admin.address
            assert host == "::1"
            assert check_health(format_listen(host, port)) is True
        finally:
            admin.stop()

    def test_slow_probe_does_not_block_other_routes(
        self, server: AdminServer, runtime: FakeRuntime
    ) -> None:
        """A blocked readiness probe does not hold up /healthz (threads per request)."""
        release = threading.Event()
        entered = threading.Event()

        def slow() -> tuple[bool, str]:
            entered.set()
            release.wait(10)
            return True, ""

        server._view.db_writable = slow
        result: list[int] = []
        t = threading.Thread(target=lambda: result.append(request(server, "GET", "/readyz")[0]))
        t.start()
        try:
            assert entered.wait(5)
            assert request(server, "GET", "/healthz")[0] == 200
        finally:
            release.set()
            t.join(10)
        assert result == [200]

    def test_stop_is_idempotent_and_frees_port(self, runtime: FakeRuntime) -> None:
        """After stop() the port can be bound again, and a second stop() is harmless."""
        admin = AdminServer("127.0.0.1:0", runtime.view(), AgentMetrics())
        admin.start()
        host, port = admin.address
        admin.stop()
        admin.stop()
        again = AdminServer(f"{host}:{port}", runtime.view(), AgentMetrics())
        again.start()
        try:
            assert again.address == (host, port)
        finally:
            again.stop()


class TestParseListen:
    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            ("127.0.0.1:9575", ("127.0.0.1", 9575)),
            ("[::1]:9575", ("::1", 9575)),
            ("localhost:0", ("localhost", 0)),
            ("0.0.0.0:80", ("0.0.0.0", 80)),
        ],
    )
    def test_valid(self, text: str, expected: tuple[str, int]) -> None:
        """host:port and [v6]:port split into host and port."""
        assert parse_listen(text, allow_port_zero=True) == expected
        assert parse_listen(format_listen(*expected), allow_port_zero=True) == expected

    @pytest.mark.parametrize("text", ["9575", "::1:9575", "[::1]9575", "h:port", "h:70000"])
    def test_invalid(self, text: str) -> None:
        """Malformed listen strings are ValueErrors."""
        with pytest.raises(ValueError, match="listen"):
            parse_listen(text)

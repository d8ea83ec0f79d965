"""The admin HTTP endpoint: /healthz, /readyz, /metrics, the status page.

It runs in its own threads (``ThreadingHTTPServer``), not on the event loop:
a scrape reads the database (``stats()``) and a readiness probe writes through
the writer thread (``db_writable()``, up to ~2 s), and neither may ever delay
an ACK. Everything it shows comes through ``RuntimeView``, callables the daemon
provides that are safe to call from any thread.

Routes (GET and HEAD; any other method is 405):

    /healthz      200 "ok" while the event loop runs: its heartbeat is younger than
                  LOOP_STALL_LIMIT; else 503 with the age (Docker HEALTHCHECK,
                  `hl7-agent health`). A loop stuck in a blocking call answers
                  no sender, so the process is not healthy however alive it is.
    /readyz       200 when the listeners are up and the database takes writes,
                  else 503 with a one-line reason (the upgrade script waits on it: docs/deploy.md)
    /metrics      Prometheus exposition (agent.runtime.metrics)
    /             the status page (agent.runtime.statuspage)
    /status.json  the same facts as JSON: the sections below, and ``assessment``
                  (agent.core.status: each channel's state in words) and
                  ``history`` (agent.runtime.history: the last hour per minute)

It binds loopback by default (`[admin] listen = "127.0.0.1:9575"`, docs/configuration.md#admin):
the page names channels and control ids, which is operator information.

Just over 400 lines on purpose: the threaded server, its routes and the
checks behind /healthz and /readyz are one endpoint; what the pages show is
built elsewhere (metrics, statuspage, statusview).
"""

from __future__ import annotations

import asyncio
import errno
import json
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar, Self
from urllib.parse import urlsplit

import structlog

from agent.core.addresses import format_listen, parse_listen
from agent.errors import AdminListenInUse, ConfigError
from agent.runtime.history import MinuteHistory
from agent.runtime.metrics import AgentMetrics
from agent.runtime.statuspage import render_status_page
from agent.runtime.statusview import RECENT_FAILURES, RuntimeView, collect_view_data, reason_of

__all__ = [
    "LOOP_STALL_LIMIT",
    "RECENT_FAILURES",
    "AdminListenInUse",
    "AdminServer",
    "LoopHeartbeat",
    "RuntimeView",
    "collect_view_data",
    "liveness",
    "readiness",
]

log = structlog.get_logger(__name__)

#: Seconds a client may take to send its request before its thread gives up
#: (a stuck or slow client must not hold a handler thread forever).
REQUEST_TIMEOUT = 10.0

#: serve_forever's shutdown check: stop() waits up to this long. A selector
#: wake-up 20 times a second costs nothing measurable and keeps stop() prompt.
_POLL_INTERVAL = 0.05

#: /healthz answers 503 once the event loop's heartbeat is older than this
#: (seconds). Ten missed beats: long enough that a busy loop or a slow disk
#: does not flap, short enough that Docker's HEALTHCHECK (and an orchestrator
#: watching it) sees a stuck daemon within one or two of its intervals.
LOOP_STALL_LIMIT = 5.0

#: How often the event loop refreshes its heartbeat (seconds).
HEARTBEAT_INTERVAL = 0.5

#: How often the admin server samples the queue's depth for the page's history
#: (seconds): four samples a minute, each one count over the live-row index.
DEPTH_SAMPLE_INTERVAL = 15.0

#: Largest request body read (and dropped) before answering 405.
_MAX_DRAIN = 64 * 1024

_TEXT = "text/plain; charset=utf-8"
_HTML = "text/html; charset=utf-8"
_JSON = "application/json"

#: No script, no external anything: the page is inline CSS only.
_SECURITY_HEADERS = (
    ("Cache-Control", "no-store"),
    ("X-Content-Type-Options", "nosniff"),
    ("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'"),
    ("Referrer-Policy", "no-referrer"),
)


class LoopHeartbeat:
    """A timestamp the event loop refreshes and any thread may read.

    The admin endpoint runs on its own threads, so it keeps answering while the
    loop is stuck (a blocking write, a long synchronous call): only a value the
    loop itself must keep fresh tells the two apart.
    """

    def __init__(self) -> None:
        self._last = time.monotonic()

    def beat(self) -> None:
        self._last = time.monotonic()

    def age(self) -> float:
        """Seconds since the loop last beat (a float read: safe from any thread)."""
        return max(0.0, time.monotonic() - self._last)

    async def run(self, interval: float = HEARTBEAT_INTERVAL) -> None:
        """Beat every ``interval`` seconds until cancelled."""
        while True:
            self.beat()
            await asyncio.sleep(interval)


def liveness(view: RuntimeView, limit: float = LOOP_STALL_LIMIT) -> tuple[bool, str]:
    """Live = the event loop beat less than ``limit`` seconds ago (one-line reason)."""
    if view.loop_age is None:
        return True, "ok"
    try:
        age = view.loop_age()
    except Exception as exc:  # noqa: BLE001 — a failing probe means not live
        return False, f"unhealthy: loop heartbeat unreadable ({reason_of(exc)})"
    if age >= limit:
        return False, f"unhealthy: event loop stuck for {age:.1f}s (limit {limit:g}s)"
    return True, "ok"


def readiness(view: RuntimeView) -> tuple[bool, str]:
    """Ready = listeners accepting and the database taking writes (one-line reason)."""
    try:
        if not view.listeners_up():
            return False, "not ready: MLLP listeners are not up"
    except Exception as exc:  # noqa: BLE001 — a failing probe means not ready
        return False, f"not ready: listener check failed ({reason_of(exc)})"
    try:
        writable, why = view.db_writable()
    except Exception as exc:  # noqa: BLE001
        return False, f"not ready: database check failed ({reason_of(exc)})"
    if not writable:
        detail = " ".join(str(why).split()) or "no reason given"
        return False, f"not ready: database not writable ({detail})"
    return True, "ready"


class _Server(ThreadingHTTPServer):
    """ThreadingHTTPServer without the reverse-DNS lookup at bind.

    ``HTTPServer.server_bind`` calls ``socket.getfqdn(host)``, which can stall
    for seconds on a hospital host with broken DNS; we never use the name.
    """

    daemon_threads = True
    block_on_close = False

    def __init__(
        self,
        address: tuple[str, int],
        family: socket.AddressFamily,
        view: RuntimeView,
        metrics: AgentMetrics,
        loop_stall_limit: float,
    ) -> None:
        self.address_family = family
        self.view = view
        self.metrics = metrics
        self.loop_stall_limit = loop_stall_limit
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:  # noqa: ANN401 - socketserver's types
        """A request that failed (a client gone before its answer: curl | head, a scrape timeout): one log line.

        socketserver's own prints a traceback to stderr, which is not a JSON
        line and breaks the log for every line-based shipper.
        """
        error = sys.exc_info()[1]
        if isinstance(error, ConnectionError | TimeoutError):
            log.debug("admin_client_gone", error=type(error).__name__)
        else:
            log.warning("admin_request_failed", error=repr(error)[:200])

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)  # skips HTTPServer's getfqdn
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)


class _Handler(BaseHTTPRequestHandler):
    """One request; answers are built in full, then written with Content-Length."""

    server: _Server
    timeout = REQUEST_TIMEOUT
    server_version = "hl7-agent-admin"
    sys_version = ""
    protocol_version = "HTTP/1.0"  # one request per connection: no idle threads

    _ROUTES: ClassVar[dict[str, str]] = {
        "/healthz": "_healthz",
        "/readyz": "_readyz",
        "/metrics": "_metrics",
        "/": "_status_page",
        "/status.json": "_status_json",
    }

    # -- methods ----------------------------------------------------------

    def do_GET(self) -> None:
        self._serve(send_body=True)

    def do_HEAD(self) -> None:
        self._serve(send_body=False)

    def _method_not_allowed(self) -> None:
        self._drain_body()
        self.close_connection = True
        self._respond(
            HTTPStatus.METHOD_NOT_ALLOWED,
            _TEXT,
            b"method not allowed\n",
            send_body=True,
            extra=(("Allow", "GET, HEAD"),),
        )

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = (
        _method_not_allowed
    )

    def _drain_body(self) -> None:
        """Read a small request body we will not use.

        Closing a socket with unread bytes makes the kernel send RST, which can
        destroy the 405 before the client reads it; a large body is not worth
        reading, and its sender gets the reset.
        """
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            return
        if 0 < length <= _MAX_DRAIN:
            self.rfile.read(length)

    # -- routing ----------------------------------------------------------

    def _serve(self, *, send_body: bool) -> None:
        path = urlsplit(self.path).path
        name = self._ROUTES.get(path)
        if name is None:
            self._respond(HTTPStatus.NOT_FOUND, _TEXT, b"not found\n", send_body=send_body)
            return
        try:
            status, content_type, body = getattr(self, name)()
        except Exception as exc:
            log.exception("admin_request_failed", path=path, error=type(exc).__name__)
            status, content_type, body = (
                HTTPStatus.INTERNAL_SERVER_ERROR,
                _TEXT,
                b"internal error\n",
            )
        self._respond(status, content_type, body, send_body=send_body)

    def _respond(
        self,
        status: HTTPStatus,
        content_type: str,
        body: bytes,
        *,
        send_body: bool,
        extra: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (*_SECURITY_HEADERS, *extra):
            self.send_header(key, value)
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    # -- routes: each returns (status, content type, body) -----------------

    def _healthz(self) -> tuple[HTTPStatus, str, bytes]:
        live, reason = liveness(self.server.view, self.server.loop_stall_limit)
        status = HTTPStatus.OK if live else HTTPStatus.SERVICE_UNAVAILABLE
        return status, _TEXT, (reason + "\n").encode()

    def _readyz(self) -> tuple[HTTPStatus, str, bytes]:
        ready, reason = readiness(self.server.view)
        status = HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE
        return status, _TEXT, (reason + "\n").encode()

    def _metrics(self) -> tuple[HTTPStatus, str, bytes]:
        body, content_type = self.server.metrics.exposition_for(self.headers.get("Accept"))
        return HTTPStatus.OK, content_type, body

    def _status_page(self) -> tuple[HTTPStatus, str, bytes]:
        page = render_status_page(collect_view_data(self.server.view))
        return HTTPStatus.OK, _HTML, page.encode("utf-8")

    def _status_json(self) -> tuple[HTTPStatus, str, bytes]:
        data = collect_view_data(self.server.view)
        return HTTPStatus.OK, _JSON, (json.dumps(data, default=str) + "\n").encode("utf-8")

    # -- logging: structlog at debug, never the stderr access log ----------

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        log.debug(
            "admin_request",
            method=self.command,
            path=urlsplit(self.path).path[:200],
            status=int(code) if isinstance(code, int) else code,
        )

    def log_error(self, format: str, *args: Any) -> None:
        log.debug("admin_http_error", detail=(format % args)[:200])

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("admin_http_message", detail=(format % args)[:200])


class AdminServer:
    """The admin endpoint on its own threads; the daemon starts and stops it."""

    def __init__(
        self,
        listen: str,
        view: RuntimeView,
        metrics: AgentMetrics,
        *,
        loop_stall_limit: float = LOOP_STALL_LIMIT,
    ) -> None:
        self._listen = listen
        self._view = view
        self._metrics = metrics
        self._loop_stall_limit = loop_stall_limit
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._sampler: threading.Thread | None = None
        self._sampler_stop = threading.Event()
        metrics.set_info(agent_id=view.agent_id, version=view.version)
        metrics.bind_stats(view.stats)

    def start(self) -> None:
        """Bind now (so a taken address fails the start), then serve in a thread."""
        if self._server is not None:
            raise RuntimeError("admin server already started")
        try:
            host, port = parse_listen(self._listen, allow_port_zero=True)
        except ValueError as exc:
            raise ConfigError(f"config error: admin.listen: {exc}") from exc
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            server = _Server((host, port), family, self._view, self._metrics, self._loop_stall_limit)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise AdminListenInUse(
                    f"admin listen {self._listen} is in use — give each overlapping version "
                    "its own HL7_AGENT_ADMIN__LISTEN"
                ) from exc
            raise ConfigError(
                f"admin listen {self._listen} cannot be bound: {exc.strerror or exc}"
            ) from exc
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": _POLL_INTERVAL},
            name="admin-http",
            daemon=True,
        )
        self._thread.start()
        live_depth, history = self._view.live_depth, self._view.history
        if live_depth is not None and history is not None:
            self._sampler_stop.clear()
            self._sampler = threading.Thread(
                target=self._sample_depth, args=(live_depth, history), name="admin-depth", daemon=True
            )
            self._sampler.start()
        log.info("admin_listening", listen=format_listen(*self.address))

    def _sample_depth(self, live_depth: Callable[[], int], history: MinuteHistory) -> None:
        """The queue's depth into the page's history, every DEPTH_SAMPLE_INTERVAL, until stop()."""
        while True:
            try:
                history.note_depth(live_depth())
            except Exception as exc:  # noqa: BLE001 - a gap in the plot, never a dead thread
                log.debug("admin_depth_sample_failed", error=type(exc).__name__)
            if self._sampler_stop.wait(DEPTH_SAMPLE_INTERVAL):
                return

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port): with port 0 in ``listen``, the real port."""
        if self._server is None:
            raise RuntimeError("admin server not started")
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def stop(self) -> None:
        """Stop serving and close the socket; safe to call twice or before start."""
        server, thread, sampler = self._server, self._thread, self._sampler
        self._server = self._thread = self._sampler = None
        if server is None:
            return
        self._sampler_stop.set()
        if sampler is not None:
            sampler.join(timeout=5.0)
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5.0)
        log.info("admin_stopped")

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

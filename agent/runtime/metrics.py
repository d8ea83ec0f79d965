"""Prometheus metrics for one agent process, in the agent's own registry.

The registry is private to each ``AgentMetrics`` (never prometheus-client's
global ``REGISTRY``): tests, and two daemons in one process during an overlap
test, must not collide on metric names.

Two kinds of metric live here:

- event counters and a latency histogram, moved by the listener and the
  dispatcher as things happen (``message_committed`` ...);
- queue gauges, read at scrape time from the ``queue stats --json`` shape
  (docs/operations.md#--json) through a bound callable, so the numbers are the database's, shared
  by every process on the file, not one process's guess.

The same two events also feed ``history`` (agent.runtime.history): messages in
and out per minute over the last hour, for the status page's plots.

Just over 400 lines on purpose: each metric's definition and the one method
that moves it read best side by side, in the one registry.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from agent import __version__
from agent.core.states import DEPTH
from agent.runtime import logs
from agent.runtime.history import MinuteHistory

log = structlog.get_logger(__name__)

# No ``<counter>_created`` / ``<histogram>_created`` series: each is a start
# timestamp per label set, which nobody graphs or alerts on and which doubles
# the series a scrape carries. prometheus-client's switch is process-wide; the
# daemon has no other registry it could matter to.
disable_created_metrics()  # type: ignore[no-untyped-call]

#: Dispatch latency buckets, 5 ms .. 60 s: a LAN server answers in milliseconds,
#: an application-ACK round trip through an EHR can take tens of seconds, and
#: response_timeout defaults to 30 s (docs/configuration.md#server).
LATENCY_BUCKETS: tuple[float, ...] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

class _QueueStatsCollector:
    """Turns one ``stats()`` call into gauges at scrape time.

    A failing ``stats()`` (database missing, locked, corrupt) must not fail the
    scrape: Prometheus would then lose the process counters too. It yields
    ``hl7_agent_stats_up 0`` instead, which is what an alert should watch.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats: Callable[[], dict[str, Any]] | None = None

    def bind(self, stats: Callable[[], dict[str, Any]]) -> None:
        with self._lock:
            self._stats = stats

    def describe(self) -> Iterable[Metric]:
        """Names only, so the registry can detect clashes when we register."""
        return list(_families())

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            stats = self._stats
        if stats is None:
            return
        up = GaugeMetricFamily(
            "hl7_agent_stats_up",
            "1 when the queue statistics could be read at this scrape, 0 when not.",
        )
        try:
            families = _families(stats())
            collected = list(families)
        except Exception as exc:  # noqa: BLE001 — any failure means "stats down", never a 500
            log.warning("queue_stats_failed", error=type(exc).__name__)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from collected


class _LogSinkCollector:
    """``hl7_agent_log_lines_dropped_total``, read from the log sink at scrape time.

    The sink belongs to the process (one stderr), so the value is the
    process's; agent.runtime.logs stays free of prometheus-client, and a dropped line
    costs no metric call on the path that drops it.
    """

    def describe(self) -> Iterable[Metric]:
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "hl7_agent_log_lines_dropped",
            "Log lines dropped because stderr did not take them (a stuck journald stream or "
            "log driver); logging never blocks intake.",
            value=logs.lines_dropped(),
        )


def _num(value: Any) -> float:
    """A stats value as a float; ``None`` (no queued message) reads as 0."""
    if value is None:
        return 0.0
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    return float(value)


def _families(data: Mapping[str, Any] | None = None) -> Iterator[GaugeMetricFamily]:
    """The stats gauges; empty families when ``data`` is None (for ``describe``)."""
    depth = GaugeMetricFamily(
        "hl7_agent_queue_depth",
        "Rows waiting or being dispatched, per channel and state (queued/claimed/inflight).",
        labels=["channel", "state"],
    )
    messages = GaugeMetricFamily(
        "hl7_agent_messages",
        "Rows in the queue database by state (all states, every channel).",
        labels=["state"],
    )
    oldest = GaugeMetricFamily(
        "hl7_agent_oldest_queued_age_seconds",
        "Age of the oldest queued row per channel; 0 when nothing is queued.",
        labels=["channel"],
    )
    paused = GaugeMetricFamily(
        "hl7_agent_channel_paused",
        "1 when the channel's durable pause flag is set (dispatch holds, intake goes on).",
        labels=["channel"],
    )
    blocked = GaugeMetricFamily(
        "hl7_agent_partitions_blocked",
        "Keys of a partitioned channel that cannot go on by themselves, by why (retrying/paused);"
        " the other keys go on.",
        labels=["channel", "why"],
    )
    blocked_age = GaugeMetricFamily(
        "hl7_agent_partition_blocked_head_age_seconds",
        "Age of the oldest head among a partitioned channel's blocked keys; 0 when none is blocked.",
        labels=["channel"],
    )
    db_size = GaugeMetricFamily("hl7_agent_db_size_bytes", "Size of the queue database file.")
    wal_size = GaugeMetricFamily(
        "hl7_agent_wal_size_bytes", "Size of the queue database's WAL file."
    )
    if data is not None:
        for state, count in sorted((data.get("states") or {}).items()):
            messages.add_metric([str(state)], _num(count))
        for channel, row in sorted((data.get("channels") or {}).items()):
            for state in DEPTH:  # the backlog states (docs/queue.md#row-states)
                depth.add_metric([str(channel), state], _num(row.get(state)))
            oldest.add_metric([str(channel)], _num(row.get("oldest_queued_age_s")))
            paused.add_metric([str(channel)], _num(bool(row.get("paused"))))
            # Only counts and ages: key values are patient data, never a label.
            keys = row.get("blocked_partitions") or ()
            for why in ("retrying", "paused"):
                blocked.add_metric([str(channel), why], float(sum(1 for b in keys if b["why"] == why)))
            blocked_age.add_metric([str(channel)], max((_num(b.get("head_age_s")) for b in keys), default=0.0))
        db = data.get("db") or {}
        if db.get("size_bytes") is not None:
            db_size.add_metric([], _num(db["size_bytes"]))
        if db.get("wal_bytes") is not None:
            wal_size.add_metric([], _num(db["wal_bytes"]))
    yield from (depth, messages, oldest, paused, blocked, blocked_age, db_size, wal_size)


class _Tally:
    """A labelled counter kept as plain numbers and exported at scrape time, like a prometheus ``Counter``.

    For the counters intake moves once or twice per message: a ``Counter``
    child's ``inc()`` checks and locks through four Python calls; here an
    increment is one dictionary update under a lock. The exposition is the
    same (``<name>_total`` per label set, no ``_created``).
    """

    def __init__(self, name: str, documentation: str, labelnames: list[str], *, registry: CollectorRegistry) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = labelnames
        self._values: dict[tuple[str, ...], float] = {}
        self._lock = threading.Lock()
        registry.register(self)

    def inc(self, labels: tuple[str, ...]) -> None:
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + 1.0

    def describe(self) -> Iterable[Metric]:
        return [CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)]

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)
        with self._lock:
            values = list(self._values.items())
        for labels, value in values:
            family.add_metric(list(labels), value)
        yield family


M = TypeVar("M", Counter, Gauge, Histogram)


class _Labelled(Generic[M]):
    """A metric's labelled children, each built once: ``labels()`` validates and joins its arguments per call."""

    def __init__(self, metric: M) -> None:
        self._metric: M = metric
        self._children: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


class AgentMetrics:
    """Every metric one agent process exposes on ``/metrics``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self._received = _Tally(
            "hl7_agent_messages_received",
            "Frames with a readable MSH that arrived.",
            ["channel"],
            registry=r,
        )
        self._committed = _Tally(
            "hl7_agent_messages_committed",
            "Messages committed to the queue and answered with an accept ACK.",
            ["channel"],
            registry=r,
        )
        self._rejected = _Tally(
            "hl7_agent_messages_rejected",
            "Non-accept ACKs sent at intake, by MSA-1 code (AE/AR/CE/CR).",
            ["channel", "code"],
            registry=r,
        )
        self._settled = Counter(
            "hl7_agent_messages_settled",
            "Rows settled by the upstream answer (processed/rejected/failed).",
            ["channel", "state"],
            registry=r,
        )
        self._latency = Histogram(
            "hl7_agent_dispatch_latency_seconds",
            "Time from writing a transmit to receiving its transmit_response.",
            ["channel"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._upstream = Gauge(
            "hl7_agent_upstream_connected",
            "1 while the WebSocket to the server is open and welcomed.",
            registry=r,
        )
        self._lease = Gauge(
            "hl7_agent_lease_held",
            "1 while this process holds the dispatch lease.",
            registry=r,
        )
        self._connections = Gauge(
            "hl7_agent_connections_open",
            "Sender connections open on each channel.",
            ["channel"],
            registry=r,
        )
        self._refused = Counter(
            "hl7_agent_connections_refused",
            "Connections closed at once: the channel or the source at its limit with every "
            "connection busy, or a source not allowed.",
            ["channel", "reason"],
            registry=r,
        )
        self._evicted = Counter(
            "hl7_agent_connections_evicted",
            "Idle connections closed to admit a newcomer (channel or source at its limit).",
            ["channel"],
            registry=r,
        )
        self._timed_out = Counter(
            "hl7_agent_connections_timed_out",
            "Connections closed by frame_timeout (a started frame did not complete, or the sender read no ACK: "
            "timeout=write) or idle_timeout.",
            ["channel", "timeout"],
            registry=r,
        )
        self._audit_not_stored = Counter(
            "hl7_agent_audit_rows_not_stored",
            "Rejected or unparseable frames only counted, not kept as audit rows "
            "(over the per-connection limit per minute).",
            ["channel"],
            registry=r,
        )
        # Intake's connection gauge and audit counter: their children by label.
        self._connections_by = _Labelled(self._connections)
        # once per delivered message: the children looked up, not built by labels() each time
        self._settled_by = _Labelled(self._settled)
        self._latency_by = _Labelled(self._latency)
        self._audit_not_stored_by = _Labelled(self._audit_not_stored)
        self._outbound_connected = Gauge(
            "hl7_agent_outbound_connected",
            "1 while an outbound channel (connect) holds its connection to the sender, 0 while it reconnects.",
            ["channel"],
            registry=r,
        )
        self._outbound_attempts = Counter(
            "hl7_agent_outbound_connect_attempts",
            "Connection attempts of outbound channels to their senders, by result (connected or failed).",
            ["channel", "result"],
            registry=r,
        )
        self._info = Gauge(
            "hl7_agent_info",
            "Constant 1, labelled with this process's version and agent id.",
            ["version", "agent_id"],
            registry=r,
        )
        self._info_lock = threading.Lock()
        #: The last hour per minute, for the status page's plots (not exported).
        self.history = MinuteHistory()
        self._stats = _QueueStatsCollector()
        r.register(self._stats)
        r.register(_LogSinkCollector())
        self.set_info(agent_id="", version=__version__)

    # -- identity ---------------------------------------------------------

    def set_info(self, *, agent_id: str, version: str) -> None:
        """Label ``hl7_agent_info``; replaces the previous labels (one series only)."""
        with self._info_lock:
            self._info.clear()
            self._info.labels(version=version, agent_id=agent_id).set(1)

    # -- events -----------------------------------------------------------

    def message_received(self, channel: str) -> None:
        """A frame with an MSH arrived on ``channel``."""
        self._received.inc((channel,))

    def message_committed(self, channel: str) -> None:
        """A row was committed and its accept ACK sent."""
        self._committed.inc((channel,))
        self.history.count_in()

    def message_rejected(self, channel: str, code: str) -> None:
        """A non-accept ACK was sent at intake (``code`` is MSA-1: AE/AR/CE/CR)."""
        self._rejected.inc((channel, code))

    def message_settled(self, channel: str, state: str) -> None:
        """A row reached ``processed``/``rejected``/``failed`` from upstream's answer."""
        self._settled_by(channel, state).inc()
        self.history.count_out()

    def observe_dispatch_latency(self, channel: str, seconds: float) -> None:
        """Transmit written → transmit_response received, in seconds."""
        self._latency_by(channel).observe(seconds)

    def connection_opened(self, channel: str) -> None:
        self._connections_by(channel).inc()

    def connection_closed(self, channel: str) -> None:
        self._connections_by(channel).dec()

    def connection_refused(self, channel: str, reason: str) -> None:
        """A newcomer was closed at once (``busy``, ``source_busy``, ``source_not_allowed``)."""
        self._refused.labels(channel=channel, reason=reason).inc()

    def connection_evicted(self, channel: str) -> None:
        """An idle connection was closed to make room for a newcomer."""
        self._evicted.labels(channel=channel).inc()

    def connection_timed_out(self, channel: str, timeout: str) -> None:
        """``timeout`` is ``frame`` (frame_timeout) or ``idle`` (idle_timeout)."""
        self._timed_out.labels(channel=channel, timeout=timeout).inc()

    def audit_row_not_stored(self, channel: str) -> None:
        """A rejected or unparseable frame over the audit-row limit: counted, not stored (once per junk frame)."""
        self._audit_not_stored_by(channel).inc()

    def outbound_attempt(self, channel: str, connected: bool) -> None:
        """An outbound channel dialled its sender: it connected, or it failed (and will back off)."""
        self._outbound_attempts.labels(channel=channel, result="connected" if connected else "error").inc()
        if connected:
            self._outbound_connected.labels(channel=channel).set(1)

    def set_outbound_connected(self, channel: str, up: bool) -> None:
        self._outbound_connected.labels(channel=channel).set(1 if up else 0)

    def set_upstream_connected(self, up: bool) -> None:
        self._upstream.set(1 if up else 0)

    def set_lease_held(self, held: bool) -> None:
        self._lease.set(1 if held else 0)

    # -- scrape-time queue gauges ----------------------------------------

    def bind_stats(self, stats: Callable[[], dict[str, Any]]) -> None:
        """Read queue gauges from ``stats()`` (the ``queue stats --json`` shape) at every scrape.

        ``stats`` runs on the scraping thread (the admin server's), never on
        the event loop; it opens its own read-only connection.
        """
        self._stats.bind(stats)

    # -- exposition -------------------------------------------------------

    def exposition_for(self, accept: str | None) -> tuple[bytes, str]:
        """Body and Content-Type negotiated from a scraper's Accept header.

        prometheus-client's own negotiation: OpenMetrics when the scraper asks
        for it (Prometheus does), else the classic text format with the content
        type that matches it.
        """
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type

"""The status assessment: each channel's state from the facts, truthful in every combination."""

from __future__ import annotations

from typing import Any

import pytest

from agent.core.status import STALL_S, ChannelState, Level, UpstreamState, assess

NOW = 1_750_000_000.0


def counts(queued: int = 0, claimed: int = 0, inflight: int = 0, oldest: float | None = None,
           paused: bool = False) -> dict[str, Any]:
    return {"queued": queued, "claimed": claimed, "inflight": inflight,
            "oldest_queued_age_s": oldest, "paused": paused}


def head(state: str = "queued", attempts: int = 0, redrive_base: int = 0, due_in: float = 0.0,
         error_code: str | None = None, error_text: str | None = None) -> dict[str, Any]:
    return {"id": "0b7c5d1e-aaaa", "seq": 4, "state": state, "attempts": attempts,
            "redrive_base": redrive_base, "next_attempt_at": NOW + due_in, "server_status": None,
            "error_code": error_code, "error_text": error_text, "received_at": NOW - 71,
            "updated_at": NOW - 1}


def activity(name: str = "adt", the_head: dict[str, Any] | None = None, *, last_in: float | None = None,
             last_out: float | None = None, out_state: str = "processed", paused_at: float | None = None,
             reason: str | None = None) -> dict[str, Any]:
    return {
        "channel": name, "head": the_head, "last_received_at": last_in,
        "last_settled": None if last_out is None else {"state": out_state, "settled_at": last_out},
        "paused": paused_at is not None, "paused_at": paused_at, "paused_reason": reason,
    }


LEASE_HERE = {"holder": "edge-01:4242", "epoch": 3, "expires_at": "2025-06-15T15:07:00Z"}


def run(channel_counts: dict[str, Any], act: dict[str, Any] | None, *, connected: bool = True,
        configured: bool = True, lease_held: bool = True, lease: dict[str, Any] | None = LEASE_HERE,
        since: float = NOW - 185, last_error: str | None = None) -> dict[str, Any]:
    stats = {"channels": {"adt": channel_counts}, "lease": lease}
    upstream = {"configured": configured, "connected": connected, "url": "ws://x/agent" if configured else None,
                "replay": True, "last_error": last_error, "since": since}
    return assess(stats=stats, activity=[act] if act else [], upstream=upstream, lease_held=lease_held,
                  listeners_up=True, now=NOW)


def channel(result: dict[str, Any]) -> dict[str, Any]:
    (only,) = result["channels"]
    return only


class TestChannelStates:
    def test_empty_healthy_channel_is_idle(self) -> None:
        """No rows, upstream up: idle, green, and the summary says all is well."""
        result = run(counts(), activity())
        c = channel(result)
        assert (c["state"], c["level"]) == (ChannelState.IDLE, Level.OK)
        assert result["level"] == Level.OK and result["summary"] == "all 1 channel flowing or idle"

    def test_rows_moving_is_flowing(self) -> None:
        """Rows waiting with a fresh head and a session up: flowing, with the depth."""
        c = channel(run(counts(queued=3, inflight=1, oldest=2.0), activity(the_head=head("inflight", 1),
                                                                            last_in=NOW - 1, last_out=NOW - 3)))
        assert (c["state"], c["level"], c["depth"]) == (ChannelState.FLOWING, Level.OK, 4)
        assert c["text"] == "flowing — 4 waiting"
        assert c["last_received_age_s"] == 1 and c["last_settled_age_s"] == 3
        assert c["last_settled_state"] == "processed"

    def test_head_retrying_a_503_forever_is_retrying_not_green(self) -> None:
        """The issue's case: head retrying, 13 rows behind, oldest 1m 11s — amber, with the facts."""
        the_head = head("queued", attempts=7, due_in=4.2, error_code="503",
                        error_text="transient status 503; retry in 1.0s")
        result = run(counts(queued=14, oldest=71.0), activity(the_head=the_head))
        c = channel(result)
        assert (c["state"], c["level"]) == (ChannelState.RETRYING, Level.WARN)
        assert c["attempt"] == 7 and c["next_try_in_s"] == 4.2 and c["waiting_behind"] == 13
        assert c["last_error"] == "transient status 503"  # the live next try replaces the old note
        assert c["text"] == "retrying — attempt 7 failed, next try in 4s"
        assert "13 waiting behind it (delivery is in order)" in c["detail"]
        assert any("queue fail 0b7c5d1e-aaaa" in d for d in c["detail"])
        assert result["level"] == Level.WARN and result["summary"] == "adt retrying"

    def test_retry_in_flight_has_no_next_try(self) -> None:
        """The head sent again after a failure: still retrying, attempt n, no countdown."""
        c = channel(run(counts(inflight=1), activity(the_head=head("inflight", attempts=3, error_code="503",
                                                                     error_text="transient status 503"))))
        assert c["state"] == ChannelState.RETRYING and c["next_try_in_s"] is None and c["attempt"] == 3
        assert c["text"] == "retrying — attempt 3 sent, the one before failed"

    def test_a_redriven_head_is_not_retrying(self) -> None:
        """After `queue retry` the old error is history (attempts == redrive_base): flowing."""
        the_head = head("queued", attempts=5, redrive_base=5, error_code="422", error_text="rejected")
        c = channel(run(counts(queued=1, oldest=1.0), activity(the_head=the_head)))
        assert c["state"] == ChannelState.FLOWING

    def test_paused_without_rows_is_paused_by_whom_since_when(self) -> None:
        """Paused and empty: amber `paused`, naming who paused it and for how long."""
        c = channel(run(counts(paused=True), activity(paused_at=NOW - 192, reason="operator (alice)")))
        assert (c["state"], c["level"]) == (ChannelState.PAUSED, Level.WARN)
        assert c["paused_reason"] == "operator (alice)" and c["paused_for_s"] == 192
        assert c["detail"][0] == "paused by operator (alice) for 3m 12s; `hl7-agent channel resume adt` resumes it"

    def test_paused_with_rows_waiting_is_blocked_by_the_pause(self) -> None:
        """Rows behind a pause cannot move: red `blocked`, by the pause."""
        c = channel(run(counts(queued=2, oldest=30.0, paused=True),
                        activity(the_head=head(), paused_at=NOW - 5, reason="rejected row 1 (status 422)")))
        assert (c["state"], c["level"], c["blocked_by"]) == (ChannelState.BLOCKED, Level.BAD, "pause")
        assert c["text"] == "blocked: channel paused — 2 waiting"

    @pytest.mark.parametrize("depth", [0, 5])
    def test_upstream_down_is_red_whatever_the_queue_says(self, depth: int) -> None:
        """Holding the lease without a session: every channel red `upstream down`, empty or not."""
        result = run(counts(queued=depth, oldest=1.0 if depth else None),
                     activity(the_head=head() if depth else None), connected=False,
                     last_error="ConnectionRefusedError: [Errno 111] Connection refused")
        c = channel(result)
        assert (c["state"], c["level"]) == (ChannelState.UPSTREAM_DOWN, Level.BAD)
        assert bool(c["detail"]) == bool(depth)  # rows waiting: where they are and when they go
        up = result["upstream"]
        assert (up["state"], up["level"], up["for_s"]) == (UpstreamState.DOWN, Level.BAD, 185)
        assert up["text"] == "down for 3m 5s" and up["since"] == "2025-06-15T15:03:35Z"
        assert result["level"] == Level.BAD
        assert result["summary"].startswith("upstream down for 3m 5s — ")

    def test_upstream_down_does_not_hide_a_pause(self) -> None:
        """A paused channel says so even while the upstream is down (the summary names both)."""
        result = run(counts(paused=True), activity(paused_at=NOW - 1, reason="operator (bob)"), connected=False)
        assert channel(result)["state"] == ChannelState.PAUSED
        assert "upstream down" in result["summary"] and "adt paused" in result["summary"]

    def test_no_upstream_configured(self) -> None:
        """Intake only: empty is idle, rows waiting are blocked by the missing upstream."""
        idle = channel(run(counts(), activity(), configured=False, connected=False))
        assert idle["state"] == ChannelState.IDLE
        held = channel(run(counts(queued=3, oldest=5.0), activity(the_head=head()), configured=False,
                           connected=False))
        assert (held["state"], held["blocked_by"]) == (ChannelState.BLOCKED, "no upstream")

    def test_no_lease_holder_with_rows_is_blocked(self) -> None:
        """Nobody holds the lease: rows cannot go."""
        result = run(counts(queued=1, oldest=1.0), activity(the_head=head()), connected=False,
                     lease_held=False, lease=None)
        c = channel(result)
        assert (c["state"], c["blocked_by"]) == (ChannelState.BLOCKED, "no lease")
        assert result["upstream"]["state"] == UpstreamState.NO_LEASE
        assert result["lease"]["text"] == "no holder: nothing is dispatched"

    def test_standby_process_trusts_the_database(self) -> None:
        """Another process holds the lease: upstream grey `standby`, channel from the rows."""
        other = {"holder": "edge-01:777", "epoch": 9, "expires_at": "x"}
        result = run(counts(queued=2, oldest=3.0), activity(the_head=head(), last_out=NOW - 1),
                     connected=False, lease_held=False, lease=other)
        assert (result["upstream"]["state"], result["upstream"]["level"]) == (UpstreamState.STANDBY, Level.MUTE)
        assert channel(result)["state"] == ChannelState.FLOWING
        assert result["lease"]["text"] == "held by edge-01:777, another process (epoch 9)"
        assert result["level"] == Level.OK

    def test_a_due_head_that_does_not_move_is_blocked(self) -> None:
        """Queued, due, nothing delivered for STALL_S: blocked (its dispatcher is stuck or elsewhere)."""
        other = {"holder": "edge-01:777", "epoch": 9, "expires_at": "x"}
        c = channel(run(counts(queued=2, oldest=STALL_S + 10), activity(the_head=head(), last_out=NOW - 500),
                        connected=False, lease_held=False, lease=other))
        assert (c["state"], c["blocked_by"]) == (ChannelState.BLOCKED, "no progress")
        assert "another process dispatches: see its status page or log" in c["detail"]

    def test_a_slow_answer_in_flight_is_not_blocked(self) -> None:
        """An inflight head waits for the server's answer: flowing, however old."""
        c = channel(run(counts(inflight=1, oldest=None), activity(the_head=head("inflight", 1),
                                                                   last_out=NOW - 900)))
        assert c["state"] == ChannelState.FLOWING


class TestDegradedFacts:
    def test_nothing_readable(self) -> None:
        """No stats, no activity, no upstream: the summary says the queue is unreadable, red."""
        result = assess(stats=None, activity=None, upstream=None, lease_held=None, listeners_up=None, now=NOW)
        assert result["level"] == Level.BAD and result["channels"] == []
        assert result["upstream"]["state"] == UpstreamState.UNKNOWN
        assert "queue unreadable" in result["summary"] and result["lease"]["text"] == "unknown"

    def test_listeners_down_is_red(self) -> None:
        """Intake not listening is named first and makes the whole page red."""
        result = assess(stats={"channels": {"adt": counts()}, "lease": LEASE_HERE}, activity=[],
                        upstream={"configured": True, "connected": True, "since": NOW}, lease_held=True,
                        listeners_up=False, now=NOW)
        assert result["level"] == Level.BAD and result["summary"] == "intake not listening"

    def test_activity_missing_uses_the_counts(self) -> None:
        """Without the store's activity a channel with rows is still flowing, not invented trouble."""
        result = assess(stats={"channels": {"adt": counts(queued=2, oldest=1.0)}, "lease": LEASE_HERE},
                        activity=None, upstream={"configured": True, "connected": True, "since": NOW},
                        lease_held=True, listeners_up=True, now=NOW)
        assert channel(result)["state"] == ChannelState.FLOWING and channel(result)["head_id"] is None

    def test_rfc3339_since_is_read(self) -> None:
        """``since`` may come as RFC 3339 text (as /status.json carries it)."""
        result = assess(stats={"channels": {}, "lease": LEASE_HERE}, activity=[],
                        upstream={"configured": True, "connected": True, "since": "2025-06-15T15:06:00Z"},
                        lease_held=True, listeners_up=True, now=NOW)
        assert result["upstream"]["for_s"] == 40 and result["summary"] == "no channels"


class TestOutboundChannels:
    """An outbound channel (connect) adds its connection to the sender to the channel's facts."""

    def assess_with(self, state: str, error: str | None = None) -> dict[str, Any]:
        stats = {"channels": {"ref": counts()}, "lease": LEASE_HERE}
        upstream = {"configured": True, "connected": True, "url": "ws://x/agent", "replay": True,
                    "last_error": None, "since": NOW - 60}
        outbound = {"ref": {"connect": "lis.example:6661", "state": state, "since": NOW - 125,
                            "last_error": error, "tls": False}}
        return assess(stats=stats, activity=[], upstream=upstream, lease_held=True, listeners_up=True, now=NOW,
                      outbound=outbound)

    def test_connected_is_a_fact_not_a_problem(self) -> None:
        result = self.assess_with("connected")
        c = channel(result)
        assert c["detail"][0] == "connected to the sender at lis.example:6661 for 2m 5s"
        assert result["level"] == Level.OK and c["outbound"]["state"] == "connected"

    def test_reconnecting_warns_and_names_the_error(self) -> None:
        result = self.assess_with("reconnecting", "connection refused")
        assert result["level"] == Level.WARN
        assert result["summary"] == ("ref reconnecting to the sender at lis.example:6661 for 2m 5s "
                                     "(last error: connection refused)")

"""The status page's per-minute history: bounded, per minute, in and out and depth."""

from __future__ import annotations

from agent.runtime.history import MinuteHistory
from agent.runtime.metrics import AgentMetrics


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


T0 = 1_750_000_040.0  # 15:07:20 UTC, 20 s into a minute


class TestMinuteHistory:
    def test_counts_land_in_their_minute(self) -> None:
        """In and out are summed per minute; the current minute is the last element."""
        clock = Clock(T0)
        history = MinuteHistory(minutes=5, clock=clock)
        history.count_in(3)
        history.count_out()
        clock.now += 60
        history.count_in()
        history.note_depth(7)
        history.note_depth(4)  # the minute keeps its last sample
        series = history.series()
        assert series["in"] == [0, 0, 0, 3, 1]
        assert series["out"] == [0, 0, 0, 1, 0]
        assert series["depth"] == [None, None, None, None, 4]
        assert series["minute_s"] == 60
        assert series["start"] == "2025-06-15T15:04:00Z"  # four minutes before the current one
        assert series["counted_since"] == "2025-06-15T15:07:20Z"

    def test_old_minutes_fall_out_and_memory_stays_bounded(self) -> None:
        """After a day of traffic only the window's minutes are held."""
        clock = Clock(T0)
        history = MinuteHistory(minutes=60, clock=clock)
        for _ in range(24 * 60):
            history.count_in()
            history.note_depth(1)
            clock.now += 60
        assert len(history._buckets) <= 61
        series = history.series()
        assert len(series["in"]) == 60 and series["in"][0] == 1 and series["in"][-1] == 0
        assert series["depth"][:-1] == [1] * 59 and series["depth"][-1] is None

    def test_an_idle_hour_reads_as_zeros(self) -> None:
        """Nothing counted for longer than the window: all zeros, no stale bucket shown."""
        clock = Clock(T0)
        history = MinuteHistory(minutes=3, clock=clock)
        history.count_in(9)
        clock.now += 3600
        assert history.series()["in"] == [0, 0, 0]


class TestMetricsFeedTheHistory:
    def test_committed_and_settled_are_counted(self) -> None:
        """message_committed counts in, message_settled counts out, whatever the channel or state."""
        metrics = AgentMetrics()
        metrics.message_committed("adt")
        metrics.message_committed("lab")
        metrics.message_settled("adt", "processed")
        metrics.message_settled("adt", "failed")
        metrics.message_received("adt")  # a frame that arrived is not yet "in"
        series = metrics.history.series()
        assert series["in"][-1] == 2 and series["out"][-1] == 2
        assert sum(series["in"]) == 2 and sum(series["out"]) == 2

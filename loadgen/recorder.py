"""Where load loops record what they measure: totals, a per-second timeline, open-loop extras.

A :class:`Recorder` is created by whoever runs a loop (the CLI, a benchmark, a test) and passed
in; the loop records into it, and a progress display may read it at the same time (same event
loop, so no locking).  :class:`Timeline` keeps one small histogram per second of
measurement (a :class:`~loadgen.stats.LatencyHistogram` at 2 significant figures), by completion
time, so reports can plot P50/P99 over time and the progress line can show the last second's P99.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loadgen.stats import LatencyHistogram, RequestStats

__all__ = ["Recorder", "Timeline", "TimelineRow"]


@dataclass(frozen=True, slots=True)
class TimelineRow:
    """One interval of a :class:`Timeline`; latencies in ms (``None`` without a 2xx)."""

    t: float  # interval start, seconds from the start of measurement
    requests: int
    ok: int
    errors: int
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "t": self.t,
            "requests": self.requests,
            "ok": self.ok,
            "errors": self.errors,
            "p50_ms": self.p50_ms,
            "p99_ms": self.p99_ms,
            "max_ms": self.max_ms,
        }


class _Interval:
    __slots__ = ("errors", "hist")

    def __init__(self) -> None:
        self.errors = 0
        # 2 significant figures and 4-byte counts: ~18 KiB per second of a run, 1 % precision.
        self.hist = LatencyHistogram(significant_figures=2, word_size=4)


class Timeline:
    """Outcomes per ``interval_s`` by completion time, counted from :attr:`start`."""

    __slots__ = ("_intervals", "interval_s", "start")

    def __init__(self, start: float = 0.0, interval_s: float = 1.0) -> None:
        if not interval_s > 0:
            raise ValueError("interval_s must be positive")
        self.start = start
        self.interval_s = interval_s
        self._intervals: list[_Interval] = []

    def _at(self, end: float) -> _Interval:
        i = int((end - self.start) / self.interval_s)
        if i < 0:
            i = 0
        intervals = self._intervals
        while len(intervals) <= i:
            intervals.append(_Interval())
        return intervals[i]

    def record(self, end: float, seconds: float, ok: bool) -> None:
        iv = self._at(end)
        if ok:
            iv.hist.record(seconds)
        else:
            iv.errors += 1

    def __len__(self) -> int:
        return len(self._intervals)

    def row(self, i: int) -> TimelineRow:
        iv = self._intervals[i]
        hist = iv.hist
        ok = hist.count
        p = hist.percentiles((50, 99))
        return TimelineRow(
            t=i * self.interval_s,
            requests=ok + iv.errors,
            ok=ok,
            errors=iv.errors,
            p50_ms=p[50] * 1e3 if ok else None,
            p99_ms=p[99] * 1e3 if ok else None,
            max_ms=hist.max * 1e3 if ok else None,
        )

    def rows(self) -> list[TimelineRow]:
        return [self.row(i) for i in range(len(self._intervals))]

    def last_complete(self, now: float) -> TimelineRow | None:
        """The most recent interval that ended at or before ``now`` (``None`` if none has)."""
        i = int((now - self.start) / self.interval_s) - 1
        if i < 0:
            return None
        if i >= len(self._intervals):
            return TimelineRow(i * self.interval_s, 0, 0, 0, None, None, None)
        return self.row(i)


class Recorder:
    """What one run measured, as it happens.

    Loops call :meth:`begin` once connections are open, then :meth:`record` /
    :meth:`record_error` for each measured request (warm-up requests only bump
    :attr:`warmup_done`).  Open loops also fill :attr:`send_lag` (how late each request was
    written after its intended time) and :attr:`service` (2xx latency from the actual write, the
    figure a closed loop would report), and keep :attr:`in_flight`, :attr:`backlog` (intended
    sends waiting for a free connection) and :attr:`connections` current for progress displays.
    """

    def __init__(self, interval_s: float = 1.0) -> None:
        self.stats = RequestStats()
        self.timeline = Timeline(interval_s=interval_s)
        self.send_lag = LatencyHistogram()
        self.service = LatencyHistogram()
        self.warmup_done = 0
        self.started_at: float | None = None
        self.measure_start: float | None = None
        self.measure_end: float | None = None
        self.target_rps: float | None = None
        self.in_flight = 0
        self.backlog = 0
        self.connections = 0
        self.peak_connections = 0
        self.finished = False

    def begin(self, now: float, warmup_s: float, duration_s: float) -> None:
        """The run starts at ``now``: warm-up until ``now + warmup_s``, then measurement."""
        self.started_at = now
        self.set_window(now + warmup_s, duration_s)

    def set_window(self, measure_start: float, duration_s: float) -> None:
        self.measure_start = measure_start
        self.measure_end = measure_start + duration_s
        self.timeline.start = measure_start

    def record(self, status: int, seconds: float, end: float) -> None:
        self.stats.record(status, seconds)
        self.timeline.record(end, seconds, 200 <= status < 300)

    def record_error(self, kind: str | BaseException, end: float) -> None:
        self.stats.record_error(kind)
        self.timeline.record(end, 0.0, False)

    def opened_connection(self) -> None:
        self.connections += 1
        if self.connections > self.peak_connections:
            self.peak_connections = self.connections

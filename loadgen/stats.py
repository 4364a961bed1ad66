"""Latency histograms and per-request outcome counters.

:class:`LatencyHistogram` is an HdrHistogram (the ``hdrhistogram`` package, the Python port of
the HdrHistogram family that wrk2, Gatling and the JVM tools use) over whole nanoseconds up to one
hour, with the exact count, sum, minimum and maximum kept beside it: HDR buckets only bound a
value, and a report's ``max`` and ``mean`` should be the real ones. Everything in loadgen that
computes a percentile goes through this class: totals, the per-second timeline and the progress
line. Histograms are exchanged (``--json``, merging across processes) in HdrHistogram's standard
compressed form, which other HdrHistogram tools read.

:class:`RequestStats` adds counting by HTTP status and by exception type; load loops record into
it and results merge it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

from hdrh.histogram import HdrHistogram

__all__ = ["HIGHEST_NS", "LatencyHistogram", "RequestStats"]

#: Largest latency told apart from others (one hour); longer ones count as one hour, while
#: :attr:`LatencyHistogram.max` stays exact.
HIGHEST_NS = 3_600 * 10**9
#: Totals keep 3 significant figures: every bucket is narrower than 1/1024 of its values.
TOTAL_FIGURES = 3


class LatencyHistogram:
    """Latencies in seconds, recorded into an HdrHistogram of nanoseconds.

    ``significant_figures`` trades precision for memory: 3 (the default, ~270 KiB) for a run's
    totals, 2 (~18 KiB with 4-byte counts) for each second of a timeline.
    """

    __slots__ = ("_hdr", "count", "max", "min", "total")

    def __init__(self, significant_figures: int = TOTAL_FIGURES, word_size: int = 8) -> None:
        self._hdr = HdrHistogram(1, HIGHEST_NS, significant_figures, word_size=word_size)
        self.count = 0
        self.total = 0.0
        self.max = 0.0
        self.min = math.inf

    @property
    def relative_precision(self) -> float:
        """Worst-case relative error of :meth:`percentile` (one bucket's width)."""
        return 1 / int(self._hdr.sub_bucket_half_count)

    def record(self, seconds: float) -> None:
        """Add one value (seconds; negatives, from clock oddities, count as 0)."""
        if seconds < 0:
            seconds = 0.0
        self._hdr.record_value(min(int(seconds * 1e9), HIGHEST_NS))
        self.count += 1
        self.total += seconds
        if seconds > self.max:
            self.max = seconds
        if seconds < self.min:
            self.min = seconds

    def merge(self, other: LatencyHistogram) -> None:
        """Add ``other``'s values into this histogram."""
        if other.count == 0:
            return
        self._hdr.add(other._hdr)
        self.count += other.count
        self.total += other.total
        self.max = max(self.max, other.max)
        self.min = min(self.min, other.min)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def _clamped(self, ns: int) -> float:
        # A bucket's bound may lie outside what was recorded; the exact extremes are known.
        return min(max(ns / 1e9, self.min), self.max)

    def percentile(self, p: float) -> float:
        """The value (seconds) at percentile ``p`` in [0, 100], to the histogram's precision;
        ``percentile(100)`` is the exact maximum; an empty histogram gives 0.0."""
        if not 0 <= p <= 100:
            raise ValueError(f"percentile must be within [0, 100], got {p}")
        if self.count == 0:
            return 0.0
        if p >= 100:
            return self.max
        return self._clamped(self._hdr.get_value_at_percentile(p))

    def percentiles(self, ps: Iterable[float]) -> dict[float, float]:
        """Several percentiles in one pass, as {p: seconds}."""
        wanted = sorted(set(ps))
        if any(not 0 <= p <= 100 for p in wanted):
            raise ValueError(f"percentiles must be within [0, 100], got {wanted}")
        if self.count == 0:
            return dict.fromkeys(wanted, 0.0)
        values = self._hdr.get_percentile_to_value_dict(wanted)
        return {p: self.max if p >= 100 else self._clamped(values[p]) for p in wanted}

    def buckets(self) -> Iterator[tuple[float, float, int]]:
        """Non-empty buckets as (low_seconds, high_seconds, count), ascending."""
        hdr = self._hdr
        for item in hdr.get_recorded_iterator():
            high = item.value_iterated_to
            low = hdr.get_lowest_equivalent_value(high)
            yield low / 1e9, (high + 1) / 1e9, item.count_at_value_iterated_to

    # Exchange, for merging histograms across processes -----------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form: the exact figures plus ``hdr``, the HdrHistogram's standard
        compressed (base64) encoding; :meth:`from_dict` restores it."""
        return {
            "count": self.count,
            "total": self.total,
            "max": self.max,
            "min": self.min if self.count else None,
            "hdr": self._hdr.encode().decode("ascii"),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LatencyHistogram:
        decoded = HdrHistogram.decode(data["hdr"].encode("ascii"))
        h = cls(decoded.significant_figures)
        if data["count"]:
            h._hdr.add(decoded)
        h.count = int(data["count"])
        h.total = float(data["total"])
        h.max = float(data["max"])
        h.min = math.inf if data["min"] is None else float(data["min"])
        return h

    def __repr__(self) -> str:
        if not self.count:
            return "LatencyHistogram(count=0)"
        return (
            f"LatencyHistogram(count={self.count}, p50={self.percentile(50) * 1e3:.3f}ms, "
            f"p99={self.percentile(99) * 1e3:.3f}ms, max={self.max * 1e3:.3f}ms)"
        )


class RequestStats:
    """Outcomes of a run: latency of successful (2xx) responses, counts by status and error.

    * :meth:`record` — a response arrived: counted under its status; 2xx latencies go into
      :attr:`latency`, others into :attr:`error_latency`;
    * :meth:`record_error` — no response (timeout, connection error...): counted by a short
      name, normally the exception's class name.
    """

    __slots__ = ("error_latency", "exceptions", "latency", "statuses")

    def __init__(self) -> None:
        self.latency = LatencyHistogram()
        self.error_latency = LatencyHistogram()
        self.statuses: Counter[int] = Counter()
        self.exceptions: Counter[str] = Counter()

    def record(self, status: int, seconds: float) -> None:
        self.statuses[status] += 1
        if 200 <= status < 300:
            self.latency.record(seconds)
        else:
            self.error_latency.record(seconds)

    def record_error(self, kind: str | BaseException) -> None:
        if isinstance(kind, BaseException):
            kind = type(kind).__name__
        self.exceptions[kind] += 1

    def merge(self, other: RequestStats) -> None:
        self.latency.merge(other.latency)
        self.error_latency.merge(other.error_latency)
        self.statuses.update(other.statuses)
        self.exceptions.update(other.exceptions)

    @property
    def ok(self) -> int:
        """Responses with a 2xx status."""
        return self.latency.count

    @property
    def responses(self) -> int:
        return self.latency.count + self.error_latency.count

    @property
    def total(self) -> int:
        """Every recorded request: responses of any status plus exceptions."""
        return self.responses + sum(self.exceptions.values())

    @property
    def errors(self) -> dict[str, int]:
        """Failed requests: non-2xx by status code (as a string) and exceptions by name."""
        out = {str(s): n for s, n in sorted(self.statuses.items()) if not 200 <= s < 300}
        for name, n in sorted(self.exceptions.items()):
            out[name] = out.get(name, 0) + n
        return out

    @property
    def error_count(self) -> int:
        return self.total - self.ok

    def to_dict(self) -> dict[str, Any]:
        return {
            "latency": self.latency.to_dict(),
            "error_latency": self.error_latency.to_dict(),
            "statuses": {str(k): v for k, v in self.statuses.items()},
            "exceptions": dict(self.exceptions),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestStats:
        s = cls()
        s.latency = LatencyHistogram.from_dict(data["latency"])
        s.error_latency = LatencyHistogram.from_dict(data["error_latency"])
        s.statuses = Counter({int(k): int(v) for k, v in data["statuses"].items()})
        s.exceptions = Counter({str(k): int(v) for k, v in data["exceptions"].items()})
        return s

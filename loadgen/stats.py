"""Latency histogram and per-request outcome counters (pure Python, O(1) recording).

:class:`LatencyHistogram` is HdrHistogram's log-linear layout over integer nanoseconds with 128
sub-buckets per power of two: values below 256 ns are exact, every larger bucket spans less than
1/128 of its lower bound, and a bucket reports its midpoint, so a percentile is within ~0.4% of the
true sample (plus 1 ns of truncation).  Values up to 2**40 ns (~18 minutes) have their own bucket;
larger ones are clamped into the last bucket, while :attr:`LatencyHistogram.max` stays exact.
4,352 buckets in all, held in one list of ints; recording is a handful of integer operations.

:class:`RequestStats` adds counting by HTTP status and by exception type, and is what load loops
(closed loop now, open loop later) record into and merge across workers or processes.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["LatencyHistogram", "RequestStats", "bucket_bounds", "bucket_index", "bucket_value"]

_SUB_BITS = 7  # 128 sub-buckets per half-octave: relative bucket width < 1/128
_SUB_COUNT = 1 << (_SUB_BITS + 1)  # 256: values below this are exact
_MAX_BITS = 40  # highest distinguishable value: 2**40 - 1 ns
_MAX_VALUE = (1 << _MAX_BITS) - 1
_N_BUCKETS = ((_MAX_BITS - _SUB_BITS - 1) << _SUB_BITS) + _SUB_COUNT


def _index(ns: int) -> int:
    shift = ns.bit_length() - _SUB_BITS - 1
    if shift <= 0:
        return ns
    return (shift << _SUB_BITS) + (ns >> shift)


def _bounds(index: int) -> tuple[int, int]:
    """[low, high) in nanoseconds of bucket ``index``."""
    if index < _SUB_COUNT:
        return index, index + 1
    shift = (index >> _SUB_BITS) - 1
    sub = index - (shift << _SUB_BITS)
    return sub << shift, (sub + 1) << shift


def bucket_index(seconds: float) -> int:
    """The histogram bucket of a value in seconds (negatives count as 0, huge ones clamp)."""
    ns = int(seconds * 1e9)
    return _index(min(max(ns, 0), _MAX_VALUE))


def bucket_bounds(index: int) -> tuple[float, float]:
    """[low, high) in seconds of bucket ``index``."""
    low, high = _bounds(index)
    return low / 1e9, high / 1e9


def bucket_value(index: int) -> float:
    """The value (seconds) a bucket reports: its midpoint, or its exact value when 1 ns wide."""
    low, high = _bounds(index)
    return (low + high) / 2e9 if high - low > 1 else low / 1e9


class LatencyHistogram:
    """Log-linear latency histogram; values in seconds, ~0.4% relative precision."""

    __slots__ = ("_counts", "count", "max", "min", "total")

    #: Worst-case relative error of :meth:`percentile` (half a bucket), excluding 1 ns truncation.
    RELATIVE_PRECISION = 1 / (2 << _SUB_BITS)

    def __init__(self) -> None:
        self._counts = [0] * _N_BUCKETS
        self.count = 0
        self.total = 0.0
        self.max = 0.0
        self.min = math.inf

    def record(self, seconds: float) -> None:
        """Add one value (seconds; negatives count as 0)."""
        ns = int(seconds * 1e9)
        if ns <= 0:
            ns = 0
            seconds = 0.0
        elif ns > _MAX_VALUE:
            ns = _MAX_VALUE
        shift = ns.bit_length() - 8  # _SUB_BITS + 1, inlined
        self._counts[(shift << 7) + (ns >> shift) if shift > 0 else ns] += 1
        self.count += 1
        self.total += seconds
        if seconds > self.max:
            self.max = seconds
        if seconds < self.min:
            self.min = seconds

    def record_many(self, values: Iterable[float]) -> None:
        for v in values:
            self.record(v)

    def merge(self, other: LatencyHistogram) -> None:
        """Add ``other``'s values into this histogram."""
        if other.count == 0:
            return
        mine = self._counts
        for i, c in enumerate(other._counts):
            if c:
                mine[i] += c
        self.count += other.count
        self.total += other.total
        self.max = max(self.max, other.max)
        self.min = min(self.min, other.min)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def percentile(self, p: float) -> float:
        """The value (seconds) at percentile ``p`` in [0, 100]: the smallest recorded value
        with at least ``p``% of the values at or below it, to the histogram's precision.
        ``percentile(100)`` is the exact maximum; an empty histogram gives 0.0."""
        if not 0 <= p <= 100:
            raise ValueError(f"percentile must be within [0, 100], got {p}")
        if self.count == 0:
            return 0.0
        if p >= 100:
            return self.max
        rank = max(1, math.ceil(p / 100 * self.count))
        seen = 0
        for i, c in enumerate(self._counts):
            if c:
                seen += c
                if seen >= rank:
                    low, high = _bounds(i)
                    mid = (low + high) / 2e9 if high - low > 1 else low / 1e9
                    return min(max(mid, self.min), self.max)
        return self.max  # unreachable unless counts and count disagree

    def percentiles(self, ps: Iterable[float]) -> dict[float, float]:
        """Several percentiles at once, as {p: seconds}."""
        wanted = sorted(set(ps))
        return {p: self.percentile(p) for p in wanted}

    def buckets(self) -> Iterator[tuple[float, float, int]]:
        """Non-empty buckets as (low_seconds, high_seconds, count), ascending."""
        for i, c in enumerate(self._counts):
            if c:
                low, high = _bounds(i)
                yield low / 1e9, high / 1e9, c

    # Serialisation, for merging histograms across processes ------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A compact, JSON-able form (sparse bucket counts); :meth:`from_dict` restores it."""
        return {
            "count": self.count,
            "total": self.total,
            "max": self.max,
            "min": self.min if self.count else None,
            "buckets": {str(i): c for i, c in enumerate(self._counts) if c},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LatencyHistogram:
        h = cls()
        for i, c in data["buckets"].items():
            h._counts[int(i)] = int(c)
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

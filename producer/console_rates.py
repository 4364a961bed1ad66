"""Recent rates for the console, from counters that only grow: the workers' statistics
(``protocol.modelstats``, every worker, summed) and this gateway's request-duration histogram.

Counters give totals since each process started; the console shows what happened lately, so
each reading is kept and the next one is compared with it (``Rates``): per second, and latency
percentiles interpolated within the histogram's buckets, as Prometheus' ``histogram_quantile``
does. Pure: readings come in with their time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.metrics import Histogram

from protocol.modelstats import WorkerStatistics

Key = tuple[str, str]
"""(model, version)."""


@dataclass(frozen=True, slots=True)
class Counts:
    """One version's counters at one time, cluster-wide (workers) and at this gateway
    (``buckets``: upper bound -> cumulative requests, ``errors``: 5xx and 4xx answers)."""

    inferences: int = 0
    executions: int = 0
    failures: int = 0
    success_ns: int = 0
    successes: int = 0
    buckets: tuple[tuple[float, float], ...] = ()
    errors: float = 0.0


def from_workers(stats: WorkerStatistics) -> dict[Key, Counts]:
    return {
        (model, version): Counts(
            inferences=v.inference_count,
            executions=v.execution_count,
            failures=v.fail.count,
            success_ns=v.success.ns,
            successes=v.success.count,
        )
        for model, versions in stats.models.items()
        for version, v in versions.items()
    }


def from_histogram(histogram: Histogram) -> dict[Key, tuple[dict[float, float], float]]:
    """Per (model, version): cumulative count per bucket bound, and the requests answered with
    an error (4xx or 5xx), summed over endpoints and protocols."""
    out: dict[Key, tuple[dict[float, float], float]] = {}
    for metric in histogram.collect():
        for sample in metric.samples:
            labels = sample.labels
            key = (labels.get("model", ""), labels.get("version", ""))
            if not key[0]:
                continue
            buckets, errors = out.setdefault(key, ({}, 0.0))
            if sample.name.endswith("_bucket"):
                bound = float(labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
            elif sample.name.endswith("_count") and labels.get("status_class") in ("4xx", "5xx"):
                out[key] = (buckets, errors + sample.value)
    return out


def merged(
    workers: Mapping[Key, Counts], gateway: Mapping[Key, tuple[dict[float, float], float]]
) -> dict[Key, Counts]:
    out = dict(workers)
    for key, (buckets, errors) in gateway.items():
        base = out.get(key, Counts())
        out[key] = Counts(
            base.inferences,
            base.executions,
            base.failures,
            base.success_ns,
            base.successes,
            tuple(sorted(buckets.items())),
            errors,
        )
    return out


def quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """The ``q`` quantile (seconds) of cumulative ``(bound, count)`` buckets, linear within a
    bucket; None without observations. In the ``+Inf`` bucket: the highest finite bound."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound


def _delta(now: Counts, before: Counts) -> Counts | None:
    """``now - before``; None when a counter went backwards (a worker left or restarted)."""
    diff = Counts(
        now.inferences - before.inferences,
        now.executions - before.executions,
        now.failures - before.failures,
        now.success_ns - before.success_ns,
        now.successes - before.successes,
        tuple(
            (bound, count - dict(before.buckets).get(bound, 0.0)) for bound, count in now.buckets
        ),
        now.errors - before.errors,
    )
    numbers = (diff.inferences, diff.executions, diff.failures, diff.success_ns, diff.successes)
    if min(numbers) < 0 or diff.errors < 0 or any(c < 0 for _, c in diff.buckets):
        return None
    return diff


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


class Rates:
    """Rates between the reading before and the latest one, per (model, version)."""

    def __init__(self) -> None:
        self._before: tuple[float, dict[Key, Counts]] | None = None
        self._latest: tuple[float, dict[Key, Counts]] | None = None

    def update(self, at_s: float, counts: dict[Key, Counts], min_interval_s: float) -> None:
        """Take a reading; the one it is compared with moves on at most every
        ``min_interval_s`` (so quick polls compare over a useful interval)."""
        if self._before is None or (
            self._latest is not None and self._latest[0] - self._before[0] >= min_interval_s
        ):
            self._before = self._latest
        self._latest = (at_s, counts)

    def of(self, key: Key) -> dict[str, Any]:
        """Per second: rows inferred and batches run (workers), failures and the error rate
        (failures over requests run); mean time on the workers; this gateway's requests per
        second, error rate and p50/p95/p99 latency. Empty before two readings."""
        if self._before is None or self._latest is None:
            return {}
        dt = self._latest[0] - self._before[0]
        now = self._latest[1].get(key)
        if dt <= 0 or now is None:
            return {}
        diff = _delta(now, self._before[1].get(key, Counts()))
        if diff is None:
            return {}
        requests = diff.buckets[-1][1] if diff.buckets else 0.0
        run = diff.successes + diff.failures
        return {
            "inferences_per_s": round(diff.inferences / dt, 2),
            "batches_per_s": round(diff.executions / dt, 2),
            "failures_per_s": round(diff.failures / dt, 2),
            "error_rate": round(diff.failures / run, 4) if run else None,
            "mean_ms": round(diff.success_ns / diff.successes / 1e6, 2) if diff.successes else None,
            "gateway_requests_per_s": round(requests / dt, 2),
            "gateway_error_rate": round(diff.errors / requests, 4) if requests else None,
            "p50_ms": _ms(quantile(0.5, diff.buckets)),
            "p95_ms": _ms(quantile(0.95, diff.buckets)),
            "p99_ms": _ms(quantile(0.99, diff.buckets)),
        }

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from loadgen import stats as S
from loadgen.stats import LatencyHistogram, RequestStats

# Relative tolerance of a percentile: half a bucket (1/256), plus float slack.
REL = LatencyHistogram.RELATIVE_PRECISION * 1.001
PS = [0, 1, 10, 25, 50, 75, 90, 95, 99, 99.9, 99.99, 100]


def _close(got: float, want: float) -> bool:
    # 1 ns absolute: values are truncated to whole nanoseconds.
    return abs(got - want) <= want * REL + 1e-9


def test_bucket_layout_is_contiguous_and_precise() -> None:
    prev = 0
    for i in range(S._N_BUCKETS):
        low, high = S._bounds(i)
        assert low == prev
        assert high - low == 1 or (high - low) / low <= 1 / 128
        prev = high
    assert prev == S._MAX_VALUE + 1
    for ns in [0, 1, 255, 256, 257, 1000, 12345678, 10**11, S._MAX_VALUE]:
        low, high = S._bounds(S._index(ns))
        assert low <= ns < high


@pytest.mark.parametrize(
    "name",
    ["lognormal", "uniform", "bimodal", "tiny"],
)
def test_percentiles_match_numpy(name: str) -> None:
    rng = np.random.default_rng(42)
    n = 50_000
    if name == "lognormal":  # ~1 ms median, long tail up to seconds
        data = rng.lognormal(mean=math.log(1e-3), sigma=1.2, size=n)
    elif name == "uniform":
        data = rng.uniform(1e-6, 100.0, size=n)
    elif name == "bimodal":
        data = np.concatenate([rng.normal(2e-3, 1e-4, n // 2), rng.normal(0.5, 0.05, n // 2)])
        data = np.abs(data)
    else:  # sub-microsecond to a few microseconds: the exact region
        data = rng.uniform(1e-7, 5e-6, size=n)
    h = LatencyHistogram()
    for v in data.tolist():
        h.record(v)
    assert h.count == n
    assert h.max == data.max()
    assert h.min == data.min()
    assert h.mean == pytest.approx(data.mean(), rel=1e-9)
    for p in PS:
        want = float(np.percentile(data, p, method="inverted_cdf"))
        got = h.percentile(p)
        assert _close(got, want), (p, got, want)
    # and against numpy's default (linear) interpolation, for the usual report points (the
    # bimodal median falls between the modes, where interpolation and ranks legitimately differ)
    for p in [50, 90, 99] if name != "bimodal" else []:
        want = float(np.percentile(data, p))
        assert abs(h.percentile(p) - want) <= want * 0.01, p


def test_merge_equals_recording_everything_in_one() -> None:
    rng = np.random.default_rng(7)
    a_data = rng.exponential(2e-3, 10_000)
    b_data = rng.exponential(20e-3, 5_000)
    a, b, both = LatencyHistogram(), LatencyHistogram(), LatencyHistogram()
    a.record_many(a_data.tolist())
    b.record_many(b_data.tolist())
    both.record_many(np.concatenate([a_data, b_data]).tolist())
    a.merge(b)
    a.merge(LatencyHistogram())  # merging an empty one changes nothing
    assert a.count == both.count == 15_000
    assert a.max == both.max and a.min == both.min
    assert a.mean == pytest.approx(both.mean)
    assert [a.percentile(p) for p in PS] == [both.percentile(p) for p in PS]
    assert list(a.buckets()) == list(both.buckets())


def test_edge_values() -> None:
    h = LatencyHistogram()
    assert (h.count, h.percentile(50), h.mean, h.max) == (0, 0.0, 0.0, 0.0)
    h.record(-1.0)  # clock oddities count as zero
    h.record(0.0)
    h.record(5000.0)  # beyond 2**40 ns: clamped bucket, exact max
    assert h.count == 3
    assert h.percentile(50) == 0.0
    assert h.percentile(100) == h.max == 5000.0
    assert 1000 < h.percentile(99) <= 5000.0
    with pytest.raises(ValueError):
        h.percentile(101)
    assert h.percentiles([50, 100]) == {50: 0.0, 100: 5000.0}


def test_histogram_round_trips_through_json() -> None:
    h = LatencyHistogram()
    h.record_many([1e-4, 2e-3, 2e-3, 0.5])
    back = LatencyHistogram.from_dict(json.loads(json.dumps(h.to_dict())))
    assert list(back.buckets()) == list(h.buckets())
    assert (back.count, back.max, back.min, back.total) == (h.count, h.max, h.min, h.total)
    empty = LatencyHistogram.from_dict(json.loads(json.dumps(LatencyHistogram().to_dict())))
    assert empty.count == 0 and empty.min == math.inf


def test_request_stats_counts_and_merges() -> None:
    a = RequestStats()
    a.record(200, 1e-3)
    a.record(204, 2e-3)
    a.record(503, 5e-4)
    a.record_error(TimeoutError("x"))
    b = RequestStats()
    b.record(503, 1e-4)
    b.record(429, 1e-4)
    b.record_error("ConnectError")
    b.record_error("TimeoutError")
    a.merge(b)
    assert a.ok == 2
    assert a.responses == 5
    assert a.total == 8
    assert a.error_count == 6
    assert a.errors == {"429": 1, "503": 2, "ConnectError": 1, "TimeoutError": 2}
    assert a.statuses == {200: 1, 204: 1, 503: 2, 429: 1}
    assert a.latency.count == 2 and a.error_latency.count == 3
    back = RequestStats.from_dict(json.loads(json.dumps(a.to_dict())))
    assert back.errors == a.errors and back.statuses == a.statuses
    assert back.latency.percentile(50) == a.latency.percentile(50)


def test_record_is_cheap() -> None:
    # O(1) and allocation-free: a million records must not take long even on a slow CI box.
    import time

    h = LatencyHistogram()
    t = time.perf_counter()
    for _ in range(200_000):
        h.record(0.00123)
    assert time.perf_counter() - t < 2.0
    assert h.percentile(50) == pytest.approx(0.00123, rel=REL)

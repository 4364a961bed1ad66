from __future__ import annotations

import json
import math

import numpy as np
import pytest

from loadgen.stats import HIGHEST_NS, LatencyHistogram, RequestStats

PS = [0, 1, 10, 25, 50, 75, 90, 95, 99, 99.9, 99.99, 100]


def _close(got: float, want: float, h: LatencyHistogram) -> bool:
    # One bucket's width, plus 1 ns: values are recorded as whole nanoseconds.
    return abs(got - want) <= want * h.relative_precision * 1.001 + 1e-9


def _nearest_rank(data: np.ndarray, p: float) -> float:
    """HdrHistogram's percentile: the sample of rank round(p % of n) (at least 1)."""
    ordered = np.sort(data)
    rank = max(1, int(p / 100 * len(ordered) + 0.5))
    return float(ordered[min(rank, len(ordered)) - 1])


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
        want = data.min() if p == 0 else _nearest_rank(data, p)
        got = h.percentile(p)
        assert _close(got, want, h), (p, got, want)
    assert h.percentiles(PS) == {p: h.percentile(p) for p in PS}
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
    for v in a_data.tolist():
        a.record(v)
        both.record(v)
    for v in b_data.tolist():
        b.record(v)
        both.record(v)
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
    h.record(5000.0)  # beyond an hour: counted as one hour, exact max
    assert h.count == 3
    assert h.percentile(50) == 0.0
    assert h.percentile(100) == h.max == 5000.0
    assert HIGHEST_NS / 1e9 <= h.percentile(99) <= 5000.0
    with pytest.raises(ValueError):
        h.percentile(101)
    assert h.percentiles([50, 100]) == {50: 0.0, 100: 5000.0}
    with pytest.raises(ValueError):
        h.percentiles([50, -1])


def test_histogram_round_trips_through_json() -> None:
    h = LatencyHistogram()
    for v in [1e-4, 2e-3, 2e-3, 0.5]:
        h.record(v)
    data = json.loads(json.dumps(h.to_dict()))
    assert isinstance(data["hdr"], str)  # HdrHistogram's own compressed, base64 form
    back = LatencyHistogram.from_dict(data)
    assert list(back.buckets()) == list(h.buckets())
    assert [back.percentile(p) for p in PS] == [h.percentile(p) for p in PS]
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


def test_buckets_hold_their_values_and_sum_to_the_count() -> None:
    h = LatencyHistogram()
    values = [3e-6, 1e-4, 2e-3, 2e-3, 0.5]
    for v in values:
        h.record(v)
    buckets = list(h.buckets())
    assert sum(c for _, _, c in buckets) == len(values)
    assert [lo for lo, _, _ in buckets] == sorted(lo for lo, _, _ in buckets)
    for v in set(values):
        assert any(lo <= v < hi and (hi - lo) <= v / 1000 for lo, hi, _ in buckets), v


def test_a_timeline_second_is_coarser_but_within_one_percent() -> None:
    coarse = LatencyHistogram(significant_figures=2, word_size=4)
    for v in np.random.default_rng(3).lognormal(math.log(2e-3), 0.5, 5_000).tolist():
        coarse.record(v)
    assert coarse.relative_precision <= 0.01
    fine = LatencyHistogram()
    fine.merge(coarse)  # histograms of different precision still merge
    assert fine.count == coarse.count and fine.max == coarse.max

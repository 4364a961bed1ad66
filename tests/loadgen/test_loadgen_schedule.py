"""Rate specs, ramps and seeded Poisson arrivals (pure: no clock, no I/O)."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from loadgen.schedule import RateSchedule, Segment, parse_duration, poisson_arrivals


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("10", 10.0), ("10s", 10.0), ("2.5s", 2.5), ("500ms", 0.5), ("2m", 120.0), ("1h", 3600.0)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "s", "10x", "-1s", "ten", "1.2.3s"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_constant_rate() -> None:
    s = RateSchedule.parse("250")
    assert s.rate_at(0) == s.rate_at(1e6) == 250
    assert s.length_s == 0
    assert s.expected(4.0) == pytest.approx(1000)
    assert s.time_at(1000) == pytest.approx(4.0)
    assert s.describe() == "250/s"


def test_ramp_then_hold_at_the_final_rate() -> None:
    s = RateSchedule.parse("100:1000:10s")
    assert s.length_s == 10
    assert s.rate_at(0) == 100
    assert s.rate_at(5) == pytest.approx(550)
    assert s.rate_at(10) == s.rate_at(60) == 1000
    # area of the ramp: (100 + 1000) / 2 * 10, then 1000 per second
    assert s.expected(10) == pytest.approx(5500)
    assert s.expected(12) == pytest.approx(7500)
    assert s.describe() == "100->1000/s over 10s, then 1000/s"


def test_time_at_inverts_expected_across_segments() -> None:
    s = RateSchedule.parse("50:400:2s,400:5s,400:20:3s,200")
    for t in [0.0, 0.3, 1.99, 2.0, 4.5, 7.0, 8.5, 10.0, 13.7]:
        assert s.time_at(s.expected(t)) == pytest.approx(t, abs=1e-9)
    assert s.rate_at(8.5) == pytest.approx(400 + (20 - 400) * 1.5 / 3)
    assert s.rate_at(11) == 200


def test_a_ramp_down_to_zero_then_nothing_more_arrives() -> None:
    s = RateSchedule((Segment(10, 0, 2),))
    assert s.expected(100) == pytest.approx(10)
    assert s.time_at(10) == pytest.approx(2)
    assert s.time_at(10.5) == math.inf
    assert list(poisson_arrivals(s, random.Random(1)))[-1] <= 2.0


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "rate"),
        ("fast", "rate"),
        ("-5", "non-negative"),
        ("100,200", "must be the last"),
        ("100:200:0s", "positive"),
        ("1:2:3:4", "expected"),
        ("100:0:5s", "ends at 0"),
        ("inf", "non-negative"),
    ],
)
def test_bad_rate_specs(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RateSchedule.parse(text)


def test_poisson_inter_arrival_times_have_the_rate_as_mean_and_are_exponential() -> None:
    rate = 800.0
    arrivals = poisson_arrivals(RateSchedule.constant(rate), random.Random(7))
    times = [next(arrivals) for _ in range(20_000)]
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / rate, rel=0.03)
    # exponential: standard deviation equals the mean, and P(gap > mean) = 1/e
    assert statistics.pstdev(gaps) == pytest.approx(mean, rel=0.05)
    assert sum(g > mean for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.02)
    assert all(b > a for a, b in itertools.pairwise(times))


def test_poisson_arrivals_are_seeded() -> None:
    s = RateSchedule.parse("10:100:1s")
    first = list(_take(poisson_arrivals(s, random.Random(3)), 50))
    assert first == list(_take(poisson_arrivals(s, random.Random(3)), 50))
    assert first != list(_take(poisson_arrivals(s, random.Random(4)), 50))


def test_ramp_arrivals_follow_the_ramp() -> None:
    s = RateSchedule.parse("0:2000:4s")
    counts = [0] * 4
    for t in poisson_arrivals(s, random.Random(11)):
        if t >= 4:
            break
        counts[int(t)] += 1
    for second, n in enumerate(counts):
        expected = s.expected(second + 1) - s.expected(second)  # 250, 750, 1250, 1750
        assert abs(n - expected) < 5 * math.sqrt(expected), (second, n, expected)


def test_warmup_runs_at_the_initial_rate_before_the_schedule() -> None:
    s = RateSchedule.parse("100:1000:10s").shifted(2.0)
    assert s.rate_at(0) == s.rate_at(1.9) == 100
    assert s.rate_at(7) == pytest.approx(550)
    assert s.length_s == 12


def _take(it, n):  # type: ignore[no-untyped-def]
    for _ in range(n):
        yield next(it)

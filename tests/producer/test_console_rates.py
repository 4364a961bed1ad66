"""Recent rates and percentiles from counters that only grow (``producer.console_rates``)."""

from __future__ import annotations

import math

from producer.console_rates import Counts, Rates, quantile


def test_a_quantile_is_interpolated_within_its_bucket():
    buckets = [(0.01, 50.0), (0.1, 90.0), (1.0, 100.0), (math.inf, 100.0)]
    assert quantile(0.5, buckets) == 0.01
    assert abs(quantile(0.7, buckets) - 0.055) < 1e-9  # halfway from 50 to 90
    assert abs(quantile(0.99, buckets) - (0.1 + 0.9 * 0.9)) < 1e-9
    assert quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None


def test_a_quantile_in_the_infinite_bucket_is_the_highest_finite_bound():
    assert quantile(0.99, [(0.5, 10.0), (math.inf, 100.0)]) == 0.5


def test_rates_compare_readings_at_least_the_interval_apart():
    rates = Rates()
    key = ("m", "1")
    rates.update(0.0, {key: Counts(inferences=0, successes=0)}, 2.0)
    assert rates.of(key) == {}
    rates.update(1.0, {key: Counts(inferences=10, successes=10, success_ns=10_000_000)}, 2.0)
    assert rates.of(key)["inferences_per_s"] == 10.0  # against t=0: too soon to move on
    rates.update(2.0, {key: Counts(inferences=30, successes=30, success_ns=30_000_000)}, 2.0)
    got = rates.of(key)
    assert got["inferences_per_s"] == 15.0 and got["mean_ms"] == 1.0
    assert got["error_rate"] == 0.0


def test_a_counter_that_went_backwards_gives_no_rate():
    rates = Rates()
    key = ("m", "1")
    rates.update(0.0, {key: Counts(inferences=100)}, 0.0)
    rates.update(1.0, {key: Counts(inferences=5)}, 0.0)  # a worker left: its counts went too
    assert rates.of(key) == {}

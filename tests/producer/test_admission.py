"""Admission control and the circuit breaker: pure decisions, clock passed in."""

from __future__ import annotations

import math

from producer.admission import ServiceTime, decide
from producer.breaker import Breaker, State


def verdict(backlog, batch_s=0.1, max_batch=10, workers=1, deadline_s=0.5, max_backlog=10**6):
    return decide(
        backlog=backlog,
        batch_s=batch_s,
        max_batch=max_batch,
        workers=workers,
        deadline_s=deadline_s,
        max_backlog=max_backlog,
    )


def test_requests_are_admitted_while_nothing_is_measured():
    assert verdict(500, batch_s=None).admitted


def test_a_queue_that_would_outlast_the_deadline_is_refused_with_a_retry_hint():
    v = verdict(100)  # ten full batches of 100 ms ahead
    assert not v.admitted and v.kind == "wait_exceeds_deadline"
    assert math.isclose(v.wait_s, 1.0)
    assert "1000 ms" in v.reason and "500 ms" in v.reason
    assert v.retry_after_s >= 0.5


def test_the_wait_counts_batches_not_requests():
    """A burst an accelerator absorbs in a few big batches is admitted."""
    assert math.isclose(verdict(41).wait_s, 0.5)  # 41 requests: five batches of ten
    assert verdict(1000, batch_s=3.0, max_batch=4096, deadline_s=10).admitted


def test_more_workers_shorten_the_estimated_wait():
    v = verdict(100, workers=4)
    assert v.admitted and math.isclose(v.wait_s, 0.3)


def test_the_backlog_cap_refuses_whatever_the_estimate():
    v = verdict(10, batch_s=0.0, workers=8, deadline_s=60, max_backlog=10)
    assert not v.admitted and "limit of 10" in v.reason and v.kind == "backlog_full"


def test_service_time_is_the_smoothed_batch_duration():
    st = ServiceTime(weight=0.5)
    st.observe(0.1, 10)
    assert math.isclose(st.batch_s, 0.1)
    st.observe(0.3, 10)
    assert math.isclose(st.batch_s, 0.2)
    st.observe(1.0, 0)  # ignored: no batch
    assert math.isclose(st.batch_s, 0.2)


def test_the_breaker_opens_when_most_recent_requests_fail_and_probes_after_the_cooldown():
    b = Breaker(window=10, min_requests=4, threshold=0.5, cooldown_s=5)
    for ok in (True, False, False):
        assert b.allow(0.0)
        b.record(ok, 0.0)
    assert b.state is State.CLOSED  # too few outcomes to judge
    b.record(False, 1.0)
    assert b.state is State.OPEN
    assert not b.allow(2.0) and math.isclose(b.retry_after_s(2.0), 4.0)
    assert b.allow(6.5)  # the probe
    assert b.state is State.HALF_OPEN and not b.allow(6.6)  # one probe at a time
    b.record(True, 6.7)
    assert b.state is State.CLOSED and b.allow(6.8)


def test_a_failed_probe_opens_the_breaker_again():
    b = Breaker(window=4, min_requests=2, threshold=0.5, cooldown_s=5)
    b.record(False, 0.0)
    b.record(False, 0.0)
    assert b.allow(5.0)
    b.record(False, 5.0)
    assert b.state is State.OPEN and not b.allow(9.0) and b.allow(10.1)


def test_a_probe_that_never_reports_is_replaced_after_a_cooldown():
    b = Breaker(window=4, min_requests=2, threshold=0.5, cooldown_s=5)
    b.record(False, 0.0)
    b.record(False, 0.0)
    assert b.allow(5.0)  # probe sent, never answered
    assert not b.allow(6.0)
    assert b.allow(10.5)

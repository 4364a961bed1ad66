"""The scaling policy of ``inferq up --workers MIN:MAX``: up at once on the backlog, one more
for an old entry (once per cooldown), down only after a whole window asked for fewer, within
MIN and MAX, and no flapping. A fake clock: the tests pass the time."""

from __future__ import annotations

from dataclasses import replace

import pytest

from inferq.autoscale import (
    Reading,
    Reason,
    ScalingPolicy,
    ScalingTargets,
    WorkerRange,
    WorkerRangeError,
    parse_worker_range,
)

TARGETS = ScalingTargets(
    backlog_per_worker=10, oldest_wait_s=2.0, scale_down_after_s=30.0, scale_up_cooldown_s=5.0
)


def policy(low: int, high: int, targets: ScalingTargets = TARGETS) -> ScalingPolicy:
    return ScalingPolicy(WorkerRange(low, high), targets, now=0.0)


def idle(p: ScalingPolicy, start: float, seconds: float, step: float = 1.0) -> list[Reason]:
    """Readings of an empty backlog every ``step`` from ``start`` for ``seconds``."""
    changes = []
    t = start
    while t <= start + seconds:
        change = p.observe(Reading(0), t)
        if change is not None:
            changes.append(change.reason)
        t += step
    return changes


# -- --workers --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "bounds"),
    [("4", WorkerRange(4, 4)), ("0:4", WorkerRange(0, 4)), (" 2:3 ", WorkerRange(2, 3))],
)
def test_workers_is_a_fixed_count_or_a_range(raw, bounds):
    assert parse_worker_range(raw) == bounds
    assert str(bounds) == raw.strip()


@pytest.mark.parametrize("raw", ["0", "-1", "3:2", "0:0", "a:b", "1:", ":4", "1:2:3", ""])
def test_a_range_that_allows_no_worker_or_runs_backwards_is_refused(raw):
    with pytest.raises(WorkerRangeError):
        parse_worker_range(raw)


def test_a_stack_starts_with_min_workers_but_at_least_one():
    assert WorkerRange(0, 4).initial == 1
    assert WorkerRange(2, 4).initial == 2
    assert WorkerRange(3, 3).fixed and not WorkerRange(0, 3).fixed


# -- up ---------------------------------------------------------------------------------------


def test_the_backlog_asks_for_one_worker_per_target_and_gets_them_in_one_step():
    p = policy(1, 8, replace(TARGETS, max_starting=8))
    change = p.observe(Reading(45, live=1), 1.0)
    assert change is not None and (change.before, change.wanted) == (1, 5)
    assert change.reason is Reason.BACKLOG and change.up
    assert p.observe(Reading(45, live=1), 2.0) is None  # the same backlog asks for nothing more


def test_workers_start_one_at_a_time_the_next_once_the_last_is_live():
    p = policy(0, 4)
    assert idle(p, 1.0, 31.0) == [Reason.IDLE]
    wanted = []
    for t, live in [(40.0, 0), (40.5, 0), (41.0, 0), (42.0, 1), (42.5, 1), (43.0, 2), (44.0, 3)]:
        change = p.observe(Reading(100, live=live), t)
        wanted.append(change.wanted if change else None)
    assert wanted == [1, None, None, 2, None, 3, 4]


def test_a_reading_that_does_not_say_who_is_live_sets_no_limit():
    p = policy(1, 8)
    change = p.observe(Reading(45), 1.0)
    assert change is not None and (change.before, change.wanted) == (1, 5)
    assert change.reason is Reason.BACKLOG and change.up
    assert p.observe(Reading(45), 2.0) is None  # the same backlog asks for nothing more


def test_a_backlog_at_the_target_asks_for_no_more():
    p = policy(1, 8)
    assert p.observe(Reading(10), 1.0) is None
    assert p.observe(Reading(11), 2.0).wanted == 2


def test_scaling_up_is_capped_at_max():
    p = policy(0, 4)
    assert p.observe(Reading(1000), 1.0).wanted == 4
    assert p.observe(Reading(5000, oldest_wait_s=60), 10.0) is None


def test_from_zero_any_backlog_is_a_cold_start_of_one_worker():
    p = policy(0, 4)
    assert idle(p, 1.0, 31.0) == [Reason.IDLE]
    assert p.wanted == 0
    change = p.observe(Reading(1), 40.0)
    assert change is not None and (change.before, change.wanted) == (0, 1)
    assert change.reason is Reason.COLD_START


def test_an_old_entry_adds_one_worker_at_most_once_per_cooldown():
    p = policy(1, 8)
    # A small backlog that waits too long: one slow model call, not many requests.
    added = [p.observe(Reading(3, oldest_wait_s=4.0), t) for t in (5.0, 6.0, 9.0, 10.0, 15.0)]
    assert [c.wanted if c else None for c in added] == [2, None, None, 3, 4]
    assert {c.reason for c in added if c} == {Reason.OLDEST_WAIT}


def test_an_entry_younger_than_the_target_adds_nobody():
    p = policy(1, 8)
    assert p.observe(Reading(3, oldest_wait_s=1.9), 10.0) is None


# -- down -------------------------------------------------------------------------------------


def test_idle_workers_stop_only_after_scale_down_after_s_and_then_all_go_to_min():
    p = policy(0, 4)
    p.observe(Reading(40), 1.0)
    assert p.wanted == 4
    assert p.observe(Reading(0), 2.0) is None  # the window opens
    assert p.observe(Reading(0), 31.0) is None  # 29 s: not yet
    change = p.observe(Reading(0), 32.0)
    assert change is not None and (change.before, change.wanted) == (4, 0)
    assert change.reason is Reason.IDLE and not change.up


def test_min_is_kept_however_idle():
    p = policy(2, 4)
    p.observe(Reading(40), 1.0)
    assert idle(p, 2.0, 100.0) == [Reason.IDLE]
    assert p.wanted == 2
    assert idle(p, 103.0, 100.0) == []


def test_scaling_down_goes_to_the_most_any_reading_of_the_window_asked_for():
    p = policy(0, 8)
    p.observe(Reading(80), 0.0)
    assert p.wanted == 8
    for t, backlog in [(1.0, 0), (10.0, 25), (20.0, 5)]:
        assert p.observe(Reading(backlog), t) is None
    change = p.observe(Reading(0), 31.0)
    assert change is not None and change.wanted == 3 and change.reason is Reason.BELOW_TARGET


def test_a_reading_that_asks_for_the_workers_again_restarts_the_window():
    p = policy(0, 4)
    p.observe(Reading(20), 0.0)
    assert p.observe(Reading(0), 1.0) is None
    assert p.observe(Reading(20), 25.0) is None  # still 2: the window starts over
    assert p.observe(Reading(0), 26.0) is None
    assert p.observe(Reading(0), 50.0) is None
    assert p.observe(Reading(0), 56.0).wanted == 0


def test_an_old_entry_keeps_the_workers_however_small_the_backlog():
    p = policy(0, 4)
    p.observe(Reading(20), 0.0)
    changes = [p.observe(Reading(1, oldest_wait_s=3.0), float(t)) for t in range(1, 100)]
    assert all(c.up for c in changes if c is not None)
    assert p.wanted == 4  # one more per cooldown, up to MAX; none stopped


def test_no_reading_changes_nothing_and_never_counts_as_idle():
    p = policy(0, 4)
    p.observe(Reading(20), 0.0)
    assert p.observe(Reading(0), 1.0) is None
    for t in range(2, 60):
        assert p.observe(None, float(t)) is None
    assert p.wanted == 2
    assert p.observe(Reading(0), 61.0) is None  # a fresh window
    assert p.observe(Reading(0), 91.0).wanted == 0


# -- no flapping ------------------------------------------------------------------------------


def test_a_backlog_that_hovers_around_the_target_does_not_start_and_stop_workers_in_turn():
    p = policy(0, 4)
    changes = []
    for i in range(600):  # ten minutes of readings each second, 5 to 15 entries in turn
        change = p.observe(Reading(5 if i % 2 else 15), float(i))
        if change is not None:
            changes.append(change)
    assert [(c.before, c.wanted) for c in changes] == [(1, 2)]


def test_a_burst_that_returns_within_the_window_finds_its_workers():
    p = policy(0, 4)
    changes = []
    for t in range(0, 300):
        backlog = 40 if t % 20 < 2 else 0  # 2 s of burst every 20 s
        change = p.observe(Reading(backlog), float(t))
        if change is not None:
            changes.append((change.before, change.wanted))
    assert changes == [(1, 4)]

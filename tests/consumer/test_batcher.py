"""Batch formation with an injected clock: when a batch runs, and which requests it holds.

Times are plain floats (seconds on the worker's monotonic clock); nothing sleeps.
"""

from __future__ import annotations

import random
from collections.abc import Hashable

import pytest

from consumer.batcher import BatchPolicy, BatchQueue, Queued

HIGH, NORMAL, LOW = 0, 1, 2
FAR = 1e9  # a deadline nobody reaches in these tests


def q(
    item: str,
    *,
    lane: int = NORMAL,
    rows: int = 1,
    group: Hashable = "g",
    arrived: float = 0.0,
    deadline: float = FAR,
) -> Queued[str]:
    return Queued(item, lane=lane, rows=rows, group=group, arrived=arrived, deadline=deadline)


def queue_of(*items: Queued[str]) -> BatchQueue[str]:
    queue: BatchQueue[str] = BatchQueue()
    for item in items:
        queue.push(item)
    return queue


def names(batch: list[Queued[str]] | BatchQueue[str]) -> list[str]:
    return [x.item for x in batch]


# --------------------------------------------------------------------------------------------
# BatchQueue bookkeeping


def test_an_empty_queue_has_no_rows_arrival_or_deadline() -> None:
    queue: BatchQueue[str] = BatchQueue()
    assert len(queue) == 0
    assert queue.rows == 0
    assert queue.oldest_arrival() is None
    assert queue.earliest_deadline() is None
    assert queue.take(8) == []
    assert queue.drop_expired(100.0) == []


def test_pushing_counts_requests_and_rows() -> None:
    queue = queue_of(q("a", rows=3), q("b", rows=1, lane=HIGH), q("c", rows=4, lane=LOW))
    assert len(queue) == 3
    assert queue.rows == 8


def test_iteration_goes_by_lane_then_arrival() -> None:
    queue = queue_of(
        q("n1", lane=NORMAL), q("l1", lane=LOW), q("h1", lane=HIGH), q("n2"), q("h2", lane=HIGH)
    )
    assert names(queue) == ["h1", "h2", "n1", "n2", "l1"]


def test_oldest_arrival_and_earliest_deadline_span_all_lanes() -> None:
    queue = queue_of(
        q("a", lane=HIGH, arrived=5.0, deadline=30.0),
        q("b", lane=LOW, arrived=2.0, deadline=40.0),
        q("c", lane=NORMAL, arrived=7.0, deadline=12.0),
    )
    assert queue.oldest_arrival() == 2.0
    assert queue.earliest_deadline() == 12.0


def test_a_queue_can_have_any_number_of_lanes() -> None:
    queue: BatchQueue[str] = BatchQueue(lanes=1)
    queue.push(q("only", lane=0))
    with pytest.raises(IndexError):
        queue.push(q("nope", lane=1))
    assert names(queue.take(4)) == ["only"]


# --------------------------------------------------------------------------------------------
# take


def test_take_respects_max_rows() -> None:
    queue = queue_of(*(q(f"r{i}", rows=2) for i in range(5)))
    batch = queue.take(5)
    assert names(batch) == ["r0", "r1"]
    assert sum(x.rows for x in batch) == 4
    assert queue.rows == 6
    assert names(queue) == ["r2", "r3", "r4"]


def test_take_fills_the_batch_exactly_to_max_rows() -> None:
    queue = queue_of(q("a", rows=3), q("b", rows=5), q("c", rows=1))
    assert names(queue.take(8)) == ["a", "b"]
    assert names(queue) == ["c"]


def test_take_drains_everything_that_fits() -> None:
    queue = queue_of(q("a"), q("b", lane=HIGH), q("c", lane=LOW))
    assert names(queue.take(64)) == ["b", "a", "c"]
    assert len(queue) == 0
    assert queue.rows == 0


def test_take_serves_higher_lanes_first() -> None:
    queue = queue_of(
        q("low", lane=LOW), q("normal", lane=NORMAL), q("high1", lane=HIGH), q("high2", lane=HIGH)
    )
    assert names(queue.take(2)) == ["high1", "high2"]
    assert names(queue.take(2)) == ["normal", "low"]


def test_take_is_first_come_first_served_within_a_lane() -> None:
    queue = queue_of(*(q(f"n{i}", arrived=float(i)) for i in range(6)))
    assert names(queue.take(4)) == ["n0", "n1", "n2", "n3"]
    assert names(queue.take(4)) == ["n4", "n5"]


def test_take_batches_only_within_the_head_requests_group() -> None:
    queue = queue_of(
        q("a1", group=("m", "1")),
        q("b1", group=("m", "2")),
        q("a2", group=("m", "1")),
        q("b2", group=("m", "2")),
        q("a3", group=("m", "1"), lane=LOW),
    )
    assert names(queue.take(10)) == ["a1", "a2", "a3"]
    assert names(queue) == ["b1", "b2"]
    assert queue.rows == 2
    assert names(queue.take(10)) == ["b1", "b2"]


def test_the_head_request_comes_from_the_highest_non_empty_lane() -> None:
    queue = queue_of(q("normal", group="x", arrived=0.0), q("high", group="y", lane=HIGH))
    assert names(queue.take(10)) == ["high"]
    assert names(queue.take(10)) == ["normal"]


def test_other_groups_keep_their_place_in_line() -> None:
    queue = queue_of(q("a1"), q("x1", group="x"), q("a2"), q("x2", group="x"), q("x3", group="x"))
    queue.take(10)
    assert names(queue) == ["x1", "x2", "x3"]


def test_a_single_request_larger_than_max_rows_runs_alone() -> None:
    queue = queue_of(q("huge", rows=100), q("small", rows=1))
    assert names(queue.take(8)) == ["huge"]
    assert queue.rows == 1
    assert names(queue.take(8)) == ["small"]


def test_an_oversized_request_behind_the_head_waits_its_turn_and_then_runs_alone() -> None:
    queue = queue_of(q("a", rows=2), q("huge", rows=50), q("b", rows=2))
    assert names(queue.take(8)) == ["a", "b"]
    assert names(queue.take(8)) == ["huge"]
    assert queue.rows == 0


def test_later_requests_that_fit_fill_the_room_a_larger_one_leaves() -> None:
    # The contract: requests of the head's group are taken in order while they fit; one that
    # does not fit stays (at the front of its lane) and smaller ones after it may still join.
    queue = queue_of(q("a", rows=3), q("b", rows=4), q("c", rows=1), q("d", rows=2))
    assert names(queue.take(6)) == ["a", "c", "d"]
    assert names(queue) == ["b"]
    assert queue.rows == 4


def test_take_leaves_no_empty_batch_while_requests_remain() -> None:
    queue = queue_of(q("a", rows=9, group="x"), q("b", rows=9, group="y"))
    while len(queue):
        assert queue.take(1)
    assert queue.rows == 0


# --------------------------------------------------------------------------------------------
# drop_expired


def test_drop_expired_removes_exactly_the_expired_requests() -> None:
    queue = queue_of(
        q("past", deadline=9.0, rows=2),
        q("now", deadline=10.0, rows=3, lane=HIGH),
        q("soon", deadline=10.001, rows=5),
        q("later", deadline=20.0, rows=7, lane=LOW),
        q("also-past", deadline=1.0, rows=11, lane=LOW),
    )
    expired = queue.drop_expired(10.0)
    assert sorted(names(expired)) == ["also-past", "now", "past"]
    assert names(queue) == ["soon", "later"]
    assert queue.rows == 5 + 7
    assert queue.rows == sum(x.rows for x in queue)


def test_drop_expired_keeps_everything_when_nothing_has_expired() -> None:
    queue = queue_of(q("a", deadline=5.0), q("b", deadline=6.0, lane=HIGH))
    assert queue.drop_expired(4.999) == []
    assert names(queue) == ["b", "a"]
    assert queue.rows == 2


def test_drop_expired_keeps_the_order_of_the_survivors() -> None:
    queue = queue_of(*(q(f"r{i}", deadline=float(i % 3)) for i in range(9)))
    queue.drop_expired(0.5)
    assert names(queue) == ["r1", "r2", "r4", "r5", "r7", "r8"]


def test_drop_expired_can_empty_the_queue() -> None:
    queue = queue_of(q("a", deadline=1.0, rows=4), q("b", deadline=2.0, lane=HIGH, rows=4))
    assert len(queue.drop_expired(2.0)) == 2
    assert len(queue) == 0
    assert queue.rows == 0


def test_queue_stays_consistent_through_any_sequence_of_operations() -> None:
    rng = random.Random(1234)
    queue: BatchQueue[str] = BatchQueue()
    pushed: list[str] = []
    gone: list[str] = []
    now = 0.0
    for step in range(3000):
        action = rng.random()
        if action < 0.6:
            item = f"r{step}"
            pushed.append(item)
            queue.push(
                q(
                    item,
                    lane=rng.randrange(3),
                    rows=rng.choice([0, 1, 1, 2, 5, 40]),
                    group=rng.choice("ab"),
                    arrived=now,
                    deadline=now + rng.uniform(0.0, 5.0),
                )
            )
        elif action < 0.85:
            max_rows = rng.choice([1, 4, 16, 32])
            head = next(iter(queue), None)
            before = {lane: [x.item for x in queue if x.lane == lane] for lane in range(3)}
            batch = queue.take(max_rows)
            if head is None:
                assert batch == []
                continue
            assert batch[0] is head
            assert all(x.group == head.group for x in batch)
            assert len(batch) == 1 or sum(x.rows for x in batch) <= max_rows
            lanes = [x.lane for x in batch]
            assert lanes == sorted(lanes)  # higher lanes first
            for lane in range(3):  # first come first served within a lane
                taken = [x.item for x in batch if x.lane == lane]
                assert taken == [x for x in before[lane] if x in taken]
                left = [x.item for x in queue if x.lane == lane]
                assert left == [x for x in before[lane] if x not in taken]
            gone.extend(names(batch))
        else:
            now += rng.uniform(0.0, 2.0)
            expired = queue.drop_expired(now)
            assert all(x.deadline <= now for x in expired)
            assert all(x.deadline > now for x in queue)
            gone.extend(names(expired))
        assert queue.rows == sum(x.rows for x in queue)
        assert len(queue) == len(pushed) - len(gone)
    assert sorted(gone + names(queue)) == sorted(pushed)


# --------------------------------------------------------------------------------------------
# BatchPolicy.wait_s

POLICY = BatchPolicy(max_batch=8, flush_s=0.002)


def test_an_empty_queue_waits_for_news() -> None:
    queue: BatchQueue[str] = BatchQueue()
    assert POLICY.wait_s(queue, 10.0, drained=False, service_s=0.0) is None
    assert POLICY.wait_s(queue, 10.0, drained=True, service_s=0.0) is None


def test_a_drained_stream_runs_the_batch_at_once() -> None:
    queue = queue_of(q("a", arrived=10.0))
    assert POLICY.wait_s(queue, 10.0, drained=True, service_s=0.0) == 0.0


def test_a_full_batch_runs_at_once() -> None:
    queue = queue_of(*(q(f"r{i}", arrived=10.0) for i in range(8)))
    assert POLICY.wait_s(queue, 10.0, drained=False, service_s=0.0) == 0.0


def test_more_rows_than_a_batch_run_at_once() -> None:
    queue = queue_of(q("big", rows=20, arrived=10.0))
    assert POLICY.wait_s(queue, 10.0, drained=False, service_s=0.0) == 0.0


def test_a_partial_batch_with_more_queued_waits_out_the_flush_window() -> None:
    queue = queue_of(q("a", arrived=10.0))
    assert POLICY.wait_s(queue, 10.0, drained=False, service_s=0.0) == pytest.approx(0.002)


def test_the_wait_is_what_remains_of_the_oldest_requests_window() -> None:
    policy = BatchPolicy(max_batch=8, flush_s=0.010)
    queue = queue_of(q("old", arrived=10.000), q("new", arrived=10.006, lane=HIGH))
    assert policy.wait_s(queue, 10.004, drained=False, service_s=0.0) == pytest.approx(0.006)
    assert policy.wait_s(queue, 10.009, drained=False, service_s=0.0) == pytest.approx(0.001)


def test_once_the_window_has_passed_the_batch_runs() -> None:
    queue = queue_of(q("a", arrived=10.0))
    assert POLICY.wait_s(queue, 10.002, drained=False, service_s=0.0) == 0.0
    assert POLICY.wait_s(queue, 11.0, drained=False, service_s=0.0) == 0.0


def test_the_wait_never_exceeds_the_flush_window() -> None:
    rng = random.Random(7)
    for _ in range(500):
        policy = BatchPolicy(max_batch=64, flush_s=rng.uniform(0.0, 0.05))
        now = rng.uniform(0.0, 100.0)
        queue = queue_of(
            *(q(f"r{i}", arrived=now - rng.uniform(0.0, 0.1)) for i in range(rng.randint(1, 5)))
        )
        wait = policy.wait_s(queue, now, drained=False, service_s=rng.uniform(0.0, 0.01))
        assert wait is not None
        assert 0.0 <= wait <= policy.flush_s


def test_the_wait_never_runs_past_the_deadline_minus_the_service_time() -> None:
    policy = BatchPolicy(max_batch=8, flush_s=1.0)
    queue = queue_of(q("a", arrived=10.0, deadline=10.5), q("b", arrived=10.0, deadline=99.0))
    # The window would allow 1 s; the deadline allows 0.5 s less the 0.2 s the model needs.
    assert policy.wait_s(queue, 10.0, drained=False, service_s=0.2) == pytest.approx(0.3)
    assert policy.wait_s(queue, 10.25, drained=False, service_s=0.2) == pytest.approx(0.05)


def test_a_deadline_that_can_only_just_be_met_runs_the_batch_now() -> None:
    policy = BatchPolicy(max_batch=8, flush_s=1.0)
    queue = queue_of(q("a", arrived=10.0, deadline=10.2))
    assert policy.wait_s(queue, 10.0, drained=False, service_s=0.2) == 0.0
    assert policy.wait_s(queue, 10.0, drained=False, service_s=0.5) == 0.0


def test_the_earliest_deadline_in_any_lane_bounds_the_wait() -> None:
    policy = BatchPolicy(max_batch=8, flush_s=1.0)
    queue = queue_of(
        q("high", lane=HIGH, arrived=10.0, deadline=50.0),
        q("low", lane=LOW, arrived=10.0, deadline=10.1),
    )
    assert policy.wait_s(queue, 10.0, drained=False, service_s=0.0) == pytest.approx(0.1)


def test_a_zero_flush_window_never_waits() -> None:
    policy = BatchPolicy(max_batch=8, flush_s=0.0)
    queue = queue_of(q("a", arrived=10.0))
    assert policy.wait_s(queue, 10.0, drained=False, service_s=0.0) == 0.0


def test_the_wait_shrinks_to_zero_as_time_passes() -> None:
    policy = BatchPolicy(max_batch=8, flush_s=0.01)
    queue = queue_of(q("a", arrived=10.0))
    waits = []
    for step in range(12):
        wait = policy.wait_s(queue, 10.0 + step * 0.001, drained=False, service_s=0.0)
        assert wait is not None
        waits.append(wait)
    assert waits == sorted(waits, reverse=True)
    assert waits[0] == pytest.approx(0.01)
    assert waits[-1] == 0.0


# --------------------------------------------------------------------------------------------
# Background lanes: bulk jobs never ride along in a synchronous request's batch


def background_queue(*items: Queued[str]) -> BatchQueue[str]:
    queue: BatchQueue[str] = BatchQueue(background_from=LOW)
    for item in items:
        queue.push(item)
    return queue


def test_background_requests_never_join_a_higher_lanes_batch() -> None:
    queue = background_queue(q("job-1", lane=LOW), q("sync", lane=NORMAL), q("job-2", lane=LOW))
    assert names(queue.take(8)) == ["sync"]
    assert names(queue.take(8)) == ["job-1", "job-2"]
    assert queue.rows == 0


def test_high_and_normal_requests_still_batch_together() -> None:
    queue = background_queue(q("n", lane=NORMAL), q("h", lane=HIGH), q("job", lane=LOW))
    assert names(queue.take(8)) == ["h", "n"]


def test_rows_through_a_lane_count_that_lane_and_those_above() -> None:
    queue = background_queue(
        q("h", lane=HIGH, rows=2), q("n", lane=NORMAL, rows=3), q("j", lane=LOW, rows=5)
    )
    assert [queue.rows_through(lane) for lane in (HIGH, NORMAL, LOW)] == [2, 5, 10]
    queue.take(8)
    assert [queue.rows_through(lane) for lane in (HIGH, NORMAL, LOW)] == [0, 0, 5]
    queue.drop_expired(now=FAR + 1)
    assert queue.rows_through(LOW) == 0


def test_the_head_lane_is_the_highest_non_empty_one() -> None:
    queue = background_queue(q("job", lane=LOW))
    assert queue.head_lane() == LOW
    queue.push(q("sync", lane=NORMAL))
    assert queue.head_lane() == NORMAL
    queue.take(8)
    queue.take(8)
    assert queue.head_lane() is None

"""When the writer trims a request stream (``consumer.trim.TrimSchedule``): with an XACK at most
once per interval, and at the end of the interval for what was acknowledged sooner. Pure
bookkeeping with the clock passed in; the script itself is tested with the writer and the
worker."""

from __future__ import annotations

from consumer.trim import TRIM_INTERVAL_S, TrimSchedule


def test_the_interval_is_half_a_second():
    assert TRIM_INTERVAL_S == 0.5


def test_the_first_ack_of_a_stream_takes_a_trim_with_it():
    schedule = TrimSchedule(0.5)
    assert schedule.take(["a"], 100.0) == ["a"]
    assert not schedule.waiting and schedule.next_due() is None


def test_an_ack_within_the_interval_waits_for_its_end():
    schedule = TrimSchedule(0.5)
    schedule.take(["a"], 100.0)
    assert schedule.take(["a"], 100.1) == []
    assert schedule.take(["a"], 100.3) == []  # later acks do not push the trim back
    assert schedule.next_due() == 100.5
    assert schedule.take([], 100.49) == []
    assert schedule.take([], 100.5) == ["a"]
    assert schedule.next_due() is None


def test_an_ack_after_the_interval_takes_a_trim_with_it():
    schedule = TrimSchedule(0.5)
    schedule.take(["a"], 100.0)
    assert schedule.take(["a"], 100.7) == ["a"]
    assert schedule.take(["a"], 100.8) == []
    assert schedule.next_due() == 101.2


def test_streams_are_scheduled_independently():
    schedule = TrimSchedule(0.5)
    assert schedule.take(["a"], 100.0) == ["a"]
    assert schedule.take(["a", "b"], 100.2) == ["b"]
    assert schedule.next_due() == 100.5
    assert schedule.take([], 100.5) == ["a"]
    assert schedule.take(["b"], 100.6) == []
    assert schedule.next_due() == 100.7


def test_a_failed_trim_is_tried_again_an_interval_later():
    schedule = TrimSchedule(0.5)
    schedule.failed(schedule.take(["a"], 100.0), 100.0)
    assert schedule.next_due() == 100.5
    assert schedule.take([], 100.5) == ["a"]


def test_all_due_takes_every_waiting_trim_at_once():
    schedule = TrimSchedule(0.5)
    schedule.take(["a", "b"], 100.0)
    schedule.take(["a", "b"], 100.1)
    assert sorted(schedule.take([], 100.1, all_due=True)) == ["a", "b"]
    assert not schedule.waiting

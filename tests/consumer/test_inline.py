"""Which batches run on the event loop instead of the model's thread (``consumer.inline``):
only batches of a version measured to be quick, and not much bigger than those measured."""

from __future__ import annotations

from consumer.inline import GROWTH, INLINE_MAX_S, InlineCalls


def test_a_version_not_measured_yet_runs_on_its_thread():
    assert not InlineCalls().suits("1", 1)


def test_a_tiny_model_runs_inline_and_a_slow_one_on_its_thread():
    calls = InlineCalls(max_s=0.0005)
    calls.observe("tiny", 0.000005, 1, inline=False)  # the digits MLP: a few µs a call
    calls.observe("slow", 0.002, 1, inline=False)
    assert calls.suits("tiny", 1) and calls.suits("tiny", 2)
    assert not calls.suits("slow", 1)


def test_batches_grow_inline_only_as_far_as_calls_stay_quick():
    calls = InlineCalls(max_s=0.0005)
    calls.observe("1", 0.00001, 1, inline=False)
    assert not calls.suits("1", 3)
    calls.observe("1", 0.00002, 2, inline=True)
    calls.observe("1", 0.00004, 4, inline=True)
    calls.observe("1", 0.00008, 8, inline=True)
    assert calls.suits("1", 16) and not calls.suits("1", 17)


def test_a_request_far_bigger_than_the_batches_seen_runs_on_the_thread():
    calls = InlineCalls(max_s=0.0005)
    calls.observe("1", 0.00003, 32, inline=True)
    assert not calls.suits("1", 250_000)  # one huge request must not stall the loop
    calls.observe("1", 0.9, 250_000, inline=False)
    assert calls.suits("1", 64) and not calls.suits("1", 250_000)


def test_a_slow_inline_call_sends_batches_of_its_size_back_to_the_thread():
    calls = InlineCalls(max_s=0.0005)
    calls.observe("1", 0.00003, 32, inline=True)
    calls.observe("1", 0.002, 32, inline=True)  # the device got busy, or the OS preempted us
    assert not calls.suits("1", 32)
    assert calls.suits("1", 16)  # 8 rows in proportion, so up to twice that


def test_a_slow_call_on_the_thread_changes_nothing():
    """It may have waited for the GIL while the loop was busy: not the model's time."""
    calls = InlineCalls(max_s=0.0005)
    calls.observe("1", 0.00003, 32, inline=False)
    calls.observe("1", 0.005, 32, inline=False)
    assert calls.suits("1", 32)


def test_a_quick_call_on_the_thread_brings_its_size_back_inline():
    calls = InlineCalls(max_s=0.0005)
    calls.observe("1", 0.00003, 32, inline=True)
    calls.observe("1", 0.004, 32, inline=True)
    assert not calls.suits("1", 32)
    calls.observe("1", 0.00003, 32, inline=False)
    assert calls.suits("1", 32)


def test_versions_are_measured_apart():
    calls = InlineCalls(max_s=0.0005)
    calls.observe("1", 0.00001, 1, inline=False)
    assert calls.suits("1", 1) and not calls.suits("2", 1)


def test_the_limit_is_half_a_millisecond_and_batches_may_double():
    assert (INLINE_MAX_S, GROWTH) == (0.0005, 2)

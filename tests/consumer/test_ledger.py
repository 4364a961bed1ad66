"""The ledger of held entries: taken once, marked running and stored, acknowledged only once
stored, renewed when idle, and let go without an ack when a write is given up."""

from __future__ import annotations

import pytest

from consumer.ledger import Ledger, NotStored, Stage

A = ("s:normal", b"1-0")
B = ("s:normal", b"2-0")
C = ("s:low", b"3-0")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_entry_is_taken_once_even_when_read_again():
    ledger = Ledger()
    assert ledger.take(*A)
    assert not ledger.take(*A)  # re-read from the pending list while still held
    assert len(ledger) == 1 and A in ledger and ledger.stage(A) is Stage.DELIVERED


def test_entries_move_from_delivered_to_running_to_stored():
    ledger = Ledger()
    ledger.take(*A)
    ledger.running([A])
    assert ledger.stage(A) is Stage.RUNNING
    ledger.stored(A)
    assert ledger.stage(A) is Stage.STORED


def test_only_stored_entries_are_ackable():
    ledger = Ledger()
    for entry in (A, B, C):
        ledger.take(*entry)
    ledger.running([B])
    ledger.stored(C)
    assert ledger.ackable([A, B, C, ("gone", b"9-0")]) == [C]


def test_acknowledging_an_entry_that_is_not_stored_is_refused():
    ledger = Ledger()
    ledger.take(*A)
    ledger.running([A])
    with pytest.raises(NotStored):
        ledger.acknowledged([A])
    assert A in ledger  # still held: nothing was lost


def test_acknowledged_entries_are_forgotten():
    ledger = Ledger()
    ledger.take(*A)
    ledger.stored(A)
    ledger.acknowledged([A, ("never-held", b"1-1")])
    assert len(ledger) == 0 and ledger.stage(A) is None


def test_an_abandoned_entry_is_let_go_without_being_stored():
    ledger = Ledger()
    ledger.take(*A)
    ledger.abandon(A)
    assert A not in ledger and ledger.ackable([A]) == []


def test_entries_idle_too_long_are_listed_for_renewal_per_stream_and_renewal_resets_them():
    clock = Clock()
    ledger = Ledger(clock)
    ledger.take(*A)
    ledger.take(*C)
    clock.now += 10
    ledger.take(*B)
    assert ledger.idle_since(clock.now - 5) == {"s:normal": [b"1-0"], "s:low": [b"3-0"]}
    ledger.renewed("s:normal", [b"1-0"])
    assert ledger.idle_since(clock.now - 5) == {"s:low": [b"3-0"]}

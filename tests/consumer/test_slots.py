"""A served model's slot changes only through its transitions (``consumer.slots``): what the
reader queues and learns from its reads, what the dispatcher waits for and learns from its
calls, and what model control installs. Pure state, no Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from consumer.batcher import Queued
from consumer.model import ServedModel
from consumer.repository import load_config
from consumer.slots import FOREGROUND_QUIET_S, Delivery, ModelSlot
from protocol.keys import LANES_BY_PRIORITY, Keys, Lane
from tests.support import sim_request, write_simulated_model

KEYS = Keys("t")


class Stub:
    def unload(self) -> None: ...


@pytest.fixture
def slot(tmp_path: Path):
    write_simulated_model(tmp_path, "sim", base_ms=0, per_row_ms=0, max_batch=8, partitions=2)
    built = ModelSlot(ServedModel(load_config(tmp_path, "sim")), KEYS)
    yield built
    built.close()


def queued(slot: ModelSlot, request_id: str = "r1", *, read_at: float = 10.0) -> Queued[Delivery]:
    d = Delivery(slot.streams[1], b"1-1", sim_request(KEYS, request_id, 1_000), 1_004, read_at)
    return Queued(d, lane=1, rows=1, group="v1", arrived=read_at, deadline=read_at + 60)


def wakes(slot: ModelSlot, *changes: Callable[[], object]) -> list[bool]:
    """For each change in turn, whether it wakes the dispatcher waiting for news (one event
    loop for them all, as in a worker)."""

    async def wait(change: Callable[[], object]) -> bool:
        task = asyncio.ensure_future(slot.wait_for_news(None))
        await asyncio.sleep(0)  # waiting now
        change()
        await asyncio.sleep(0)
        done = task.done()
        task.cancel()
        return done

    async def each() -> list[bool]:
        return [await wait(change) for change in changes]

    return asyncio.run(each())


def test_a_queued_delivery_makes_the_slot_busy_until_the_queue_is_empty_between_batches(slot):
    async def check() -> None:
        slot.enqueue(queued(slot))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(slot.wait_idle(), 0.01)
        assert slot.wanted_count() == 7
        assert slot.between_batches(11.0, draining=True) == 0.0
        assert [q.item.request.id for q in slot.take_batch()] == ["r1"]
        assert slot.between_batches(11.0, draining=False) is None
        await asyncio.wait_for(slot.wait_idle(), 1)

    asyncio.run(check())


def test_a_partial_batch_waits_for_its_window_unless_every_read_group_found_the_streams_drained(
    slot,
):
    slot.enqueue(queued(slot, read_at=10.0))
    assert slot.between_batches(10.0, draining=False) == pytest.approx(slot.policy.flush_s)
    assert slot.needs_prompt_read()
    slot.read_returned("a", drained=True)
    slot.read_skipped("b")  # not read: what is queued there is unknown
    assert not slot.drained and slot.between_batches(10.0, draining=False) > 0
    slot.read_blocking("b")
    assert slot.drained and slot.between_batches(10.0, draining=False) == 0.0
    assert not slot.needs_prompt_read()


def test_a_drained_read_wakes_the_dispatcher_and_one_that_found_more_does_not(slot):
    assert wakes(
        slot,
        lambda: slot.read_returned("a", drained=False),
        lambda: slot.read_returned("a", drained=True),
        lambda: slot.read_blocking("a"),  # blocking: the next read's reply is the news
    ) == [False, True, False]


def test_what_the_dispatcher_waits_for_news_of(slot, tmp_path):
    write_simulated_model(tmp_path, "sim", base_ms=0, per_row_ms=0, max_batch=16, partitions=2)
    slot.model.backends["1"] = Stub()  # "loaded"
    assert wakes(
        slot,
        slot.notify,
        lambda: slot.enqueue(queued(slot)),  # the reader notifies once per read
        lambda: slot.install(load_config(tmp_path, "sim")),
    ) == [True, False, True]
    assert slot.policy.max_batch == 16 and slot.wanted_count() == 15


def test_the_pending_list_is_paged_through_then_new_entries_are_read(slot):
    first, second = slot.streams[0], slot.streams[3]
    assert slot.read_id(first) == "0" and slot.reading_backlog()
    slot.paged(first, "5-0")
    assert slot.read_id(first) == "5-0"
    for stream in slot.streams:
        slot.paged(stream, None)
    assert not slot.reading_backlog() and slot.read_id(first) == ">"
    slot.reread_pending([second])
    assert slot.read_id(second) == "0" and slot.read_id(first) == ">"


def test_calls_teach_the_slot_their_duration_and_which_batches_run_inline(slot):
    assert not slot.runs_inline("1", 4)
    slot.call_took("1", 4, 0.0001, inline=False)
    assert slot.service_s == 0.0001 and slot.runs_inline("1", 8)
    slot.call_took("1", 4, 0.0006, inline=False)
    assert slot.service_s == pytest.approx(0.8 * 0.0001 + 0.2 * 0.0006)


def test_a_busy_slot_reads_for_its_next_batch_without_hurrying(slot):
    slot.enqueue(queued(slot))
    slot.batch_started()
    assert not slot.needs_prompt_read()
    slot.batch_ended()
    assert slot.needs_prompt_read()


def test_queued_versions_and_expiry(slot):
    slot.enqueue(queued(slot, "r1", read_at=10.0))
    assert slot.queued_versions() == {"1"}
    assert [d.request.id for d in slot.drop_expired(100.0)] == ["r1"]
    assert slot.queued_versions() == set()


def test_a_delivery_waited_in_the_queue_then_for_its_batch():
    d = Delivery("s", b"1-1", sim_request(KEYS, "r1", 1_000), read_ms=1_004, read_at=10.0)
    assert d.waited(10.002) == pytest.approx((4.0, 2.0))
    early = Delivery("s", b"1-1", sim_request(KEYS, "r1", 1_000), read_ms=990, read_at=10.0)
    assert early.waited(9.0) == (0.0, 0.0)  # clocks a little apart never make it negative


def test_job_batches_are_small_while_synchronous_requests_come_and_full_once_they_stop(
    slot, monkeypatch
):
    now = [100.0]
    monkeypatch.setattr("consumer.slots.time.monotonic", lambda: now[0])
    low = LANES_BY_PRIORITY.index(Lane.LOW)

    def job(request_id: str) -> Queued[Delivery]:
        q = queued(slot, request_id)
        return Queued(q.item, lane=low, rows=1, group="v1", arrived=10.0, deadline=70.0)

    for i in range(8):
        slot.enqueue(job(f"j{i}"))
    assert slot.batch_limit() == 8  # no synchronous request yet: full size
    slot.enqueue(queued(slot, "sync"))
    assert [q.item.request.id for q in slot.take_batch()] == ["sync"]
    assert slot.batch_limit() == 1  # max_batch 8 // BACKGROUND_BATCH_DIVISOR
    now[0] += FOREGROUND_QUIET_S
    assert slot.batch_limit() == 8
    assert len(slot.take_batch()) == 8


def test_a_wait_for_news_ends_at_its_timeout_or_at_news_and_leaves_no_timer(slot):
    async def check() -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.wait_for(slot.wait_for_news(0.01), 5)  # no news: the window ends it
        assert loop.time() - started >= 0.01 * 0.9
        task = asyncio.ensure_future(slot.wait_for_news(60))
        await asyncio.sleep(0)  # waiting now
        slot.notify()
        await asyncio.wait_for(task, 5)  # news ends it long before its timeout
        # The 60 s timer went with the wait: a later wait is not woken by it.
        assert not [h for h in loop._scheduled if not h.cancelled()]  # type: ignore[attr-defined]
        task = asyncio.ensure_future(slot.wait_for_news(60))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not [h for h in loop._scheduled if not h.cancelled()]  # type: ignore[attr-defined]

    asyncio.run(check())

"""The events contract: what a watcher is still to be told, and the fan-out of the one events
reader to watchers and taps."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from producer.events import EventFanout, WatchedState, Watchers, unseen
from producer.jobs import watched_state
from protocol.jobs import JobRecord, JobStatus
from protocol.messages import InferResult, Status


def job(status: JobStatus) -> WatchedState:
    record = JobRecord(
        id="j",
        model="m",
        version="1",
        status=status,
        created_ms=1_000,
        deadline_ms=9_000,
        started_ms=2_000 if status not in (JobStatus.QUEUED, JobStatus.CANCELLED) else 0,
        finished_ms=3_000 if status.final else 0,
        result=InferResult("j", Status.OK, "m", "1").encode()
        if status is JobStatus.SUCCEEDED
        else b"",
        webhook="https://example.com/hook",
        webhook_events=("running", "succeeded"),
    )
    return watched_state(record)


def statuses(states: list[WatchedState]) -> list[str]:
    return [s.status for s in states]


def test_a_jobs_state_carries_the_states_it_went_through_as_get_showed_them():
    done = job(JobStatus.SUCCEEDED)
    assert statuses(list(done.chain)) == ["queued", "running", "succeeded"]
    queued, running, _ = done.chain
    assert (queued.body["started_at"], queued.body["finished_at"]) == (None, None)
    assert running.body["started_at"] is not None and running.body["finished_at"] is None
    assert "result" not in running.body and "result" in done.body
    assert queued.body == job(JobStatus.QUEUED).body
    assert done.webhook is not None and done.webhook.events == {"running", "succeeded"}
    assert statuses(list(job(JobStatus.CANCELLED).chain)) == ["queued", "cancelled"]


def test_a_watcher_is_told_each_state_after_the_one_it_saw_up_to_the_announced_one():
    done = job(JobStatus.SUCCEEDED)
    queued, running, _ = done.chain
    assert statuses(unseen(done, None, None)) == ["queued", "running", "succeeded"]
    assert statuses(unseen(done, queued, "running")) == ["running"]  # succeeded: its own entry
    assert statuses(unseen(done, queued, "succeeded")) == ["running", "succeeded"]
    assert unseen(done, running, "running") == []  # announced twice: told once
    assert unseen(done, done, "running") == []  # a late entry
    assert unseen(done, done, None) == []


def test_a_change_of_body_alone_is_told_when_the_entry_says_nothing_of_a_status():
    progress = WatchedState({"done": 1}, "in_progress", False, None)
    later = replace(progress, body={"done": 2})
    assert unseen(later, progress, None) == [later]
    assert unseen(progress, progress, None) == []


def test_the_fanout_hands_entries_to_the_watchers_of_their_object_and_calls_the_taps():
    async def go() -> None:
        fanout = EventFanout()
        taps: list[int] = []
        fanout.tap(lambda: taps.append(1))
        mine = fanout.subscribe(b"job", "a")
        other = fanout.subscribe(b"batch", "a")
        fanout.publish([(b"1-0", {b"job": b"a", b"status": b"running"}), (b"2-0", {b"job": b"b"})])
        assert await mine.next(1) == ("1-0", {b"job": b"a", b"status": b"running"})
        assert await other.next(0.01) is None
        assert fanout.position == "2-0" and taps == [1]
        fanout.unsubscribe(mine)
        fanout.unsubscribe(other)
        assert fanout.watching == 0

    asyncio.run(go())


def test_a_watcher_that_falls_behind_keeps_bounded_memory_and_knows_it_must_re_read():
    async def go() -> None:
        fanout = EventFanout()
        slow = fanout.subscribe(b"batch", "x")
        fanout.publish([(f"{i}-0".encode(), {b"batch": b"x"}) for i in range(1, 1000)])
        assert slow.overflowed
        count = 0
        while await slow.next(0) is not None:
            count += 1
        assert count == 64

    asyncio.run(go())


def test_the_registry_finds_the_kind_an_entry_names_and_the_kind_a_path_serves():
    class Batches:
        field = b"batch"
        path = "batches"

        async def state(self, object_id: str) -> WatchedState | None:
            return None

    watchers = Watchers()
    batches = Batches()
    watchers.add(batches)
    assert watchers.announced({b"batch": b"b1"}) == (batches, "b1")
    assert watchers.announced({b"job": b"j1"}) is None
    assert watchers.at("batches") is batches and watchers.at("jobs") is None

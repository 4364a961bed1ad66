"""The reclaimer against a real redis-server: it renews what this worker holds, takes over what a
dead worker held (with delivery counts), never takes what it holds itself, trims only below what
was delivered and acknowledged, prunes consumers of gone workers, and survives Redis errors."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import structlog

from consumer.ledger import Ledger
from consumer.reclaimer import Reclaimer
from protocol.keys import GROUP, Keys, Lane
from protocol.messages import FIELD
from runtime.broker import connect
from runtime.connections import RedisSettings
from runtime.loops import Loops
from tests.consumer.support import worker_context
from tests.support import until

pytestmark = pytest.mark.integration

IDLE_MS = 100


class FakeSlots:
    """The one method of ``ModelSlots`` the reclaimer uses."""

    def __init__(self, keys: Keys) -> None:
        self._streams = {"m": keys.streams("m")}

    def streams(self) -> dict[str, list[str]]:
        return self._streams


class Intake:
    """Records what the reclaimer hands over, as the reader's intake would queue it."""

    def __init__(self, room: int = 100) -> None:
        self.space = room
        self.accepted: list[tuple[str, bytes, int]] = []

    def room(self, model: str) -> int:
        return self.space

    def accept(
        self, stream: str, entries: list[Any], *, deliveries: Callable[[int], int] | None = None
    ) -> None:
        for i, (entry_id, _) in enumerate(entries):
            self.accepted.append((stream, entry_id, deliveries(i) if deliveries else 1))


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def queue(r: redis.Redis, keys: Keys, n: int, consumer: str) -> list[bytes]:
    stream = keys.stream("m", Lane.NORMAL)
    r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    ids = [r.xadd(stream, {FIELD: b"x"}) for _ in range(n)]
    r.xreadgroup(GROUP, consumer, {stream: ">"}, count=n)
    return ids


def with_reclaimer(
    redis_url: str,
    keys: Keys,
    ledger: Ledger,
    intake: Intake,
    body: Callable[[Reclaimer], Any],
    loops: Loops | None = None,
) -> None:
    async def go() -> None:
        broker = await connect(RedisSettings(url=redis_url), name="reclaimer")
        context = worker_context(
            keys.namespace,
            slots=FakeSlots(keys),
            ledger=ledger,
            loops=loops,
            max_deliveries=5,
            claim_idle_ms=IDLE_MS,
        )
        reclaimer = Reclaimer(context, broker, intake)
        try:
            await body(reclaimer)
        finally:
            await broker.aclose()

    asyncio.run(go())


def test_entries_a_dead_worker_held_past_the_idle_time_are_taken_over_with_their_count(
    r, redis_url, namespace
):
    keys = Keys(namespace)
    ids = queue(r, keys, 3, "dead")
    intake = Intake()

    async def body(reclaimer: Reclaimer) -> None:
        await asyncio.sleep(IDLE_MS / 1000 * 1.5)  # the dead worker's claims go idle
        await reclaimer.tick()

    with_reclaimer(redis_url, keys, Ledger(), intake, body)
    stream = keys.stream("m", Lane.NORMAL)
    assert intake.accepted == [(stream, i, 2) for i in ids]  # delivered twice now
    assert {c["name"]: c["pending"] for c in r.xinfo_consumers(stream, GROUP)}[b"me"] == 3


def test_entries_whose_worker_died_again_after_a_takeover_are_taken_one_per_pass(
    r, redis_url, namespace
):
    """One of them may be the poison that killed both workers: taken alone, it takes no other
    request along to its next crash."""
    keys = Keys(namespace)
    stream = keys.stream("m", Lane.NORMAL)
    ids = queue(r, keys, 3, "dead")
    r.xclaim(stream, GROUP, "died-too", 0, ids)  # taken over once; that worker died as well
    intake = Intake()

    async def body(reclaimer: Reclaimer) -> None:
        await asyncio.sleep(IDLE_MS / 1000 * 1.5)
        await reclaimer.tick()
        assert intake.accepted == [(stream, ids[0], 3)]
        await reclaimer.tick()

    with_reclaimer(redis_url, keys, Ledger(), intake, body)
    assert intake.accepted == [(stream, ids[0], 3), (stream, ids[1], 3)]


def test_nothing_is_taken_over_before_the_idle_time_or_beyond_the_room(r, redis_url, namespace):
    keys = Keys(namespace)
    queue(r, keys, 3, "slow")
    intake = Intake(room=2)

    async def body(reclaimer: Reclaimer) -> None:
        await reclaimer.tick()
        assert intake.accepted == []  # not idle long enough: the worker may only be slow
        await asyncio.sleep(IDLE_MS / 1000 * 1.5)
        await reclaimer.tick()

    with_reclaimer(redis_url, keys, Ledger(), intake, body)
    assert len(intake.accepted) == 2


@pytest.mark.serial  # bounds the idle time after renewal
def test_entries_this_worker_holds_are_renewed_not_reclaimed(r, redis_url, namespace):
    keys = Keys(namespace)
    stream = keys.stream("m", Lane.NORMAL)
    ids = queue(r, keys, 2, "me")
    ledger = Ledger()
    for entry_id in ids:
        ledger.take(stream, entry_id)
    intake = Intake()

    async def body(reclaimer: Reclaimer) -> None:
        await asyncio.sleep(IDLE_MS / 1000 * 1.5)
        await reclaimer.tick()

    with_reclaimer(redis_url, keys, ledger, intake, body)
    assert intake.accepted == []
    idle = [p["time_since_delivered"] for p in r.xpending_range(stream, GROUP, "-", "+", 10)]
    assert all(ms < IDLE_MS for ms in idle), idle  # XCLAIM JUSTID reset their idle time


def test_a_stream_is_trimmed_only_below_its_oldest_pending_entry(r, redis_url, namespace):
    keys = Keys(namespace)
    stream = keys.stream("m", Lane.NORMAL)
    ids = queue(r, keys, 4, "me")
    r.xack(stream, GROUP, ids[0], ids[1], ids[3])  # ids[2] still pending

    async def body(reclaimer: Reclaimer) -> None:
        await reclaimer.trim(stream)

    with_reclaimer(redis_url, keys, Ledger(), Intake(), body)
    assert [e[0] for e in r.xrange(stream)] == ids[2:]


def test_consumers_of_gone_workers_are_pruned_only_when_they_hold_nothing(r, redis_url, namespace):
    keys = Keys(namespace)
    stream = keys.stream("m", Lane.NORMAL)
    queue(r, keys, 1, "holds-one")
    r.xgroup_createconsumer(stream, GROUP, "empty")

    async def body(reclaimer: Reclaimer) -> None:
        await asyncio.sleep(IDLE_MS * 10 / 1000 * 1.2)
        await reclaimer.prune(stream)

    with_reclaimer(redis_url, keys, Ledger(), Intake(), body)
    names = {c["name"] for c in r.xinfo_consumers(stream, GROUP)}
    assert names == {b"holds-one"}


def test_a_redis_error_in_a_pass_is_backed_off_and_the_next_pass_runs(r, redis_url, namespace):
    keys = Keys(namespace)
    stream = keys.stream("m", Lane.NORMAL)
    r.set(stream, b"not a stream")  # every XPENDING on it fails with WRONGTYPE
    intake = Intake()
    loops = Loops(structlog.get_logger())
    backoff = loops.backoff("reclaimer", critical=False)

    async def body(reclaimer: Reclaimer) -> None:
        task = asyncio.create_task(reclaimer.run())
        await until(lambda: not backoff.healthy, 5, "the failing pass reported")
        assert not task.done()  # reported, not raised
        r.delete(stream)
        queue(r, keys, 1, "dead")
        await until(lambda: intake.accepted, 5, "the next pass to reclaim")
        # The pass reclaims before it ends, and only an ended pass reports healthy.
        await until(lambda: backoff.healthy, 5, "the pass that reclaimed to report healthy")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with_reclaimer(redis_url, keys, Ledger(), intake, body, loops)

"""One refresher per namespace: elected through Redis, publishing what every process reads."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio as aioredis
import structlog

from protocol.keys import GROUP, Keys, Lane
from protocol.registry import ModelMetadata
from protocol.stats import StatsSnapshot
from runtime.backoff import Backoff
from runtime.stats import StatsRefresher, read_snapshot, to_backlog

META = ModelMetadata("m", ("1",), "1", "simulated", (), (), 8, 1000, False, 0, {}, 2)


@pytest.fixture
def keys(namespace: str, redis_url: str) -> Iterator[Keys]:
    keys = Keys(namespace)
    with redis.Redis.from_url(redis_url) as r:
        r.hset(keys.models, "m", META.encode())
        for p in range(2):
            stream = keys.stream("m", Lane.NORMAL, p)
            r.xgroup_create(stream, GROUP, id="0", mkstream=True)
            for _ in range(p + 3):
                r.xadd(stream, {b"m": b"x"})
        r.xreadgroup(GROUP, "w", {keys.stream("m", Lane.NORMAL, 1): ">"}, count=2)
    yield keys


def refresher(
    client: aioredis.Redis, keys: Keys, me: str, seen: list[StatsSnapshot | None]
) -> StatsRefresher:
    return StatsRefresher(
        client,
        keys,
        me,
        lambda: 0,
        interval_s=0.1,
        detail_every=2,
        backoff=Backoff("stats", structlog.get_logger()),
        latest=lambda: seen[-1] if seen else None,
    )


def test_one_gateway_publishes_every_partition_and_lane_for_everyone(keys, redis_url):
    async def main() -> StatsSnapshot | None:
        client = aioredis.Redis.from_url(redis_url)
        try:
            seen: list[StatsSnapshot | None] = []
            one, two = refresher(client, keys, "gw-1", seen), refresher(client, keys, "gw-2", seen)
            await one.tick()
            await two.tick()
            assert one.leader and not two.leader  # the lease: SET NX
            assert one.published == 1 and two.published == 0
            return await read_snapshot(client, keys)
        finally:
            await client.aclose()

    snapshot = asyncio.run(main())
    assert snapshot is not None and snapshot.publisher == "gw-1"
    lanes = {(x.model, x.lane, x.partition): x for x in to_backlog(snapshot, keys).lanes}
    assert lanes[("m", Lane.NORMAL, 0)].lag == 3
    assert (lanes[("m", Lane.NORMAL, 1)].lag, lanes[("m", Lane.NORMAL, 1)].pending) == (2, 2)
    assert len(lanes) == 6  # 2 partitions x 3 lanes, from the advertised metadata


@pytest.mark.serial  # two ticks must land within a 0.3 s lease
def test_another_gateway_takes_over_once_the_publisher_is_gone(keys, redis_url):
    async def main() -> tuple[bool, str]:
        client = aioredis.Redis.from_url(redis_url)
        try:
            seen: list[StatsSnapshot | None] = []
            one, two = refresher(client, keys, "gw-1", seen), refresher(client, keys, "gw-2", seen)
            await one.tick()
            seen.append(await read_snapshot(client, keys))
            await two.tick()  # a fresh snapshot: it does nothing, not even SET NX
            assert not two.leader
            # gw-1 dies: its lease and snapshot run out after three intervals.
            await asyncio.sleep(0.35)
            seen.append(await read_snapshot(client, keys))
            await two.tick()
            snapshot = await read_snapshot(client, keys)
            assert snapshot is not None
            return two.leader, snapshot.publisher
        finally:
            await client.aclose()

    assert asyncio.run(main()) == (True, "gw-2")


def test_a_light_round_keeps_the_last_full_rounds_pending_ages(keys, redis_url):
    async def main() -> list[StatsSnapshot]:
        client = aioredis.Redis.from_url(redis_url)
        try:
            one = refresher(client, keys, "gw-1", [])
            return [await one.publish(), await one.publish()]
        finally:
            await client.aclose()

    full, light = asyncio.run(main())

    def busy(s: StatsSnapshot) -> list[object]:
        return [
            (r.partition, r.pending, r.oldest_pending_ms is not None)
            for r in s.lanes
            if r.lane == "normal"
        ]

    assert busy(full) == busy(light) == [(0, 0, False), (1, 2, True)]
    assert light.detailed_ms == full.detailed_ms

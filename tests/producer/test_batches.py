"""Listing batches (``GET /v2/batches``) against the suite's real redis-server: a page costs
two round trips whatever its size."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import redis.asyncio as aioredis

from producer.batches import read_page
from protocol.batches import BATCH_RANDOM_BYTES, BatchRecord, BatchStatus, new_batch_id
from protocol.keys import Keys


class Counting(aioredis.Connection):
    """A connection that counts what it sends: one send is one round trip (a pipeline sends
    all its commands at once)."""

    sends = 0

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        type(self).sends += 1
        await super().send_packed_command(command, check_health)


async def _seed(r: aioredis.Redis, keys: Keys, count: int) -> list[str]:
    ids = []
    for i in range(count):
        batch_id = new_batch_id(1_000 + i, os.urandom(BATCH_RANDOM_BYTES))
        record = BatchRecord(
            batch_id, BatchStatus.COMPLETED, "sim", "", 1_000 + i, 9_000, total=3, valid=3
        )
        await r.hset(keys.batch(batch_id), mapping=record.to_fields())
        await r.hset(keys.batch(batch_id, "output"), mapping={1: b"{}", 2: b"{}"})
        await r.hset(keys.batch(batch_id, "errors"), mapping={3: b"{}"})
        await r.zadd(keys.batches, {batch_id: 0})
        ids.append(batch_id)
    return ids[::-1]  # newest first


def test_a_page_of_batches_is_two_round_trips_whatever_its_size(redis_url, namespace):
    keys = Keys(namespace)

    async def go() -> None:
        counting = type("Counting", (Counting,), {"sends": 0})
        r = aioredis.Redis.from_url(redis_url, connection_class=counting)
        try:
            newest = await _seed(r, keys, 30)
            await r.delete(keys.batch(newest[1]))  # gone meanwhile: left out
            for limit in (1, 5, 25):
                before = counting.sends
                data, more = await read_page(r, keys, None, limit)
                assert counting.sends - before == 2, limit
                assert [d["id"] for d in data] == [i for i in newest[:limit] if i != newest[1]]
                assert more
                assert data[0]["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
            rest, more = await read_page(r, keys, newest[24], 25)
            assert [d["id"] for d in rest] == newest[25:] and not more
            before = counting.sends
            assert await read_page(r, keys, newest[-1], 5) == ([], False)
            assert counting.sends - before == 1  # no ids: no second round trip
        finally:
            await r.aclose()

    asyncio.run(go())


def test_a_page_spans_the_batches_of_every_slot_on_either_kind_of_redis(either_redis, namespace):
    keys = Keys(namespace)

    async def go() -> None:
        broker = await either_redis.broker()
        try:
            newest = await _seed(broker.commands, keys, 12)
            data, more = await read_page(broker.commands, keys, None, 10)
            assert [d["id"] for d in data] == newest[:10] and more
            assert {d["request_counts"]["completed"] for d in data} == {2}
        finally:
            await broker.aclose()

    asyncio.run(go())

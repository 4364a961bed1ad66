"""The on-demand loop against a real redis-server, with a stand-in worker: a model whose
requests wait is loaded; one whose load failed is tried again only after ``RETRY_FAILED_S``;
one an administrator unloaded (its load refused, ``WITHDRAWN``) is looked at again at the next
look, so that its next load call serves the requests that follow at once; how long a model's
oldest unread request has waited is read on one Redis and on a cluster alike."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis

from consumer.ondemand import Loaded, OnDemand
from protocol.keys import GROUP, Keys, Lane
from protocol.messages import FIELD
from runtime.broker import connect
from runtime.connections import RedisSettings
from tests.consumer.support import worker_context
from tests.kinds import RedisUnderTest

pytestmark = pytest.mark.integration


class Host:
    """A worker holding nothing, whose loads of model ``m`` come to ``outcomes`` in turn."""

    def __init__(self, *outcomes: Loaded) -> None:
        self.outcomes = list(outcomes)
        self.asked: list[str] = []

    def loadable(self) -> dict[str, int]:
        return {"m": 1}

    def held(self) -> dict[str, tuple[float, bool]]:
        return {}

    async def load_on_demand(self, name: str) -> Loaded:
        self.asked.append(name)
        return self.outcomes.pop(0)

    async def unload_model(self, name: str, reason: str) -> None:
        raise AssertionError("nothing is held")


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def waiting_request(r: redis.Redis, keys: Keys) -> None:
    stream = keys.stream("m", Lane.NORMAL)
    r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    r.xadd(stream, {FIELD: b"x"})


def looks(redis_url: str, namespace: str, host: Host, n: int) -> None:
    """``n`` looks of the on-demand loop (no hints, no backlog snapshot: it reads the lag)."""

    async def go() -> None:
        broker = await connect(RedisSettings(url=redis_url), name="on-demand")
        try:
            on_demand = OnDemand(worker_context(namespace, load="on-demand"), broker, host)
            for _ in range(n):
                await on_demand.tick()
        finally:
            await broker.aclose()

    asyncio.run(go())


def test_a_model_whose_requests_wait_is_loaded(r, redis_url, namespace):
    waiting_request(r, Keys(namespace))
    host = Host(Loaded.SERVING)
    looks(redis_url, namespace, host, 1)
    assert host.asked == ["m"]


def test_a_failed_load_is_not_tried_again_at_the_next_look(r, redis_url, namespace):
    waiting_request(r, Keys(namespace))
    host = Host(Loaded.FAILED, Loaded.SERVING)
    looks(redis_url, namespace, host, 2)
    assert host.asked == ["m"]


def test_a_load_refused_because_an_administrator_unloaded_it_is_no_failure(r, redis_url, namespace):
    """The administrator's next load call makes the model loadable: the requests that follow
    must not wait ``RETRY_FAILED_S`` (they did, past their deadlines)."""
    waiting_request(r, Keys(namespace))
    host = Host(Loaded.WITHDRAWN, Loaded.SERVING)
    looks(redis_url, namespace, host, 2)
    assert host.asked == ["m", "m"]  # the refused load gave its claim up, too


def test_the_oldest_unread_request_counts_on_any_partition_and_lane_read_ones_do_not(
    either_redis: RedisUnderTest, namespace: str
) -> None:
    """Partitions 0 and 1 hash to different slots (on a cluster, often different nodes)."""
    keys, now = Keys(namespace), int(time.time() * 1000)
    first, second = keys.stream("m", Lane.NORMAL, 0), keys.stream("m", Lane.HIGH, 1)
    with either_redis.client() as r:
        for stream in (first, second, keys.stream("done", Lane.LOW)):
            r.xgroup_create(stream, GROUP, id="0", mkstream=True)
        r.xadd(first, {FIELD: b"read"}, id=f"{now - 9000}-0")
        r.xreadgroup(GROUP, "w", {first: ">"}, count=1)
        r.xadd(first, {FIELD: b"x"}, id=f"{now - 2000}-0")
        r.xadd(second, {FIELD: b"x"}, id=f"{now - 6000}-0")
        r.xadd(keys.stream("done", Lane.LOW), {FIELD: b"read"}, id=f"{now - 9000}-0")
        r.xreadgroup(GROUP, "w", {keys.stream("done", Lane.LOW): ">"})

    async def go() -> tuple[int, int, int]:
        broker = await connect(RedisSettings(url=either_redis.url), name="on-demand")
        try:
            on_demand = OnDemand(worker_context(namespace, load="on-demand"), broker, Host())
            return (
                await on_demand.oldest_unread_ms("m", 2),
                await on_demand.oldest_unread_ms("done", 1),
                await on_demand.oldest_unread_ms("nothing", 3),
            )
        finally:
            await broker.aclose()

    waited, done, nothing = asyncio.run(go())
    assert 6000 <= waited < 9000
    assert done == 0
    assert nothing == 0

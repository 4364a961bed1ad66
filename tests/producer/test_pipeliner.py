"""Automatic pipelining against a real Redis: concurrent commands share round trips, a batch
never exceeds its size, an error reply fails only its own command, and a lost connection fails
every command of the batch (none hangs). Each holds on one Redis (the lean connection,
``runtime.resp``) and on a Redis Cluster (a redis-py cluster pipeline)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from inferq.redisserver import free_port
from producer.pipeliner import AutoPipeline
from runtime.broker import connect
from runtime.connections import RedisSettings

pytestmark = pytest.mark.integration


def with_pipeline(
    url: str, body: Callable[[AutoPipeline], Awaitable[None]], **options: int
) -> None:
    async def go() -> None:
        broker = await connect(RedisSettings(url=url, connect_timeout_s=0.5), name="pipeliner")
        pipeline = AutoPipeline(broker, **options)
        try:
            await body(pipeline)
        finally:
            await pipeline.close()
            await broker.aclose()

    asyncio.run(go())


def test_commands_issued_together_go_in_few_round_trips(either_redis, namespace):
    async def body(pipeline: AutoPipeline) -> None:
        key = f"{namespace}:n"
        replies = await asyncio.gather(*(pipeline.execute("INCR", key) for _ in range(200)))
        assert sorted(replies) == list(range(1, 201))
        assert pipeline.round_trips <= 3

    with_pipeline(either_redis.url, body)


def test_a_batch_never_holds_more_than_max_batch_commands(either_redis, namespace):
    async def body(pipeline: AutoPipeline) -> None:
        await asyncio.gather(*(pipeline.execute("PING") for _ in range(50)))
        assert pipeline.round_trips >= 5

    with_pipeline(either_redis.url, body, max_batch=10)


def test_an_error_reply_fails_only_its_own_command(either_redis, namespace):
    async def body(pipeline: AutoPipeline) -> None:
        text = f"{namespace}:text"
        await pipeline.execute("SET", text, "a")
        good, bad = await asyncio.gather(
            pipeline.execute("GET", text),
            pipeline.execute("XADD", text, "*", "f", "v"),  # WRONGTYPE
            return_exceptions=True,
        )
        assert good == b"a"
        assert isinstance(bad, ResponseError) and "WRONGTYPE" in str(bad)
        # Not annotated with the command: nothing the caller sent is echoed back.
        assert "XADD" not in str(bad)

    with_pipeline(either_redis.url, body)


@pytest.mark.parametrize("seeds", [1, 3], ids=["standalone", "cluster"])
def test_a_lost_connection_fails_every_command_of_the_batch(seeds):
    async def body(pipeline: AutoPipeline) -> None:
        results = await asyncio.gather(
            *(pipeline.execute("PING") for _ in range(5)), return_exceptions=True
        )
        assert all(isinstance(r, RedisConnectionError) for r in results), results

    hosts = ",".join(f"127.0.0.1:{free_port()}" for _ in range(seeds))  # nothing listens there
    with_pipeline(f"redis://{hosts}/0", body)

"""Automatic pipelining against a real redis-server: concurrent commands share round trips,
a batch never exceeds its size, an error reply fails only its own command, and a lost
connection fails every command of the batch (none hangs). Each holds over both transports: the
lean connection the gateway uses on one Redis (``runtime.resp``) and a redis-py pipeline (a
cluster)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from inferq.redisserver import free_port
from producer.pipeliner import AutoPipeline
from runtime.resp import Endpoint, RespConnection

pytestmark = pytest.mark.integration


@pytest.fixture(params=["lean", "redis-py"])
def lean(request: pytest.FixtureRequest) -> bool:
    return bool(request.param == "lean")


def with_pipeline(
    url: str, body: Callable[[AutoPipeline], Awaitable[None]], lean: bool, **options: int
) -> None:
    async def go() -> None:
        client = aioredis.Redis.from_url(url)
        endpoint = Endpoint.of(client) if lean else None
        connection = RespConnection(endpoint) if endpoint is not None else None
        pipeline = AutoPipeline(client, lean=connection, **options)
        try:
            await body(pipeline)
        finally:
            await pipeline.close()
            await client.aclose()

    asyncio.run(go())


def test_commands_issued_together_go_in_few_round_trips(redis_url, namespace, lean):
    async def body(pipeline: AutoPipeline) -> None:
        key = f"{namespace}:n"
        replies = await asyncio.gather(*(pipeline.execute("INCR", key) for _ in range(200)))
        assert sorted(replies) == list(range(1, 201))
        assert pipeline.round_trips <= 3

    with_pipeline(redis_url, body, lean)


def test_a_batch_never_holds_more_than_max_batch_commands(redis_url, namespace, lean):
    async def body(pipeline: AutoPipeline) -> None:
        await asyncio.gather(*(pipeline.execute("PING") for _ in range(50)))
        assert pipeline.round_trips >= 5

    with_pipeline(redis_url, body, lean, max_batch=10)


def test_an_error_reply_fails_only_its_own_command(redis_url, namespace, lean):
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

    with_pipeline(redis_url, body, lean)


def test_a_lost_connection_fails_every_command_of_the_batch(lean):
    async def body(pipeline: AutoPipeline) -> None:
        results = await asyncio.gather(
            *(pipeline.execute("PING") for _ in range(5)), return_exceptions=True
        )
        assert all(isinstance(r, RedisConnectionError) for r in results), results

    with_pipeline(f"redis://127.0.0.1:{free_port()}/0", body, lean)  # nothing listens there

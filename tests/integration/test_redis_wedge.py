"""A gateway or worker whose Redis pool is exhausted while Redis answers (the redis-py leak of
issue #21, defect 1, left every pooled connection stranded) says so on readiness and ends
itself after ``--redis-wedge-s``, so that its supervisor restarts it; it never sits wedged.

The pool is exhausted here the way the leak left it: every connection taken and never given
back (on the process's own event loop)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from consumer.settings import WorkerSettings
from consumer.worker import LoopCrashed, Worker
from runtime.connections import RedisSettings
from tests.support import Stack, wait_until

WEDGE_S = 2.0
POOL_WAIT_S = 1.0
"""The pool's wait for a free connection (``socket_timeout_s``, 5 s by default): each check of
the watch waits this long before its PING fails with "No connection available", and the watch
needs two failing checks, so a shorter wait ends the test sooner and tests the same thing."""


def strand_the_pool(loop: asyncio.AbstractEventLoop, commands: Any, size: int) -> list[Any]:
    """Take every connection of ``commands``' pool on ``loop`` and keep them."""

    async def take() -> list[Any]:
        return [await commands.connection_pool.get_connection() for _ in range(size)]

    return asyncio.run_coroutine_threadsafe(take(), loop).result(10)


def test_a_gateway_with_an_exhausted_pool_is_unready_and_ends_itself(
    redis_url, namespace, model_repo
):
    started: list = []
    try:
        s = Stack(redis_url, namespace, model_repo, started)
        s.add_worker(("sim",))
        g = s.start_gateway(
            redis=RedisSettings(redis_url, socket_timeout_s=POOL_WAIT_S), redis_wedge_s=WEDGE_S
        )
        s.wait_ready("sim")
        gateway = g.gateway
        assert g._loop is not None
        stranded = strand_the_pool(g._loop, gateway.redis, gateway.settings.redis.pool_size)
        with httpx.Client(base_url=s.url, timeout=10) as c:
            wait_until(
                lambda: "redis-pool" in c.get("/v2/health/ready").text, 15, "readiness to fail"
            )
            ready = c.get("/v2/health/ready")
            assert ready.status_code == 503
            wait_until(lambda: gateway.failure is not None, 30, "the gateway to end itself")
            assert "Wedged" in (gateway.failure or "")
            assert "No connection available" in (gateway.failure or "")
            assert c.get("/v2/health/ready").status_code == 503  # for good, until it exits
        assert len(stranded) == gateway.settings.redis.pool_size
    finally:
        for thing in reversed(started):
            thing.stop()


def test_a_worker_with_an_exhausted_pool_ends_itself(redis_url, namespace, model_repo):
    """``run`` raises ``LoopCrashed``, so that ``inferq worker`` exits 70 for its supervisor."""

    async def go() -> None:
        worker = Worker(
            WorkerSettings(
                redis=RedisSettings(redis_url, socket_timeout_s=POOL_WAIT_S),
                namespace=namespace,
                model_repository=model_repo,
                models=("sim",),
                block_ms=200,
                redis_wedge_s=WEDGE_S,
            )
        )
        task = asyncio.create_task(worker.run())
        await asyncio.wait_for(worker.started.wait(), 20)
        assert worker.broker is not None
        pool = worker.broker.commands.connection_pool
        stranded = [await pool.get_connection() for _ in range(worker.settings.redis.pool_size)]
        with pytest.raises(LoopCrashed, match=r"Wedged.*No connection available"):
            await asyncio.wait_for(task, 40)
        for connection in stranded:
            await pool.release(connection)

    asyncio.run(go())

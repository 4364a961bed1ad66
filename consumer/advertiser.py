"""A worker's presence in Redis: its advertisement, heartbeat, and clean withdrawal.

``SET {ns}:worker:{id}`` (with a TTL) holds the models it serves and those its repository holds
(``protocol.registry.WorkerInfo``, described afresh at every beat); ``SET
{ns}:workerstats:{id}`` (same TTL) its inference statistics (``protocol.modelstats``);
``ZADD {ns}:workers`` scores it with the Redis-clock time its heartbeat expires, so anyone can
list live workers with one ``ZRANGEBYSCORE``; ``HSET {ns}:models`` keeps each model's last
metadata for when no worker is up. Each beat also reads Redis's ``maxmemory-policy``
(``runtime.eviction``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
import structlog

from consumer.context import WorkerContext
from consumer.leases import JobLeases
from protocol.registry import WorkerInfo
from runtime.aio import cancelling
from runtime.eviction import EvictionCheck
from runtime.faults import RETRYABLE

log = structlog.get_logger("inferq.worker")


class Advertiser:
    def __init__(
        self,
        context: WorkerContext,
        redis: aioredis.Redis,
        *,
        describe: Callable[[], Awaitable[WorkerInfo]],
        statistics: Callable[[], bytes],
        eviction: EvictionCheck | None = None,
        leases: JobLeases | None = None,
    ) -> None:
        s = context.settings
        self._redis = redis
        self._keys = context.keys
        self._worker_id = context.worker_id
        self._describe = describe
        self._statistics = statistics
        self.info: WorkerInfo | None = None
        """The advertisement last published."""
        self._clock = context.clock
        self._interval_s = s.heartbeat_s
        self._ttl_ms = int(s.worker_ttl_s * 1000)
        self._eviction = eviction
        self._leases = leases
        self._backoff = context.loops.backoff("heartbeat", critical=False)

    async def publish(self) -> None:
        info = self.info = await self._describe()
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(self._keys.worker(info.id), info.encode(), px=self._ttl_ms)
        pipe.set(self._keys.worker_stats(info.id), self._statistics(), px=self._ttl_ms)
        pipe.zadd(self._keys.workers, {info.id: self._clock.now_ms() + self._ttl_ms})
        if info.models:
            pipe.hset(self._keys.models, mapping={m.name: m.encode() for m in info.models})
        if info.on_demand:
            # Loadable models are known before any worker serves them: gateways describe them,
            # and the backlog snapshot covers their streams (what on-demand loads go by).
            served = {m.name for m in info.models}
            for r in info.repository:
                if r.metadata is not None and r.name not in served:
                    pipe.hsetnx(self._keys.models, r.name, r.metadata.encode())
        # Forget workers that died without withdrawing, long after anyone could count them.
        pipe.zremrangebyscore(self._keys.workers, "-inf", self._clock.now_ms() - 10 * self._ttl_ms)
        await pipe.execute()

    async def run(self) -> None:
        """Every ``interval_s``: publish, renew the leases of the jobs this worker runs
        (``consumer.leases``) and check Redis's eviction policy; every 30 beats resynchronise
        the Redis clock. A failed beat is retried sooner, with backoff."""
        beats = 0
        while not cancelling():
            await asyncio.sleep(self._interval_s)
            try:
                if beats % 30 == 0:
                    await self._clock.sync(self._redis)
                await self.publish()
                if self._leases is not None:
                    await self._leases.renew()
                if self._eviction is not None:
                    await self._eviction.refresh(self._redis)
                beats += 1
            except RETRYABLE as e:
                await self._backoff.failed(e)
                continue
            self._backoff.succeeded()

    async def withdraw(self) -> None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.zrem(self._keys.workers, self._worker_id)
        pipe.delete(self._keys.worker(self._worker_id), self._keys.worker_stats(self._worker_id))
        await pipe.execute()

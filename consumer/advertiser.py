"""A worker's presence in Redis: its advertisement, heartbeat, and clean withdrawal.

``SET {ns}:worker:{id}`` (with a TTL) holds the models it serves; ``ZADD {ns}:workers`` scores it
with the Redis-clock time its heartbeat expires, so anyone can list live workers with one
``ZRANGEBYSCORE``; ``HSET {ns}:models`` keeps each model's last metadata for when no worker is up.
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from protocol.keys import Keys
from protocol.registry import WorkerInfo
from runtime.aio import cancelling
from runtime.connections import RedisClock

log = structlog.get_logger("inferq.worker")


class Advertiser:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        info: WorkerInfo,
        clock: RedisClock,
        *,
        interval_s: float,
        ttl_s: float,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self.info = info
        self._clock = clock
        self._interval_s = interval_s
        self._ttl_ms = int(ttl_s * 1000)

    async def publish(self) -> None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(self._keys.worker(self.info.id), self.info.encode(), px=self._ttl_ms)
        pipe.zadd(self._keys.workers, {self.info.id: self._clock.now_ms() + self._ttl_ms})
        pipe.hset(self._keys.models, mapping={m.name: m.encode() for m in self.info.models})
        # Forget workers that died without withdrawing, long after anyone could count them.
        pipe.zremrangebyscore(self._keys.workers, "-inf", self._clock.now_ms() - 10 * self._ttl_ms)
        await pipe.execute()

    async def run(self) -> None:
        beats = 0
        while not cancelling():
            await asyncio.sleep(self._interval_s)
            try:
                if beats % 30 == 0:
                    await self._clock.sync(self._redis)
                await self.publish()
                beats += 1
            except (RedisError, OSError) as e:
                log.warning("heartbeat failed", error=str(e))

    async def withdraw(self) -> None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.zrem(self._keys.workers, self.info.id)
        pipe.delete(self._keys.worker(self.info.id))
        await pipe.execute()

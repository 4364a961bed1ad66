"""Redis clients, configured once for every process, and the shared Redis clock.

redis-py (5.x and later) retries commands on connection errors and timeouts by default. inferq
turns that off: a retried XADD whose first attempt reached Redis would enqueue a request twice,
and the gateway prefers answering 503 quickly over retrying behind the caller's back. Blocking
reads get a socket timeout longer than their BLOCK argument, so an idle stream is never mistaken
for an outage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from protocol.deadline import ZERO, ClockOffset, redis_time_ms


@dataclass(frozen=True)
class RedisSettings:
    """How to reach Redis. ``redis://`` or ``rediss://`` (TLS); AUTH goes in the URL."""

    url: str = "redis://127.0.0.1:6379/0"
    socket_timeout_s: float = 5.0
    connect_timeout_s: float = 3.0
    pool_size: int = 8
    """Connections for ordinary commands; waiting requests never hold one."""


def _no_retry() -> Retry:
    return Retry(NoBackoff(), 0)


def command_client(settings: RedisSettings, *, name: str) -> aioredis.Redis:
    """A client for short commands over a bounded pool: callers queue for a connection
    instead of opening one each, so the connection count stays flat under load."""
    pool = BlockingConnectionPool.from_url(
        settings.url,
        max_connections=settings.pool_size,
        timeout=settings.socket_timeout_s,
        socket_timeout=settings.socket_timeout_s,
        socket_connect_timeout=settings.connect_timeout_s,
        retry=_no_retry(),
        client_name=name,
    )
    return aioredis.Redis.from_pool(pool)


def blocking_client(settings: RedisSettings, *, name: str, block_s: float) -> aioredis.Redis:
    """One dedicated connection for a loop of blocking reads (XREAD/XREADGROUP ... BLOCK)."""
    return aioredis.Redis.from_url(
        settings.url,
        single_connection_client=True,
        socket_timeout=block_s + settings.socket_timeout_s,
        socket_connect_timeout=settings.connect_timeout_s,
        retry=_no_retry(),
        client_name=name,
    )


def redact(url: str) -> str:
    """The URL with any password replaced, for logs and messages."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    creds, _, host = rest.rpartition("@")
    user = creds.split(":", 1)[0] if ":" in creds else ""
    return f"{scheme}://{user}:***@{host}" if user else f"{scheme}://***@{host}"


class RedisClock:
    """This process's estimate of the Redis server clock (see ``protocol.deadline``)."""

    def __init__(self) -> None:
        self.offset: ClockOffset = ZERO

    async def sync(self, redis: aioredis.Redis, samples: int = 3) -> ClockOffset:
        best: ClockOffset | None = None
        for _ in range(samples):
            before = time.time() * 1000
            seconds, micros = await redis.time()
            after = time.time() * 1000
            sample = ClockOffset.from_sample(before, redis_time_ms(seconds, micros), after)
            best = sample if best is None else best.better_of(sample)
        assert best is not None
        self.offset = best
        return best

    def now_ms(self) -> int:
        return self.offset.to_redis_ms(time.time() * 1000)

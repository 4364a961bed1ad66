"""Where Redis is (``RedisSettings``), how a URL is logged (``redact``), and the Redis clock.

The connections themselves are ``runtime.broker``'s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from protocol.deadline import ZERO, ClockOffset, redis_time_ms


@dataclass(frozen=True)
class RedisSettings:
    """How to reach Redis. ``redis://`` or ``rediss://`` (TLS); AUTH goes in the URL; several
    seed nodes of a Redis Cluster separated by commas (``redis://h1:p1,h2:p2,h3:p3``)."""

    url: str = "redis://127.0.0.1:6379/0"
    socket_timeout_s: float = 5.0
    connect_timeout_s: float = 3.0
    pool_size: int = 8
    """Connections for ordinary commands (per node of a cluster); waiting requests never hold
    one."""

    def __repr__(self) -> str:
        # Settings objects end up in logs and tracebacks: never with the password in the URL.
        return (
            f"RedisSettings(url={redact(self.url)!r}, socket_timeout_s={self.socket_timeout_s}, "
            f"connect_timeout_s={self.connect_timeout_s}, pool_size={self.pool_size})"
        )


def redact(url: str) -> str:
    """The URL with any password replaced, for logs and messages."""
    if "," in url and "://" in url.partition(",")[2]:
        return ",".join(redact(piece) for piece in url.split(","))
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

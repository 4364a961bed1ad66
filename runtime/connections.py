"""Redis clients, configured once for every process, and the shared Redis clock.

The same functions serve one Redis and a Redis Cluster: ``resolve`` asks the server which it is
(once, at start), and the client builders return a cluster client (``runtime.cluster``) for a
cluster.

redis-py (5.x and later) retries commands on connection errors and timeouts by default. inferq
turns that off: a retried XADD whose first attempt reached Redis would enqueue a request twice,
and the gateway prefers answering 503 quickly over retrying behind the caller's back. Blocking
reads get a socket timeout longer than their BLOCK argument, so an idle stream is never mistaken
for an outage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, cast

import redis
import redis.asyncio as aioredis
from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AskError, ClusterDownError, TryAgainError

from protocol.deadline import ZERO, ClockOffset, redis_time_ms
from runtime.cluster import (
    cluster_client,
    detect_cluster,
    detect_cluster_sync,
    seed_urls,
    sync_cluster_client,
)


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
    cluster: bool | None = None
    """A Redis Cluster (True) or one Redis (False); None until ``resolve`` asked the server."""


async def resolve(settings: RedisSettings) -> RedisSettings:
    """``settings`` with ``cluster`` set from the server's own answer (``INFO cluster``).

    When no seed answers, a URL naming several nodes is taken for a cluster and a single one
    for a plain Redis (the process starts, answers 503 and recovers once Redis is back; a
    plain client that later meets a cluster gets MOVED errors, which ``is_cluster_redirect``
    recognises so the process can exit and be restarted to detect again)."""
    if settings.cluster is not None:
        return settings
    found = await detect_cluster(settings.url, timeout_s=settings.connect_timeout_s)
    if found is None:
        found = len(seed_urls(settings.url)) > 1
    return replace(settings, cluster=found)


def resolve_sync(settings: RedisSettings) -> RedisSettings:
    """``resolve`` for the synchronous command-line tools."""
    if settings.cluster is not None:
        return settings
    found = detect_cluster_sync(settings.url, timeout_s=settings.connect_timeout_s)
    if found is None:
        found = len(seed_urls(settings.url)) > 1
    return replace(settings, cluster=found)


def _no_retry() -> Retry:
    return Retry(NoBackoff(), 0)


def _cluster(settings: RedisSettings, name: str, socket_timeout_s: float) -> aioredis.Redis:
    # Typed as a plain client: inferq uses only commands both kinds have, with the same
    # signatures (pipelines split per node on a cluster).
    return cast(
        aioredis.Redis,
        cluster_client(
            settings.url,
            name=name,
            socket_timeout_s=socket_timeout_s,
            connect_timeout_s=settings.connect_timeout_s,
            pool_size=settings.pool_size,
        ),
    )


def command_client(settings: RedisSettings, *, name: str) -> aioredis.Redis:
    """A client for short commands over a bounded pool: callers queue for a connection
    instead of opening one each, so the connection count stays flat under load."""
    if settings.cluster:
        return _cluster(settings, name, settings.socket_timeout_s)
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
    """One dedicated connection for a loop of blocking reads (XREAD/XREADGROUP ... BLOCK).

    On a cluster: a cluster client whose connections wait up to ``block_s`` plus the socket
    timeout; each blocking read in flight holds one connection to the node it reads from."""
    if settings.cluster:
        return _cluster(settings, name, block_s + settings.socket_timeout_s)
    return aioredis.Redis.from_url(
        settings.url,
        single_connection_client=True,
        socket_timeout=block_s + settings.socket_timeout_s,
        socket_connect_timeout=settings.connect_timeout_s,
        retry=_no_retry(),
        client_name=name,
    )


def sync_client(settings: RedisSettings) -> Any:
    """A synchronous client for the command-line tools: ``redis.Redis`` or, on a cluster,
    ``redis.cluster.RedisCluster`` (the same commands; ``scan_iter`` walks every master)."""
    if settings.cluster:
        return sync_cluster_client(settings.url, socket_timeout_s=settings.socket_timeout_s)
    return redis.Redis.from_url(
        settings.url,
        socket_timeout=settings.socket_timeout_s,
        socket_connect_timeout=settings.connect_timeout_s,
    )


def is_cluster_redirect(error: BaseException) -> bool:
    """A reply only a Redis Cluster gives (MOVED, ASK, TRYAGAIN, CLUSTERDOWN): on a cluster,
    the slot is elsewhere or between owners; from what was taken for one Redis, the server is
    a cluster after all."""
    return isinstance(error, (AskError, TryAgainError, ClusterDownError))


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

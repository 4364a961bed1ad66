"""Redis Cluster: seed lists, and redis-py's cluster client with inferq's policy.

``--redis`` names one node or several (``redis://[user:pass@]h1:p1,h2:p2,h3:p3[/0][?opts]``, or
comma-separated full URLs). The client retries nothing that may have reached Redis, queues its
callers for one of ``pool_size`` slots (connections stay O(nodes)), follows MOVED and ASK, and
reports a topology in flux as a ConnectionError. What here leans on redis-py's internals says so,
with the version it was written against (ARCHITECTURE.md, "One face for Redis").
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.connection import Connection, SSLConnection, parse_url
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    RedisClusterException,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from runtime.faults import redis_said

__all__ = ["key_slot"]


@dataclass(frozen=True, slots=True)
class Seeds:
    """A ``--redis`` value split into the node addresses and the options they share."""

    urls: tuple[str, ...]
    """One URL per seed node, each with the shared credentials and options."""
    hosts: tuple[tuple[str, int], ...]
    options: dict[str, Any]
    """Connection keyword arguments from the first URL (credentials, TLS, ``db``)."""


def seed_urls(url: str) -> list[str]:
    """One URL per node named in ``url``: a plain URL; a URL with several ``host:port``
    separated by commas (``redis://[creds@]h1:p1,h2:p2[/0][?opts]``: the credentials, path and
    query apply to every host); or several full URLs separated by commas."""
    pieces = [p.strip() for p in url.split(",") if p.strip()]
    if not pieces:
        raise ValueError("empty Redis URL")
    scheme, sep, rest = pieces[0].partition("://")
    if not sep:
        raise ValueError(f"a Redis URL starts with redis:// or rediss://, got {url!r}")
    if len(pieces) == 1 or any("://" in p for p in pieces[1:]):
        return pieces
    creds, at, first = rest.rpartition("@")
    last = pieces[-1]
    tail_at = min((i for i in (last.find("/"), last.find("?")) if i >= 0), default=len(last))
    hosts = [first, *pieces[1:-1], last[:tail_at]]
    return [f"{scheme}://{creds}{at}{h}{last[tail_at:]}" for h in hosts]


def parse_seeds(url: str) -> Seeds:
    """The seed nodes of ``url`` (see ``seed_urls``) and the options they share."""
    urls = seed_urls(url)
    options = {k: v for k, v in parse_url(urls[0]).items() if k not in ("host", "port")}
    hosts = []
    for u in urls:
        parts = urlsplit(u)
        if parts.hostname is None:
            raise ValueError(f"no host in Redis URL {u!r}")
        hosts.append((parts.hostname, parts.port or 6379))
    return Seeds(tuple(urls), tuple(hosts), options)


TRANSIENT_CLUSTER_ERRORS = (RedisClusterException, ClusterDownError, TryAgainError, AskError)
"""What a cluster says while its topology changes: no node covers a slot, CLUSTERDOWN, TRYAGAIN,
or a redirect still outstanding after redis-py followed it. Not all of these are ``RedisError``
(``RedisClusterException`` is a bare ``Exception``)."""


def torn_connection(error: BaseException) -> bool:
    """redis-py 8 (written against 8.1.0): its asyncio cluster client can raise
    ``AttributeError: 'NoneType' object has no attribute 'writelines'`` (or ``read...``) when a
    node's connection is torn down by one caller while another is still sending on it, which is
    what a master dying under load does.
    It means the connection was lost, nothing else: only that shape is recognised, so a bug of
    ours that raises AttributeError still surfaces as itself."""
    if not isinstance(error, AttributeError) or "'NoneType' object has no attribute" not in str(
        error
    ):
        return False
    # The innermost frame's file name tells redis-py's own code from ours: nothing else marks it.
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and "redis" in tb.tb_frame.f_code.co_filename


def as_connection_error(error: BaseException) -> RedisConnectionError:
    """A transient cluster error as the ``ConnectionError`` every inferq loop and handler
    already treats as "Redis is unavailable: back off / answer 503"."""
    # Only what Redis said: a pipeline's error quotes the command, payload included.
    said = redis_said(error) or type(error).__name__
    converted = RedisConnectionError(f"Redis Cluster unavailable: {said}")
    converted.__cause__ = error
    return converted


def _transient(error: BaseException) -> bool:
    # A CROSSSLOT refusal (a RedisClusterException raised by redis-py before sending) is a bug,
    # not a transient state: let it through as itself.
    return isinstance(error, TRANSIENT_CLUSTER_ERRORS) and "must map to the same" not in str(error)


_HOLDING = contextvars.ContextVar("inferq_cluster_gate", default=False)
"""Set while a task holds a slot of the gate: a pipeline re-sending a redirected command
individually must not wait for a second slot (it could wait for itself)."""


class _Gate:
    """At most ``size`` commands or pipelines of one client in flight; the rest wait."""

    def __init__(self, size: int) -> None:
        self._sem = asyncio.Semaphore(size)

    async def run(self, call: Any) -> Any:
        if _HOLDING.get():
            return await call()
        async with self._sem:
            token = _HOLDING.set(True)
            try:
                return await call()
            finally:
                _HOLDING.reset(token)


class GatedPipeline(ClusterPipeline):
    """A cluster pipeline (split per node, sent to the nodes concurrently, not atomic unless
    made with ``transaction=True`` over one slot) that waits for a slot of its client's gate."""

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> Any:
        # redis-py 8.1.0: ``cluster_client`` is the pipeline's (undocumented) client attribute.
        client = cast(GatedCluster, self.cluster_client)
        gate: _Gate = client._inferq_gate
        parent = cast(Any, super())

        async def call() -> Any:
            try:
                replies = await parent.execute(
                    raise_on_error=raise_on_error, allow_redirections=allow_redirections
                )
            except TRANSIENT_CLUSTER_ERRORS as e:
                if _transient(e):
                    await client.refresh_topology()
                    raise as_connection_error(e) from e
                raise
            except (RedisConnectionError, RedisTimeoutError, OSError):
                # A plain command marks the slot table stale after a connection error; a
                # pipeline does not (with no retries), so it would keep sending to a dead
                # master after its replica took over. Re-read the table here.
                await client.refresh_topology()
                raise
            except AttributeError as e:
                if not torn_connection(e):
                    raise
                await client.refresh_topology()
                raise RedisConnectionError(f"connection to a cluster node lost ({e})") from e
            return [as_connection_error(r) if _transient(r) else r for r in replies]

        return await gate.run(call)


TOPOLOGY_REFRESH_MIN_S = 0.25
"""Several readers losing one master at once re-read the slot table once, not once each."""


class GatedCluster(RedisCluster):
    """``RedisCluster`` whose commands and pipelines queue for one of ``pool_size`` slots."""

    def __init__(self, *args: Any, pool_size: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._inferq_gate = _Gate(pool_size)
        self._inferq_refresh = asyncio.Lock()
        self._inferq_refreshed = 0.0

    async def refresh_topology(self) -> None:
        """Re-read the slot table (``CLUSTER SLOTS`` from a node that answers), at most every
        ``TOPOLOGY_REFRESH_MIN_S``. Errors are swallowed: during a failover no node may cover
        a slot yet, and the caller backs off and tries again."""
        async with self._inferq_refresh:
            if time.monotonic() - self._inferq_refreshed < TOPOLOGY_REFRESH_MIN_S:
                return
            self._inferq_refreshed = time.monotonic()
            with contextlib.suppress(Exception):
                await self.nodes_manager.initialize()
                # redis-py 8.1.0 (private): it finds the keys of a command with movable keys
                # by COMMAND GETKEYS on one node, chosen when the client initialised; only its
                # own full re-initialisation (after a plain command's connection error, never a
                # pipeline's) moves it. A pipeline would otherwise ask a dead master forever.
                self.commands_parser.node = self.nodes_manager.default_node

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        parent = cast(Any, super())

        async def call() -> Any:
            try:
                return await parent.execute_command(*args, **kwargs)
            except TRANSIENT_CLUSTER_ERRORS as e:
                if _transient(e):
                    raise as_connection_error(e) from e
                raise
            except (RedisConnectionError, RedisTimeoutError, OSError):
                # Usually redis-py has marked the slot table stale already, but not when the
                # error came from finding the command's keys (see refresh_topology).
                await self.refresh_topology()
                raise
            except AttributeError as e:
                if not torn_connection(e):
                    raise
                await self.refresh_topology()
                raise RedisConnectionError(f"connection to a cluster node lost ({e})") from e

        return await self._inferq_gate.run(call)

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> Any:
        if shard_hint:
            raise ValueError("shard_hint is not supported on a cluster")
        return GatedPipeline(self, transaction)  # type: ignore[abstract]


def _node_options(url: str) -> dict[str, Any]:
    """Connection keyword arguments every node of the cluster at ``url`` shares (credentials,
    TLS), without host, port, database or connection class."""
    options = dict(parse_seeds(url).options)
    options.pop("db", None)  # a cluster has only database 0; redis-py refuses any other
    options.pop("connection_class", None)
    return options


def node_connection(url: str) -> tuple[type[Connection], dict[str, Any]]:
    """How to open a connection of one's own to a node of the cluster at ``url``: redis-py's
    connection class (TLS or not) and its keyword arguments, host and port left out."""
    kind = parse_seeds(url).options.get("connection_class", Connection)
    return kind, _node_options(url)


def cluster_client(
    url: str,
    *,
    name: str,
    socket_timeout_s: float | None,
    connect_timeout_s: float,
    pool_size: int,
) -> GatedCluster:
    """An asyncio Redis Cluster client with inferq's policy (see the module docstring)."""
    kind, options = node_connection(url)
    if issubclass(kind, SSLConnection):
        options["ssl"] = True
    return GatedCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in parse_seeds(url).hosts],
        pool_size=pool_size,
        # Per node: the gate keeps it at pool_size; the margin covers redirected commands of a
        # pipeline re-sent while its slot is held.
        max_connections=2 * pool_size + 2,
        retry=Retry(NoBackoff(), 0),
        reinitialize_steps=0,  # a MOVED patches its slot instead of closing every connection
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s,
        client_name=name,
        **options,
    )


def group_by_slot(keys: Sequence[str]) -> dict[int, list[str]]:
    """``keys`` grouped by hash slot, in their order: what one multi-key command may take."""
    groups: dict[int, list[str]] = {}
    for key in keys:
        groups.setdefault(key_slot(key.encode()), []).append(key)
    return groups

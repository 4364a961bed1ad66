"""The Redis inferq runs on, behind one face: chosen once at start, the same calls on one Redis
and on a Redis Cluster, so no caller asks which it has (Dramatiq's ``Broker``; ARCHITECTURE.md,
"One face for Redis").

``connect`` asks the server (``INFO cluster``) and returns a ``StandaloneBroker`` or a
``ClusterBroker``. What every gateway, worker and tool needs from Redis is here:
``commands`` (a redis-py client: ordinary commands and pipelines), ``batch`` (commands in one
round trip: the gateway's ``AutoPipeline``, the worker's result flushes), ``script``,
``colocated`` (which keys one command may name together), ``blocking_reads`` and ``queue_wait``
(``WAIT`` on the node that owns a key).

redis-py retries commands on connection errors and timeouts by default; inferq turns that off:
a retried XADD whose first attempt reached Redis would enqueue a request twice, and a gateway
answers 503 quickly rather than retry behind its caller's back.
"""

from __future__ import annotations

import abc
import hashlib
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, ClassVar, cast

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError

from runtime import lookup
from runtime.cluster import (
    TRANSIENT_CLUSTER_ERRORS,
    GatedCluster,
    as_connection_error,
    cluster_client,
    group_by_slot,
    node_connection,
    seed_urls,
)
from runtime.connections import RedisSettings
from runtime.readconn import BlockingReads, NodeReads, SlotReads
from runtime.resp import Command, Endpoint, RespConnection


def _no_retry() -> Retry:
    return Retry(NoBackoff(), 0)


def _looked_up(url: str) -> dict[str, Any]:
    """A redis-py client's connection class for ``url``: one that looks its host up as the lean
    connection does (``runtime.lookup``), where ``url`` names a host."""
    kind = lookup.connection_class(url)
    return {} if kind is None else {"connection_class": kind}


class Script:
    """One of inferq's Lua scripts, on the broker that made it (``Broker.script``).

    Never through redis-py's ``register_script`` on a pipeline: redis-py 8.1.0's
    ``Pipeline.execute`` first sends ``SCRIPT EXISTS`` on a pool connection it takes outside the
    ``try/finally`` that gives it back, so a timeout there (a Redis stall) strands that
    connection for good (/work/team/upstream-redis-py.md). A pipeline gets ``EVAL`` with the
    script's text instead (Redis caches it by its SHA1 all the same); a call on its own is
    ``EVALSHA``, and ``EVAL`` once Redis answers ``NOSCRIPT``."""

    def __init__(self, broker: Broker, text: str) -> None:
        self._broker = broker
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()

    async def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        """Run the script now; its reply (an error reply raises)."""
        commands = self._broker.commands
        try:
            return await cast(Any, commands.evalsha(self.sha, len(keys), *keys, *args))
        except NoScriptError:  # Redis restarted or failed over since: EVAL caches it again
            return await cast(Any, commands.eval(self.text, len(keys), *keys, *args))

    def queue(self, pipe: Pipeline, keys: Sequence[Any], args: Sequence[Any]) -> None:
        """Queue the script on a pipeline of the broker's ``commands`` (either kind)."""
        pipe.execute_command("EVAL", self.text, len(keys), *keys, *args)

    def command(self, keys: Sequence[Any], args: Sequence[Any]) -> Command:
        """The script as one command of a ``Broker.batch``: ``EVAL`` with its text, as
        ``queue`` puts it on a pipeline."""
        return ("EVAL", self.text, len(keys), *keys, *args)

    async def batch(
        self, calls: Sequence[tuple[Sequence[Any], Sequence[Any]]], then: Sequence[Command] = ()
    ) -> list[Any]:
        """Run the script once per ``(keys, args)`` of ``calls``, followed by the commands
        ``then``, in one round trip (``Broker.batch``); the scripts' replies in order, an error
        reply as its exception (not raised). ``EVALSHA``, and ``EVAL`` in a second round trip for
        the calls Redis answered ``NOSCRIPT`` (it restarted or failed over: those ran nothing,
        and run after ``then``, which must not depend on them). Raises as ``Broker.batch``."""
        sent = [("EVALSHA", self.sha, len(keys), *keys, *args) for keys, args in calls]
        replies = await self._broker.batch([*sent, *then])
        replies = replies[: len(sent)]
        missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if missing:
            again = [("EVAL", self.text, *sent[i][2:]) for i in missing]
            for i, reply in zip(missing, await self._broker.batch(again), strict=True):
                replies[i] = reply
        return replies

    async def per_key(self, keys: Sequence[str], args: Sequence[Any]) -> list[Any]:
        """Run a script whose reply is one item per key over ``keys``: once per colocated group
        (a script may touch the keys of one slot only), pipelined, replies in ``keys``' order."""
        groups = self._broker.colocated(keys)
        if len(groups) <= 1:
            return list(await self(keys, args)) if keys else []
        pipe = self._broker.commands.pipeline(transaction=False)
        for members in groups:
            self.queue(pipe, members, args)
        by_key: dict[str, Any] = {}
        for members, reply in zip(groups, await pipe.execute(), strict=True):
            by_key.update(zip(members, reply, strict=True))
        return [by_key[k] for k in keys]


class Broker(abc.ABC):
    """The Redis of this process: one implementation per kind of deployment."""

    kind: ClassVar[str]
    """``standalone`` or ``cluster``: for logs, never for a caller to branch on."""
    commands: aioredis.Redis
    """Ordinary commands and pipelines, over a bounded pool: callers queue for a connection
    instead of opening one each. Typed as a plain client: inferq uses only commands both kinds
    have, with the same signatures (pipelines split per node on a cluster, not atomic)."""

    def __init__(self, settings: RedisSettings) -> None:
        self.settings = settings

    def script(self, text: str) -> Script:
        return Script(self, text)

    @abc.abstractmethod
    async def batch(self, commands: Sequence[Command]) -> list[Any]:
        """Send ``commands`` together; their replies in order, an error reply as its exception
        (not raised). Raises ConnectionError or TimeoutError when the batch as a whole fails."""

    @abc.abstractmethod
    def colocated(self, keys: Sequence[str]) -> list[list[str]]:
        """``keys`` in groups that one command or script may name together, in their order:
        all of them on one Redis, one group per hash slot on a cluster."""

    @abc.abstractmethod
    async def queue_wait(self, pipe: Pipeline, key: str, *, replicas: int, timeout_ms: int) -> None:
        """Queue ``WAIT replicas timeout_ms`` on ``pipe``, on the node that owns ``key``: it
        covers the writes queued before it there."""

    @abc.abstractmethod
    def blocking_reads(self, key: str, *, name: str, block_ms: int) -> BlockingReads:
        """A connection of its own for a loop of reads that block up to ``block_ms``, on the
        node that owns ``key`` (``runtime.readconn``); the loop closes it."""

    @abc.abstractmethod
    def pool_counts(self) -> dict[str, int]:
        """The command pool's connections: ``in_use`` and ``idle`` (summed over the nodes of a
        cluster), for the pool gauge and the chaos tests."""

    async def answers_afresh(self) -> bool:
        """Whether Redis answers ``PING`` on a connection opened now, outside the pool (the
        first seed that answers, on a cluster): what tells a process wedged on its own
        connections from a Redis that is down (``runtime.wedge``)."""
        for seed in seed_urls(self.settings.url):
            client = _fresh_client(seed, self.settings)
            try:
                await client.ping()
                return True
            except (RedisError, OSError):
                continue
            finally:
                await client.aclose()
        return False

    async def aclose(self) -> None:
        await self.commands.aclose()


class StandaloneBroker(Broker):
    """One Redis: redis-py over a bounded pool for commands, ``runtime.resp`` for batches and
    blocking reads (where redis-py's per-round-trip cost was the gateway's largest)."""

    kind = "standalone"

    def __init__(self, settings: RedisSettings, *, name: str) -> None:
        super().__init__(settings)
        pool = BlockingConnectionPool.from_url(
            settings.url,
            max_connections=settings.pool_size,
            timeout=settings.socket_timeout_s,
            socket_timeout=settings.socket_timeout_s,
            socket_connect_timeout=settings.connect_timeout_s,
            retry=_no_retry(),
            client_name=name,
            **_looked_up(settings.url),
        )
        self.commands = aioredis.Redis.from_pool(pool)
        self._endpoint = Endpoint.of(self.commands)
        self._lean = RespConnection(self._endpoint)

    async def batch(self, commands: Sequence[Command]) -> list[Any]:
        return await self._lean.execute(commands)

    def colocated(self, keys: Sequence[str]) -> list[list[str]]:
        return [list(keys)] if keys else []

    def pool_counts(self) -> dict[str, int]:
        # redis-py 8.1.0 counts them in private sets only.
        pool = self.commands.connection_pool
        in_use = len(pool._in_use_connections)
        return {"in_use": in_use, "idle": len(pool._available_connections)}

    async def queue_wait(self, pipe: Pipeline, key: str, *, replicas: int, timeout_ms: int) -> None:
        pipe.execute_command("WAIT", replicas, timeout_ms)

    def blocking_reads(self, key: str, *, name: str, block_ms: int) -> BlockingReads:
        # A reply timeout longer than the block, so an idle stream is not taken for an outage.
        timeout_s = block_ms / 1000 + self.settings.socket_timeout_s
        endpoint = replace(self._endpoint, client_name=name, reply_timeout_s=timeout_s)
        return NodeReads(endpoint, self.commands)

    async def aclose(self) -> None:
        await self._lean.close()
        await super().aclose()


class ClusterBroker(Broker):
    """Redis Cluster: ``runtime.cluster``'s gated client for commands and batches (routed per
    slot), a connection per slot's master for blocking reads."""

    kind = "cluster"

    def __init__(self, settings: RedisSettings, *, name: str) -> None:
        super().__init__(settings)
        self._cluster: GatedCluster = cluster_client(
            settings.url,
            name=name,
            socket_timeout_s=settings.socket_timeout_s,
            connect_timeout_s=settings.connect_timeout_s,
            pool_size=settings.pool_size,
        )
        self.commands = cast(aioredis.Redis, self._cluster)
        self._node_connection = node_connection(settings.url)

    async def batch(self, commands: Sequence[Command]) -> list[Any]:
        pipe = self._cluster.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        return replies

    def colocated(self, keys: Sequence[str]) -> list[list[str]]:
        return list(group_by_slot(keys).values())

    def pool_counts(self) -> dict[str, int]:
        # redis-py 8.1.0: each ClusterNode keeps its connections and the free ones privately.
        nodes = self._cluster.get_nodes()
        made = sum(len(n._connections) for n in nodes)
        idle = sum(len(n._free) for n in nodes)
        return {"in_use": made - idle, "idle": idle}

    async def queue_wait(self, pipe: Pipeline, key: str, *, replicas: int, timeout_ms: int) -> None:
        try:
            await self._cluster.initialize()  # the slot table, once
            node = self._cluster.get_node_from_key(key)
        except TRANSIENT_CLUSTER_ERRORS as e:  # no node covers the slot (mid-failover)
            raise as_connection_error(e) from e
        pipe.execute_command("WAIT", replicas, timeout_ms, target_nodes=node)

    def blocking_reads(self, key: str, *, name: str, block_ms: int) -> BlockingReads:
        kind, options = self._node_connection
        s = self.settings

        def endpoint(host: str, port: int) -> Endpoint:
            return Endpoint.from_kwargs(
                kind,
                {
                    **options,
                    "host": host,
                    "port": port,
                    "client_name": name,
                    "socket_timeout": block_ms / 1000 + s.socket_timeout_s,
                    "socket_connect_timeout": s.connect_timeout_s,
                },
            )

        return SlotReads(self._cluster, key, endpoint)


def _fresh_client(seed: str, settings: RedisSettings) -> aioredis.Redis:
    """A client of one node for one question, over a connection of its own (closed after)."""
    return aioredis.Redis.from_url(
        seed,
        socket_timeout=settings.connect_timeout_s,
        socket_connect_timeout=settings.connect_timeout_s,
        retry=_no_retry(),
        **_looked_up(seed),
    )


async def is_cluster(settings: RedisSettings) -> bool:
    """Whether ``settings.url`` names a Redis Cluster, as the first seed that answers says
    (``INFO cluster``). When none answers, several seeds mean a cluster and one a plain Redis
    (the process starts, answers 503 and recovers once Redis is back)."""
    for seed in seed_urls(settings.url):
        client = _fresh_client(seed, settings)
        try:
            info = await client.info("cluster")
            return bool(isinstance(info, dict) and int(info.get("cluster_enabled", 0)))
        except (RedisError, OSError):
            continue
        finally:
            await client.aclose()
    return len(seed_urls(settings.url)) > 1


async def connect(settings: RedisSettings, *, name: str) -> Broker:
    """The broker for the Redis at ``settings.url``; ``name`` is its connections' client name.
    Connections open on first use, so this succeeds while Redis is down."""
    if await is_cluster(settings):
        return ClusterBroker(settings, name=name)
    return StandaloneBroker(settings, name=name)

"""Dedicated connections for loops of blocking stream reads (``XREAD``/``XREADGROUP ... BLOCK``).

A blocked connection carries nothing else, so each loop owns one, and another task may wake it
early with ``CLIENT UNBLOCK`` (the worker's reader, when what it should read changes). Each is a
``runtime.resp`` connection; its replies are parsed here, once, into redis-py's shape:
``[(stream, [(entry id, {field: value} or None for an entry deleted while pending)])]``.

- ``NodeReads`` (one Redis): a connection to the server, woken through the command client.
- ``SlotReads`` (Redis Cluster): a connection to the master of one hash slot, opened where the
  cluster client's slot table says that slot lives. After a ``MOVED`` it reads from the named
  node; after a connection error (a master that died) it refreshes the slot table first, so it
  reaches the promoted replica without a restart. It is woken on the same node (client ids are
  per node).

A loop calls ``recover`` after any failed read: it re-aims the connection (``reset``), then
reads again at once after a MOVED, or backs off.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import MovedError, RedisError

from runtime.backoff import Backoff
from runtime.cluster import (
    TRANSIENT_CLUSTER_ERRORS,
    GatedCluster,
    as_connection_error,
    key_slot,
)
from runtime.resp import Command, Endpoint, RespConnection

StreamReply = list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]
"""``[(stream, [(entry id, fields)])]``."""
GroupReply = list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes] | None]]]]
"""The same, where a pending entry deleted since it was read has no fields (None)."""


async def recover(reads: BlockingReads, error: BaseException, backoff: Backoff) -> None:
    """After a failed read: re-aim ``reads``; read again at once if a MOVED named where the
    slot went, else back off (the failure is recorded either way, for readiness)."""
    if await reads.reset(error):
        backoff.record(error)
    else:
        await backoff.failed(error)


def stream_reply(raw: Any) -> GroupReply:
    """An ``XREAD``/``XREADGROUP`` reply as RESP2 sends it, with each entry's fields as a dict."""
    return [
        (stream, [(entry_id, _pairs(flat)) for entry_id, flat in entries])
        for stream, entries in raw or []
    ]


def _pairs(flat: list[Any] | None) -> dict[bytes, bytes] | None:
    if flat is None:
        return None
    it = iter(flat)
    return dict(zip(it, it, strict=True))


def _streams(streams: Mapping[str, str]) -> tuple[Any, ...]:
    return ("STREAMS", *streams, *streams.values())


def _count_block(count: int, block_ms: int | None) -> tuple[Any, ...]:
    return ("COUNT", count) if block_ms is None else ("COUNT", count, "BLOCK", block_ms)


class BlockingReads(abc.ABC):
    """A connection of its own for a loop of stream reads; where it connects and how it is woken
    are the subclasses'."""

    _connection: RespConnection | None

    @abc.abstractmethod
    async def _open(self) -> RespConnection: ...

    @abc.abstractmethod
    async def _wake(self, client_id: int) -> None: ...

    @abc.abstractmethod
    async def reset(self, error: BaseException) -> bool:
        """After a failed read: re-aim the connection; True when it may read again at once."""

    async def xread(
        self,
        streams: Mapping[str, str],
        *,
        count: int,
        block_ms: int | None = None,
        before: Sequence[Command] = (),
    ) -> StreamReply:
        """``XREAD`` of ``streams`` (name -> last id read); ``before``: commands sent ahead of it
        in the same round trip. An error reply to any of them is raised."""
        command = ("XREAD", *_count_block(count, block_ms), *_streams(streams))
        return cast(StreamReply, await self._read([*before, command]))  # XREAD has no None

    async def xreadgroup(
        self,
        group: str,
        consumer: str,
        streams: Mapping[str, str],
        *,
        count: int,
        block_ms: int | None = None,
    ) -> GroupReply:
        command = (
            "XREADGROUP",
            "GROUP",
            group,
            consumer,
            *_count_block(count, block_ms),
            *_streams(streams),
        )
        return await self._read([command])

    async def _read(self, commands: list[Command]) -> GroupReply:
        connection = self._connection or await self._open()
        replies = await connection.execute(commands)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return stream_reply(replies[-1])

    async def unblock(self) -> None:
        """Wake a read blocked on this connection now (it returns nothing)."""
        connection = self._connection
        if connection is not None and connection.open and connection.client_id is not None:
            await self._wake(connection.client_id)

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.close()


class NodeReads(BlockingReads):
    """One Redis: the loop's own connection, woken through the command client."""

    def __init__(self, endpoint: Endpoint, commands: aioredis.Redis) -> None:
        self._connection = RespConnection(endpoint)
        self._endpoint = endpoint
        self._commands = commands

    async def _open(self) -> RespConnection:
        self._connection = RespConnection(self._endpoint)  # only after aclose
        return self._connection

    async def reset(self, error: BaseException) -> bool:
        """Nothing to re-aim: the connection reconnects to the one server by itself."""
        return False

    async def _wake(self, client_id: int) -> None:
        await self._commands.client_unblock(client_id)


class SlotReads(BlockingReads):
    """Redis Cluster: one connection to the master of ``key``'s slot (see the module doc)."""

    def __init__(
        self, cluster: GatedCluster, key: str, endpoint: Callable[[str, int], Endpoint]
    ) -> None:
        self._cluster = cluster
        self.slot = key_slot(key.encode())
        self._endpoint = endpoint
        self._connection = None
        self._address: tuple[str, int] | None = None
        self._redirect: tuple[str, int] | None = None

    @property
    def address(self) -> tuple[str, int] | None:
        """The node the connection is (or was last) open to."""
        return self._address

    async def _open(self) -> RespConnection:
        if self._redirect is not None:
            host, port = self._redirect
            self._redirect = None
        else:
            try:
                await self._cluster.initialize()
                node = self._cluster.nodes_manager.get_node_from_slot(self.slot)
            except TRANSIENT_CLUSTER_ERRORS as e:  # no node covers the slot (mid-failover)
                raise as_connection_error(e) from e
            host, port = str(node.host), int(node.port)
        self._connection = RespConnection(self._endpoint(host, port))
        self._address = (host, port)
        return self._connection

    async def reset(self, error: BaseException) -> bool:
        """Drop the connection: follow a MOVED (True: read again at once), else re-read the slot
        table (False: back off first)."""
        with contextlib.suppress(RedisError, OSError):
            await self.aclose()
        await self._cluster.refresh_topology()  # after a MOVED the rest moved too, probably
        if isinstance(error, MovedError):
            self._redirect = (error.host, int(error.port))
            return True
        return False

    async def _wake(self, client_id: int) -> None:
        if self._address is None:
            return
        node = self._cluster.nodes_manager.get_node(*self._address)
        if node is not None:
            await self._cluster.execute_command("CLIENT UNBLOCK", client_id, target_nodes=node)

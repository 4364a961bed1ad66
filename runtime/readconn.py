"""Dedicated connections for loops of blocking reads that another task may need to wake.

A worker's reader blocks in ``XREADGROUP ... BLOCK`` and is woken early with ``CLIENT UNBLOCK
<id>`` when what it should read changes. That needs the id of exactly the connection that
blocks, so a reader owns one connection and asks for its id:

- ``ReadConnection`` (one Redis): the process's blocking client, unblocked through its command
  client.
- ``SlotReadConnection`` (Redis Cluster): one connection to the master that owns one hash slot,
  opened where the cluster client's slot table says that slot lives. A ``MOVED`` reply goes to the
  named node; a connection error (a master that died) refreshes the slot table first, so after a
  failover the reader reaches the promoted replica without a restart. Its ``CLIENT UNBLOCK``
  goes to the same node, since client ids are per node.

Both give the same four calls: ``connection``, ``reset``, ``unblock`` and ``aclose``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import MovedError, RedisError

from runtime.cluster import (
    TRANSIENT_CLUSTER_ERRORS,
    GatedCluster,
    as_connection_error,
    key_slot,
)


class BlockingReads(Protocol):
    async def connection(self) -> aioredis.Redis: ...

    async def reset(self, error: BaseException | None = None) -> bool: ...

    async def unblock(self, client_id: int) -> None: ...

    async def aclose(self) -> None: ...


class ReadConnection:
    """One Redis: the reader's own blocking client, woken through the command client."""

    def __init__(self, reader: aioredis.Redis, commands: aioredis.Redis) -> None:
        self._reader = reader
        self._commands = commands

    async def connection(self) -> aioredis.Redis:
        return self._reader

    async def reset(self, error: BaseException | None = None) -> bool:
        """Nothing to re-aim: the client reconnects to the one server by itself."""
        return False

    async def unblock(self, client_id: int) -> None:
        await self._commands.client_unblock(client_id)

    async def aclose(self) -> None:
        await self._reader.aclose()


class SlotReadConnection:
    """Redis Cluster: one connection to the master of ``key``'s slot (see the module doc)."""

    def __init__(
        self,
        cluster: GatedCluster,
        key: str,
        *,
        name: str,
        socket_timeout_s: float,
        connect_timeout_s: float,
        options: dict[str, Any],
    ) -> None:
        self._cluster = cluster
        self.slot = key_slot(key.encode())
        self._name = name
        self._socket_timeout_s = socket_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._options = options
        self._client: aioredis.Redis | None = None
        self._address: tuple[str, int] | None = None
        self._redirect: tuple[str, int] | None = None

    @property
    def address(self) -> tuple[str, int] | None:
        """The node the connection is (or was last) open to."""
        return self._address

    async def connection(self) -> aioredis.Redis:
        if self._client is not None:
            return self._client
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
        self._client = aioredis.Redis(
            host=host,
            port=port,
            single_connection_client=True,
            socket_timeout=self._socket_timeout_s,
            socket_connect_timeout=self._connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
            client_name=self._name,
            **self._options,
        )
        self._address = (host, port)
        return self._client

    async def reset(self, error: BaseException | None = None) -> bool:
        """Drop the connection after ``error``: follow a MOVED (True: read again at once), else
        re-read the slot table (False: back off first)."""
        await self._close()
        await self._cluster.refresh_topology()  # after a MOVED the rest moved too, probably
        if isinstance(error, MovedError):
            self._redirect = (error.host, int(error.port))
            return True
        return False

    async def unblock(self, client_id: int) -> None:
        if self._address is None:
            return
        node = self._cluster.nodes_manager.get_node(*self._address)
        if node is not None:
            await self._cluster.execute_command("CLIENT UNBLOCK", client_id, target_nodes=node)

    async def aclose(self) -> None:
        await self._close()

    async def _close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(RedisError, OSError):
                await client.aclose()

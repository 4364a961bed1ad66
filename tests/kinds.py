"""One Redis and a Redis Cluster side by side, for tests that must hold on both brokers
(``runtime.broker``): the ``either_redis`` fixture (tests/conftest.py) gives each in turn."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import redis
import redis.cluster

from runtime.broker import Broker, connect
from runtime.connections import RedisSettings


@dataclass(frozen=True)
class RedisUnderTest:
    kind: str
    """``standalone`` or ``cluster``, as ``Broker.kind`` says."""
    url: str
    ports: tuple[int, ...]

    @contextmanager
    def client(self) -> Iterator[Any]:
        """A synchronous client for a test's own reads and writes (cluster-aware on a
        cluster)."""
        if self.kind == "cluster":
            client: Any = redis.cluster.RedisCluster(host="127.0.0.1", port=self.ports[0])
        else:
            client = redis.Redis.from_url(self.url)
        try:
            yield client
        finally:
            client.close()

    def clients_named(self, name: str) -> list[tuple[int, dict[str, Any]]]:
        """``(port, CLIENT LIST entry)`` of every connection called ``name``, on every node."""
        found = []
        for port in self.ports:
            with redis.Redis(port=port) as r:
                found += [(port, c) for c in r.client_list() if c["name"] == name]
        return found

    def kill_clients(self, name: str) -> None:
        """``CLIENT KILL`` every connection called ``name``, wherever it is."""
        for port, c in self.clients_named(name):
            with redis.Redis(port=port) as r:
                r.client_kill_filter(_id=c["id"])

    async def broker(self, name: str = "inferq-test", **settings: Any) -> Broker:
        return await connect(RedisSettings(url=self.url, **settings), name=name)

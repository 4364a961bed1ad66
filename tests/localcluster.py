"""A private Redis Cluster on free loopback ports, for the test suite and the benchmarks.

``LocalCluster(masters=3, replicas=1)`` starts ``masters * (1 + replicas)`` ``redis-server``
processes with ``--cluster-enabled yes``, joins them with ``redis-cli --cluster create`` and
waits until every node reports ``cluster_state:ok`` and agrees on who owns every slot. ``stop``
removes everything it started. ``kill`` SIGKILLs one node, as a crash would, so a test can watch
its replica take over (``wait_promoted``).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass
from typing import Any

import redis
from redis.crc import key_slot

from inferq.redisserver import INSTALL_HINT, RedisServer, RedisServerError, free_port


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """One node as ``CLUSTER NODES`` describes it."""

    node_id: str
    port: int
    master: bool
    master_id: str | None
    slots: tuple[tuple[int, int], ...]
    failed: bool

    def owns(self, slot: int) -> bool:
        return any(lo <= slot <= hi for lo, hi in self.slots)


class LocalCluster:
    """A Redis Cluster of ``masters`` masters, each with ``replicas`` replicas."""

    def __init__(
        self,
        *,
        masters: int = 3,
        replicas: int = 0,
        password: str | None = None,
        node_timeout_ms: int = 2000,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        if masters < 3:
            raise ValueError("Redis Cluster needs at least 3 masters")
        self.masters = masters
        self.replicas = replicas
        self.password = password
        self.node_timeout_ms = node_timeout_ms
        self.extra_args = extra_args
        self.servers: list[RedisServer] = []

    @property
    def ports(self) -> list[int]:
        return [s.port for s in self.servers]

    @property
    def url(self) -> str:
        """Every node as a seed, comma-separated (the form ``--redis`` accepts)."""
        auth = f":{self.password}@" if self.password else ""
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.ports)
        return f"redis://{auth}{hosts}/0"

    def seed_url(self, index: int = 0) -> str:
        """One node's URL: a single seed is enough, the rest is discovered."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.servers[index].port}/0"

    def start(self, timeout_s: float = 30.0) -> LocalCluster:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RedisServerError(f"no `redis-cli` on PATH: {INSTALL_HINT}")
        try:
            for _ in range(self.masters * (1 + self.replicas)):
                server = RedisServer(
                    password=self.password,
                    extra_args=(
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        # The bus port defaults to port + 10000, past 65535 for most free
                        # ports: pick a free one.
                        "--cluster-port",
                        str(free_port()),
                        "--cluster-node-timeout",
                        str(self.node_timeout_ms),
                        *(("--masterauth", self.password) if self.password else ()),
                        # Replicas sync at once instead of after the default 5 s delay.
                        "--repl-diskless-sync-delay",
                        "0",
                        *self.extra_args,
                    ),
                )
                self.servers.append(server.start())
            create = subprocess.run(
                [
                    cli,
                    *(("-a", self.password, "--no-auth-warning") if self.password else ()),
                    "--cluster",
                    "create",
                    *(f"127.0.0.1:{p}" for p in self.ports),
                    "--cluster-replicas",
                    str(self.replicas),
                    "--cluster-yes",
                ],
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
            if create.returncode != 0:
                raise RedisServerError(f"redis-cli --cluster create failed: {create.stdout}")
            self.wait_ok(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(
            port=port, password=self.password, socket_timeout=2, socket_connect_timeout=1
        )

    def alive(self) -> list[RedisServer]:
        return [s for s in self.servers if s.running]

    def nodes(self) -> list[NodeInfo]:
        """The topology as a live node sees it."""
        for server in self.alive():
            try:
                with self.client(server.port) as r:
                    parsed = r.execute_command("CLUSTER NODES")
            except (redis.RedisError, OSError):
                continue
            return [_node(address, fields) for address, fields in parsed.items()]
        raise RedisServerError("no cluster node answers")

    def master_of(self, key: str) -> NodeInfo:
        """The master that owns ``key``'s slot now."""
        slot = key_slot(key.encode())
        for node in self.nodes():
            if node.master and not node.failed and node.owns(slot):
                return node
        raise RedisServerError(f"no live master owns slot {slot}")

    def server(self, port: int) -> RedisServer:
        return next(s for s in self.servers if s.port == port)

    def kill(self, port: int) -> None:
        """SIGKILL one node."""
        self.server(port).kill()

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node says ``cluster_state:ok`` and all agree on the slot owners."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._consistent():
                return
            if time.monotonic() > deadline:
                raise RedisServerError(f"the cluster did not settle within {timeout_s} s")
            time.sleep(0.1)

    def wait_promoted(self, old: NodeInfo, timeout_s: float = 30.0) -> NodeInfo:
        """Until another node serves the slots of ``old`` (a master, as it was described
        before it was killed) and the cluster has settled again; returns the new master."""
        if not old.slots:
            raise ValueError("the old master owned no slots")
        first = old.slots[0][0]
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                owner = next(
                    (n for n in self.nodes() if n.master and not n.failed and n.owns(first)),
                    None,
                )
                if owner is not None and owner.port != old.port and self._consistent():
                    return owner
            except RedisServerError:
                pass
            if time.monotonic() > deadline:
                raise RedisServerError(f"no replica took over within {timeout_s} s")
            time.sleep(0.1)

    def _consistent(self) -> bool:
        """Every live node: state ok, the same slot owners, the expected number of masters
        serving slots and of replicas, and each replica's link to its master up."""
        views = []
        for server in self.alive():
            try:
                with self.client(server.port) as r:
                    if r.execute_command("CLUSTER INFO").get("cluster_state") != "ok":
                        return False
                    slots = r.execute_command("CLUSTER SLOTS")
                    nodes = r.execute_command("CLUSTER NODES")
                    replication = r.info("replication")
            except (redis.RedisError, OSError):
                return False
            if replication.get("role") == "slave" and replication.get("master_link_status") != "up":
                return False
            live = [_node(a, f) for a, f in nodes.items()]
            live = [n for n in live if not n.failed]
            if sum(1 for n in live if n.master and n.slots) != self.masters:
                return False
            if sum(1 for n in live if not n.master) < len(self.alive()) - self.masters:
                return False
            views.append(sorted((int(s[0]), int(s[1]), int(s[2][1])) for s in slots))
        return bool(views) and all(v == views[0] for v in views)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
        self.servers = []

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _node(address: str, fields: dict[str, Any]) -> NodeInfo:
    """A node from redis-py's parsed ``CLUSTER NODES`` (address -> fields)."""
    flags = str(fields["flags"]).split(",")
    master_id = str(fields["master_id"])
    return NodeInfo(
        node_id=str(fields["node_id"]),
        port=int(address.split("@")[0].rsplit(":", 1)[1]),
        master="master" in flags,
        master_id=None if master_id == "-" else master_id,
        slots=tuple((int(lo), int(hi)) for lo, hi in fields.get("slots", [])),
        failed="fail" in flags or "fail?" in flags,
    )

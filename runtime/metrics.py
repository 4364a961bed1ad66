"""What the gateway's and the worker's Prometheus metrics share: buckets, registry, exposition.

Each process owns its metrics through one object (``producer.metrics.GatewayMetrics``,
``consumer.metrics.WorkerMetrics``) holding its own ``CollectorRegistry``, never the global one,
so tests can build as many as they like and nothing registers itself on import.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Gauge,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.exposition import choose_encoder

LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
"""Seconds, for every latency histogram: a cached answer (sub-millisecond) up to a long model
call (tens of seconds). Requests are capped at --max-timeout-ms (300 s by default); anything
above 60 s lands in +Inf, where a percentile is already an incident."""

COUNT_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
"""Requests or rows per batch: powers of two up to well past any sensible max_batch."""

BYTES_BUCKETS: tuple[float, ...] = tuple(float(256 * 4**i) for i in range(10))
"""Request bodies: 256 B to 64 MiB (the default --max-body-bytes), by factors of four."""


def new_registry() -> CollectorRegistry:
    """A private registry with the standard process and platform collectors."""
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


def exposition(registry: CollectorRegistry, accept: str | None = None) -> tuple[bytes, str]:
    """The registry's samples in the format the scraper asked for (``Accept``): OpenMetrics
    when it says so, else the Prometheus text format. Returns the body and its content type."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type


class RuntimeGauges:
    """What every inferq process exports about itself and its Redis, declared once here and
    registered into the gateway's and each worker's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.loop_healthy = Gauge(
            "inferq_loop_healthy",
            "1 while a background loop runs and its last attempt succeeded; 0 while it backs off "
            "from Redis errors (or is down), by loop.",
            ["loop"],
            registry=registry,
        )
        self.redis_evicting = Gauge(
            "inferq_redis_evicting",
            "1 when Redis's maxmemory-policy may evict inferq's keys (allkeys-* or volatile-*: "
            "request streams, job records and results can vanish under memory pressure); set "
            "maxmemory-policy noeviction. Labelled with the policy ('unknown' when CONFIG GET is "
            "not allowed).",
            ["policy"],
            registry=registry,
        )
        self.redis_pool = Gauge(
            "inferq_redis_pool_connections",
            "Connections of the Redis command pool, by state: in_use (taken by a command now) "
            "and idle; in_use stuck at the pool size while Redis answers is a wedged pool "
            "(the process exits after --redis-wedge-s).",
            ["state"],
            registry=registry,
        )
        self._policy: str | None = None

    def track_loops(self, health: Callable[[], dict[str, bool]]) -> None:
        """Read each loop's health at scrape time (``runtime.loops.Loops.health``)."""

        def reader(name: str) -> Callable[[], float]:
            return lambda: float(health().get(name, False))

        for name in health():
            self.loop_healthy.labels(name).set_function(reader(name))

    def track_pool(self, counts: Callable[[], dict[str, int]]) -> None:
        """Read the pool's counts at scrape time (``runtime.broker.Broker.pool_counts``)."""

        def reader(state: str) -> Callable[[], float]:
            return lambda: float(counts()[state])

        for state in ("in_use", "idle"):
            self.redis_pool.labels(state).set_function(reader(state))

    def set_policy(self, policy: str, evicting: bool) -> None:
        if self._policy is not None and self._policy != policy:
            self.redis_evicting.remove(self._policy)
        self._policy = policy
        self.redis_evicting.labels(policy).set(1.0 if evicting else 0.0)


class MetricsServer:
    """``GET /metrics`` for one registry on its own port (a worker's ``--metrics-port``, a
    gateway's ``--gateway-metrics-port``), served by prometheus_client's HTTP server in a daemon
    thread (scrapes never wait for the event loop, and the loop never waits
    for a scrape; the metrics are thread-safe).

    ``start`` binds ``host`` (no default: the worker passes ``--metrics-host``, the gateway
    its ``--host``; this machine only unless told otherwise) and returns the port (``port=0``
    lets the OS pick, for tests; the processes treat a metrics port of 0 as off and never get
    here). ``stop`` blocks until the serving thread has exited (up to half a second): from
    async code, ``await asyncio.to_thread(stop)``.
    """

    def __init__(self, registry: CollectorRegistry, port: int, host: str) -> None:
        self.registry = registry
        self.host = host
        self.port = port
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        if self._server is None:
            self._server, self._thread = start_http_server(
                self.port, addr=self.host, registry=self.registry
            )
            self.port = int(self._server.server_address[1])
        return self.port

    def stop(self) -> None:
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join()

"""The gateway's runtime: its Redis clients and the background loops it owns.

``start`` opens connections and starts the loops; ``stop`` cancels and awaits every one of them,
fails the requests still waiting, and closes the connections. The gateway starts even when Redis
is down: it then reports not-ready, answers inference with 503, and recovers on its own.

Every loop survives Redis errors with backoff and tells readiness while it fails (``ready``
answers why). A loop that ends any other way is a bug: readiness fails for good and ``on_fatal``
(set by the command line) stops the server, which then exits non-zero so that a supervisor
restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import redis.asyncio as aioredis
import structlog

from producer.admin import ModelAdmin
from producer.errors import ServiceUnavailable
from producer.jobs import JobService
from producer.metrics import GatewayMetrics, StreamGauges
from producer.pipeliner import AutoPipeline
from producer.registry import ModelRegistry
from producer.replies import ReplyListener
from producer.service import InferenceService
from producer.settings import GatewaySettings
from protocol.keys import Keys
from runtime import tracing
from runtime.aio import cancelling
from runtime.connections import RedisClock, blocking_client, command_client, redact, resolve
from runtime.eviction import EvictionCheck
from runtime.faults import RETRYABLE, describe
from runtime.loops import Loops
from runtime.resp import Endpoint, RespConnection
from runtime.stats import StatsRefresher

log = structlog.get_logger("inferq.gateway")

CLOCK_RESYNC_S = 60.0


class Gateway:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.keys = Keys(settings.namespace)
        self.clock = RedisClock()
        self.metrics = GatewayMetrics()
        self.tracer = tracing.current()
        self.loops = Loops(log, on_fatal=self._fatal)
        self.eviction = EvictionCheck(log, self.metrics.runtime.set_policy)
        self.failure: str | None = None
        """Why the gateway must exit (a loop crashed); None while it serves."""
        self.on_fatal: Callable[[], None] | None = None
        """Called once a loop crashed: the command line stops the server here."""

    async def start(self) -> None:
        s = self.settings
        redis_settings = await resolve(s.redis)
        self.cluster = bool(redis_settings.cluster)
        self.redis = command_client(redis_settings, name=f"inferq-gateway-{s.gateway_id}")
        self.reader = blocking_client(
            redis_settings,
            name=f"inferq-gateway-replies-{s.gateway_id}",
            block_s=s.reply_block_ms / 1000,
        )
        # One Redis: the hot path's commands go over one lean pipelining connection.
        self.pipeline = AutoPipeline(self.redis, lean=self._lean(self.redis))
        self.registry = ModelRegistry(
            self.redis,
            self.keys,
            self.clock,
            refresh_s=s.registry_refresh_s,
            eviction=self.eviction,
            backoff=self.loops.backoff("registry"),
        )
        self.replies = ReplyListener(
            self.reader,
            self.redis,
            self.keys.replies(s.gateway_id),
            block_ms=s.reply_block_ms,
            ttl_s=max(60.0, 6 * s.heartbeat_s),
            job_events=self.keys.job_events,
            separate_job_events=self.cluster,
            events=self.loops.backoff("job-events"),
            reads=self.loops.backoff("replies"),
            keepalives=self.loops.backoff("reply-keepalive"),
            lean=self._lean(self.reader),
        )
        self.service = InferenceService(
            s, self.keys, self.registry, self.pipeline, self.replies, self.clock, self.metrics
        )
        self.metrics.track_waiters(lambda: self.replies.waiting)
        self.jobs = JobService(s, self.service, cluster=self.cluster)
        self.admin = ModelAdmin(s, self.keys, self.redis, self.registry)
        try:
            await self.clock.sync(self.redis)
            await self.replies.keepalive()
        except RETRYABLE as e:
            log.warning(
                "Redis not usable at start; serving 503 until it is",
                redis=redact(s.redis.url),
                error=describe(e),
            )
        await self.registry.refresh()
        gauges = StreamGauges(
            self.metrics,
            self.redis,
            self.keys,
            self.clock.now_ms,
            interval_s=s.stream_gauges_s,
            backoff=self.loops.backoff("stream-gauges", critical=False),
            stats=lambda: self.registry.stats,
        )
        stats = StatsRefresher(
            self.redis,
            self.keys,
            s.gateway_id,
            self.clock.now_ms,
            interval_s=s.registry_refresh_s,
            detail_every=max(1, round(s.stream_gauges_s / s.registry_refresh_s)),
            backoff=self.loops.backoff("stats", critical=False),
            latest=lambda: self.registry.stats,
            publish=self.registry.accept_stats,
        )
        self.loops.spawn("replies", self.replies.run())
        self.loops.spawn("reply-keepalive", self.replies.run_keepalive(s.heartbeat_s))
        if self.cluster:
            self.loops.spawn("job-events", self.replies.run_job_events())
        self.loops.spawn("registry", self.registry.run())
        self.loops.spawn("clock", self._resync_clock())
        self.loops.spawn("stream-gauges", gauges.run())
        self.loops.spawn("stats", stats.run())
        self.metrics.runtime.track_loops(self.loops.health)
        log.info(
            "gateway started",
            gateway=s.gateway_id,
            redis=redact(s.redis.url),
            cluster=self.cluster,
            models=sorted(self.registry.models),
        )

    async def stop(self) -> None:
        await self.loops.cancel()
        self.replies.fail_all(ServiceUnavailable("the gateway is shutting down"))
        await self.pipeline.close()
        await self.replies.close()
        with contextlib.suppress(*RETRYABLE):
            await self.redis.delete(self.replies.key)
        await self.reader.aclose()
        await self.redis.aclose()
        log.info("gateway stopped", gateway=self.settings.gateway_id)

    def _lean(self, client: aioredis.Redis) -> RespConnection | None:
        """A lean connection set up as ``client``'s are (one Redis only; a cluster client
        routes by slot, which it does not)."""
        endpoint = None if self.cluster else Endpoint.of(client)
        return RespConnection(endpoint) if endpoint is not None else None

    async def ready(self) -> tuple[bool, list[str]]:
        """Ready when Redis answers, no request-path loop is down or failing (the reply
        listener and its keepalive, the registry), and a live worker serves a model; else the
        reasons, for a person."""
        problems = self.loops.problems(critical_only=True)
        try:
            await self.pipeline.execute("PING")
        except RETRYABLE as e:
            problems.append(f"redis: {describe(e)}")
        if self.registry.live_workers == 0:
            problems.append("no live worker serves any model")
        return not problems, problems

    def _fatal(self, reason: str) -> None:
        self.failure = reason
        if self.on_fatal is not None:
            self.on_fatal()

    async def _resync_clock(self) -> None:
        backoff = self.loops.backoff("clock", critical=False)
        while not cancelling():
            await asyncio.sleep(CLOCK_RESYNC_S)
            try:
                await self.clock.sync(self.redis)
            except RETRYABLE as e:
                backoff.record(e)
                continue
            backoff.succeeded()

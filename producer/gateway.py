"""The gateway's runtime: its Redis broker and the background loops it owns (with a webhook
secret, the webhook deliverer among them: ``producer.webhooks``).

``start`` connects (``_connect``), wires the parts to each other (``_build_parts``) and starts
the loops (``_start_loops``); ``stop`` cancels and awaits every loop, fails the requests still
waiting, and closes the connections. The gateway starts even when Redis is down: it then reports
not-ready, answers inference with 503, and recovers on its own.

Every loop survives Redis errors with backoff and tells readiness while it fails (``ready``
answers why). A loop that ends any other way is a bug: readiness fails for good and ``on_fatal``
(set by the command line) stops the server, which then exits non-zero so that a supervisor
restarts it. So does a gateway wedged on its own Redis connections (``runtime.wedge``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog

from producer.admin import ModelAdmin
from producer.batches import BatchService
from producer.batchrunner import BatchRunner
from producer.errors import ServiceUnavailable
from producer.events import Watchers
from producer.inflight import InflightBytes
from producer.introspection import Introspection
from producer.jobs import JobService
from producer.metrics import GatewayMetrics, StreamGauges
from producer.pipeliner import AutoPipeline
from producer.registry import ModelRegistry
from producer.replies import ReplyListener
from producer.service import InferenceService
from producer.settings import GatewaySettings
from producer.webhooks import WebhookDeliverer, WebhookPolicy
from protocol.keys import Keys
from runtime import tracing
from runtime.aio import cancelling
from runtime.broker import Broker, connect
from runtime.connections import RedisClock, redact
from runtime.eviction import EvictionCheck
from runtime.faults import RETRYABLE, describe
from runtime.loops import Loops
from runtime.stats import StatsRefresher
from runtime.wedge import NAME as WEDGE_WATCH
from runtime.wedge import WedgeWatch

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
        self.inflight = InflightBytes(settings.max_inflight_bytes)
        """Bytes of unfinished requests (headers and bodies) held, against
        ``--max-inflight-bytes``: the HTTP server and the services share it."""

    async def start(self) -> None:
        s = self.settings
        await self._connect()
        self._build_parts()
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
        self._start_loops()
        log.info(
            "gateway started",
            gateway=s.gateway_id,
            redis=redact(s.redis.url),
            topology=self.broker.kind,
            models=sorted(self.registry.models),
        )

    async def _connect(self) -> None:
        """The broker (``runtime.broker``: which Redis it is is asked here, once). Connections
        open on first use, so the gateway starts while Redis is down."""
        s = self.settings
        self.broker: Broker = await connect(s.redis, name=f"inferq-gateway-{s.gateway_id}")
        self.redis = self.broker.commands

    def _build_parts(self) -> None:
        """The pipeline, registry, reply listener, services and the two stats loops' owners,
        wired to each other."""
        s = self.settings
        self.pipeline = AutoPipeline(self.broker)
        self.registry = ModelRegistry(
            self.redis,
            self.keys,
            self.clock,
            refresh_s=s.registry_refresh_s,
            eviction=self.eviction,
            backoff=self.loops.backoff("registry"),
            workers_on_demand=s.workers_on_demand,
        )
        self.replies = ReplyListener(
            self.broker,
            self.keys.replies(s.gateway_id),
            block_ms=s.reply_block_ms,
            ttl_s=max(60.0, 6 * s.heartbeat_s),
            reader_name=f"inferq-gateway-replies-{s.gateway_id}",
            job_events=self.keys.job_events,
            events=self.loops.backoff("job-events"),
            reads=self.loops.backoff("replies"),
            keepalives=self.loops.backoff("reply-keepalive"),
        )
        self.service = InferenceService(
            s,
            self.keys,
            self.registry,
            self.pipeline,
            self.replies,
            self.clock,
            self.metrics,
            self.inflight,
        )
        self.metrics.track_waiters(lambda: self.replies.waiting)
        self.webhooks = WebhookPolicy(s)
        self.jobs = JobService(s, self.service, self.webhooks)
        self.watched = Watchers()
        """What the events stream announces, by field: event streams and webhooks read it."""
        self.watched.add(self.jobs)
        self.batches = BatchService(s, self.service, self.webhooks)
        self.watched.add(self.batches)
        self.batch_runner = BatchRunner(
            self.batches,
            self.jobs,
            s.gateway_id,
            self.metrics,
            self.loops.backoff("batches", critical=False),
        )
        self.deliverer: WebhookDeliverer | None = None
        if s.webhook_secret is not None:
            self.deliverer = WebhookDeliverer(
                s,
                self.broker,
                self.keys,
                self.watched,
                self.clock,
                self.metrics.webhooks,
                self.loops.backoff("webhooks", critical=False),
                self.webhooks.egress,
            )
            self.replies.events.tap(self.deliverer.wake)
        self.admin = ModelAdmin(s, self.keys, self.redis, self.registry)
        self.introspection = Introspection(self.keys, self.redis, self.registry)
        self._gauges = StreamGauges(
            self.metrics,
            self.redis,
            self.keys,
            self.clock.now_ms,
            interval_s=s.stream_gauges_s,
            backoff=self.loops.backoff("stream-gauges", critical=False),
            stats=lambda: self.registry.stats,
        )
        self._stats = StatsRefresher(
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

    def _start_loops(self) -> None:
        s = self.settings
        self.loops.spawn("replies", self.replies.run())
        self.loops.spawn("reply-keepalive", self.replies.run_keepalive(s.heartbeat_s))
        self.loops.spawn("registry", self.registry.run())
        self.loops.spawn("clock", self._resync_clock())
        self.loops.spawn("stream-gauges", self._gauges.run())
        self.loops.spawn("stats", self._stats.run())
        self.loops.spawn("batches", self.batch_runner.run())
        if self.deliverer is not None:
            self.loops.spawn("webhooks", self.deliverer.run())
        self.wedge = WedgeWatch(
            self.broker,
            self.loops.backoff(WEDGE_WATCH),
            self.loops.backoffs,
            bound_s=s.redis_wedge_s,
        )
        self.loops.spawn(WEDGE_WATCH, self.wedge.run())
        self.metrics.runtime.track_loops(self.loops.health)
        self.metrics.runtime.track_pool(self.broker.pool_counts)

    async def stop(self) -> None:
        await self.loops.cancel()
        if self.deliverer is not None:
            await self.deliverer.release()
        self.replies.fail_all(ServiceUnavailable("the gateway is shutting down"))
        await self.pipeline.close()
        await self.replies.close()
        with contextlib.suppress(*RETRYABLE):
            await self.redis.delete(self.replies.key)
        await self.broker.aclose()
        log.info("gateway stopped", gateway=self.settings.gateway_id)

    async def ready(self) -> tuple[bool, list[str]]:
        """Ready when Redis answers, no request-path loop is down or failing (the reply
        listener and its keepalive, the registry), and a live worker serves a version of some
        model (not when every model is unloaded); else the reasons, for a person. Which workers
        are live is read from Redis now, not from the last periodic refresh: an advertisement
        that vanished since (evicted, expired) would otherwise read as ready while the next
        refresh refuses every request ("no live worker serves model ...")."""
        await self.registry.refresh()  # failures go to the registry loop's health, read below
        problems = self.loops.problems(critical_only=True)
        try:
            await self.pipeline.execute("PING")
        except RETRYABLE as e:
            problems.append(f"redis: {describe(e)}")
        serving = self.registry.not_serving()
        if serving is not None:
            problems.append(serving)
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

"""The gateway's runtime: its Redis clients and the background tasks it owns.

``start`` opens connections and starts the tasks; ``stop`` cancels and awaits every one of them,
fails the requests still waiting, and closes the connections. The gateway starts even when Redis
is down: it then reports not-ready, answers inference with 503, and recovers on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import structlog
from redis.exceptions import RedisError

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
from runtime.connections import RedisClock, blocking_client, command_client, redact

log = structlog.get_logger("inferq.gateway")


class Gateway:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.keys = Keys(settings.namespace)
        self.clock = RedisClock()
        self.metrics = GatewayMetrics()
        self.tracer = tracing.current()
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        s = self.settings
        self.redis = command_client(s.redis, name=f"inferq-gateway-{s.gateway_id}")
        self.reader = blocking_client(
            s.redis, name=f"inferq-gateway-replies-{s.gateway_id}", block_s=s.reply_block_ms / 1000
        )
        self.pipeline = AutoPipeline(self.redis)
        self.registry = ModelRegistry(
            self.redis, self.keys, self.clock, refresh_s=s.registry_refresh_s
        )
        self.replies = ReplyListener(
            self.reader,
            self.redis,
            self.keys.replies(s.gateway_id),
            block_ms=s.reply_block_ms,
            ttl_s=max(60.0, 6 * s.heartbeat_s),
            job_events=self.keys.job_events,
        )
        self.service = InferenceService(
            s, self.keys, self.registry, self.pipeline, self.replies, self.clock, self.metrics
        )
        self.metrics.track_waiters(lambda: self.replies.waiting)
        self.jobs = JobService(s, self.service)
        self.admin = ModelAdmin(s, self.keys, self.redis, self.registry)
        try:
            await self.clock.sync(self.redis)
            await self.replies.keepalive()
        except (RedisError, OSError) as e:
            log.warning(
                "Redis unreachable at start; serving 503 until it answers",
                redis=redact(s.redis.url),
                error=str(e),
            )
        await self.registry.refresh()
        self._spawn(self.replies.run(), "replies")
        self._spawn(self.replies.run_keepalive(s.heartbeat_s), "reply-keepalive")
        self._spawn(self.registry.run(), "registry")
        self._spawn(self._resync_clock(), "clock")
        gauges = StreamGauges(
            self.metrics, self.redis, self.keys, self.clock.now_ms, interval_s=s.stream_gauges_s
        )
        self._spawn(gauges.run(), "stream-gauges")
        log.info(
            "gateway started",
            gateway=s.gateway_id,
            redis=redact(s.redis.url),
            models=sorted(self.registry.models),
        )

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.replies.fail_all(ServiceUnavailable("the gateway is shutting down"))
        await self.pipeline.close()
        with contextlib.suppress(RedisError, OSError):
            await self.redis.delete(self.replies.key)
        await self.reader.aclose()
        await self.redis.aclose()
        log.info("gateway stopped", gateway=self.settings.gateway_id)

    async def ready(self) -> bool:
        """Redis answers and at least one live worker serves a model."""
        try:
            await self.pipeline.execute("PING")
        except (RedisError, OSError):
            return False
        return self.registry.live_workers > 0

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("gateway task crashed", task=task.get_name(), exc_info=task.exception())

    async def _resync_clock(self) -> None:
        while not cancelling():
            await asyncio.sleep(60)
            with contextlib.suppress(RedisError, OSError):
                await self.clock.sync(self.redis)

"""The one handler behind every inference endpoint: validate, look in the cache, enqueue, wait.

Routes only do HTTP things (read the body, pick the response format) and call ``infer``. Per
request on a cache miss this costs two Redis commands (GET of the cache key, XADD of the request),
both sent through the auto-pipeline so concurrent requests share round trips; the result arrives
on the gateway's reply stream with no further command.

What every transport (HTTP, gRPC) does around ``infer``:

- hold the request body's bytes with ``hold_body()`` from the moment its size is known until the
  answer is sent (admission by memory, ``producer.inflight``);
- tell the service when the caller goes away: pass ``disconnected`` (a coroutine function that
  returns once the caller has hung up; it runs once the request has waited ``WATCH_AFTER_S``,
  until it is answered), or call
  ``abandon(request_id)``. Cancelling the task running ``infer`` (what a cancelled gRPC call
  does) abandons the request too. An abandoned request stops being waited for at once, and a
  worker that has not started it drops it.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog

from producer.admission import ServiceTime, decide
from producer.breaker import Breaker
from producer.errors import (
    BadRequest,
    ClientClosedRequest,
    GatewayTimeout,
    ModelFailed,
    NotFound,
    ServiceUnavailable,
    TooManyRequests,
    redis_unavailable,
)
from producer.inflight import BodyHold, InflightBytes
from producer.metrics import GatewayMetrics
from producer.pipeliner import AutoPipeline
from producer.registry import ModelEntry, ModelRegistry
from producer.replies import ReplyListener
from producer.routing import ROUTED_VERSION, VersionRouter
from producer.settings import GatewaySettings
from producer.v2 import InferRequestBody, parse_infer_request
from protocol import ProtocolError
from protocol.cachekey import digest
from protocol.cancellation import CHECK_AFTER_MS, MARK_SCRIPT, mark_args
from protocol.deadline import deadline_after
from protocol.keys import Keys, Lane, is_valid_name, text
from protocol.messages import FIELD, InferRequest, InferResult, Status
from protocol.registry import ModelMetadata
from runtime.connections import RedisClock
from runtime.faults import RETRYABLE
from runtime.tracing import REQUEST_TRACE

log = structlog.get_logger("inferq.gateway")

WATCH_AFTER_S = CHECK_AFTER_MS / 1000
"""Callers are watched once their request has waited as long as workers wait before they look
for cancellations: a request answered sooner costs neither a watcher task nor a lookup."""


@dataclass(frozen=True, slots=True)
class InferOutcome:
    body: InferRequestBody
    result: InferResult
    cached: bool


@dataclass(frozen=True, slots=True)
class InFlight:
    """A request this gateway has queued and waits on."""

    model: str
    deadline_ms: int
    future: asyncio.Future[InferResult]


@dataclass(frozen=True, slots=True)
class Schedule:
    """The V2 schedule-policy parameters of one request, validated."""

    timeout_ms: int
    priority: int
    use_cache: bool


class InferenceService:
    def __init__(
        self,
        settings: GatewaySettings,
        keys: Keys,
        registry: ModelRegistry,
        pipeline: AutoPipeline,
        replies: ReplyListener,
        clock: RedisClock,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.keys = keys
        self.registry = registry
        self.pipeline = pipeline
        self.replies = replies
        self.clock = clock
        self.metrics = metrics or GatewayMetrics()
        # Unique across gateways (random prefix) and cheap (a counter): these ids route replies
        # and are never shown to clients, so they need not be secret.
        self._id_prefix = secrets.token_hex(8)
        self.breakers: dict[str, Breaker] = {}
        self.service_times: dict[str, ServiceTime] = {}
        self.rejected = 0
        self.waiting: Counter[str] = Counter()
        """Requests per model this gateway has queued and still waits on."""
        self._ids = itertools.count()
        self.router = VersionRouter()
        self._partition_turn: dict[str, int] = {}
        self.inflight = InflightBytes(settings.max_inflight_bytes)
        self._in_flight: dict[str, InFlight] = {}
        self._watchers: dict[str, asyncio.Task[None]] = {}
        """Per request waiting longer than ``WATCH_AFTER_S``: the task watching its caller."""

    def hold_body(self) -> BodyHold:
        """A hold on request-body bytes against ``--max-inflight-bytes``: grow it as the body
        arrives (429 or 413 when it cannot), release it once the answer is sent."""
        return self.inflight.hold()

    async def model(
        self, name: str, version: str | None = None, *, route: bool = True
    ) -> tuple[ModelEntry, str]:
        """The model's entry and the concrete version a request goes to: the one it names, or
        one picked by the model's traffic split (``route``; else the default version, for
        metadata). 404 if unknown, 503 if unloaded."""
        entry = await self.registry.lookup(name) if is_valid_name(name) else None
        if entry is None:
            known = ", ".join(sorted(self.registry.models)) or "none yet"
            raise NotFound(f"unknown model '{name}' (models served: {known})")
        meta = entry.metadata
        if entry.unloaded and route:
            raise ServiceUnavailable(
                f"model '{name}' is unloaded; an administrator can load it with "
                f"POST /v2/repository/models/{name}/load"
            )
        if version is None or version == "":
            if not entry.traffic or not route:
                return entry, meta.default_version
            return entry, self.router.choose(name, entry.traffic)
        if version not in meta.versions:
            raise NotFound(
                f"model '{name}' has no version '{version}' (versions: {', '.join(meta.versions)})"
            )
        return entry, version

    def schedule(self, meta: ModelMetadata, body: InferRequestBody, *, no_cache: bool) -> Schedule:
        params = body.parameters
        timeout_us = params.get("timeout", 0)
        if not isinstance(timeout_us, int) or isinstance(timeout_us, bool) or timeout_us < 0:
            raise BadRequest("parameter 'timeout' must be a non-negative integer (microseconds)")
        priority = params.get("priority", 0)
        if not isinstance(priority, int) or isinstance(priority, bool) or priority < 0:
            raise BadRequest("parameter 'priority' must be a non-negative integer (1 is highest)")
        cache = params.get("cache", True)
        if not isinstance(cache, bool):
            raise BadRequest("parameter 'cache' must be true or false")
        timeout_ms = timeout_us // 1000 if timeout_us else meta.default_timeout_ms
        return Schedule(
            timeout_ms=max(1, min(timeout_ms, self.settings.max_timeout_ms)),
            priority=priority,
            use_cache=cache and not no_cache and meta.cache_enabled,
        )

    async def infer(
        self,
        name: str,
        version: str | None,
        raw: bytes,
        header_length: int | None,
        *,
        no_cache: bool = False,
        traceparent: str | None = None,
        disconnected: Callable[[], Awaitable[None]] | None = None,
    ) -> InferOutcome:
        """An inference whose request is a V2 HTTP body (JSON, or JSON plus binary tensors)."""
        return await self.infer_decoded(
            name,
            version,
            lambda meta: parse_infer_request(raw, header_length, meta),
            no_cache=no_cache,
            traceparent=traceparent,
            disconnected=disconnected,
        )

    async def infer_decoded(
        self,
        name: str,
        version: str | None,
        decode: Callable[[ModelMetadata], InferRequestBody],
        *,
        no_cache: bool = False,
        traceparent: str | None = None,
        disconnected: Callable[[], Awaitable[None]] | None = None,
    ) -> InferOutcome:
        """An inference whose request the transport decodes (and validates) once the model is
        known: ``decode(metadata)`` returns the body or raises BadRequest. Every transport ends
        here, so validation, cache, admission, routing and priority are the same for all."""
        started = time.monotonic()
        trace = REQUEST_TRACE.get()
        entry, version = await self.model(name, version)
        ROUTED_VERSION.set(version)
        meta = entry.metadata
        body = decode(meta)
        sched = self.schedule(meta, body, no_cache=no_cache)
        trace.since_start("receive and validate")
        if entry.workers == 0:
            self.metrics.observe_rejected(name, "no_workers")
            raise ServiceUnavailable(
                f"no live worker serves model '{name}'; start one with "
                f"`inferq worker --models {name}`",
                retry_after_s=5,
            )
        cache_key = (
            self.keys.cache(name, version, digest(body.inputs, body.outputs))
            if sched.use_cache
            else None
        )
        if cache_key is not None:
            with trace.span("cache lookup"):
                cached = await self._redis("GET", cache_key, model=name)
            self.metrics.observe_cache(name, hit=cached is not None)
            if cached is not None:
                try:
                    return InferOutcome(body, InferResult.decode(cached), cached=True)
                except ProtocolError:
                    log.warning("ignoring an undecodable cache entry", key=cache_key)
        lane = Lane.for_priority(sched.priority)
        self._admit(name, entry.workers, meta.max_batch, lane, sched.timeout_ms / 1000)
        request_id = f"{self._id_prefix}{next(self._ids):x}"
        now_ms = self.clock.now_ms()
        queued = trace.start("queue wait")  # enqueue to reply; the worker's spans join it
        request = InferRequest(
            id=request_id,
            model=name,
            version=version,
            inputs=body.inputs,
            outputs=body.outputs,
            deadline_ms=deadline_after(now_ms, sched.timeout_ms),
            enqueued_ms=now_ms,
            result_key=cache_key or self.keys.result(request_id),
            result_ttl_ms=(meta.cache_ttl_s if cache_key else self.settings.result_ttl_s) * 1000,
            reply_to=self.replies.key,
            priority=sched.priority,
            client_id=body.client_id,
            traceparent=queued.propagate(traceparent),
        )
        future = self.replies.expect(request_id)
        self._in_flight[request_id] = InFlight(name, request.deadline_ms, future)
        self.waiting[name] += 1
        stream = self.keys.stream(name, lane, self.partition(name, meta.partitions))
        watch: asyncio.TimerHandle | None = None
        try:
            entry_id = await self._redis("XADD", stream, "*", FIELD, request.encode(), model=name)
            self.replies.queued(request_id, stream, text(entry_id), request.result_key)
            self.registry.note_queued(name)
            log.debug(
                "request queued",
                component="gateway",
                request_id=request_id,
                model=name,
                version=version,
                lane=lane.value,
                traceparent=traceparent,
            )
            remaining = sched.timeout_ms / 1000 - (time.monotonic() - started)
            if disconnected is not None:
                watch = asyncio.get_running_loop().call_later(
                    WATCH_AFTER_S, self._watch, disconnected, request_id
                )
            result = await self.replies.wait(future, remaining)
        except TimeoutError:
            raise GatewayTimeout(
                f"model '{name}' did not answer within the request's deadline of "
                f"{sched.timeout_ms} ms (queue backlog or too few workers); the request will "
                "not run after its deadline"
            ) from None
        except asyncio.CancelledError:
            self.abandon(request_id)  # e.g. a cancelled gRPC call
            raise
        finally:
            if watch is not None:
                watch.cancel()
                watcher = self._watchers.pop(request_id, None)
                if watcher is not None:
                    watcher.cancel()
            self._in_flight.pop(request_id, None)
            queued.end()
            self.replies.forget(request_id)
            self.waiting[name] -= 1
        self._observe(name, result)
        return InferOutcome(body, _checked(result, name, sched.timeout_ms), cached=False)

    def partition(self, model: str, partitions: int) -> int:
        """The partition a request goes to: each in turn (round-robin per gateway), so a model
        with ``partitions = N`` spreads its load over N request streams, N slots of a cluster."""
        if partitions <= 1:
            return 0
        turn = (self._partition_turn.get(model, -1) + 1) % partitions
        self._partition_turn[model] = turn
        return turn

    def abandon(self, request_id: str) -> bool:
        """The caller of a queued request has gone (an HTTP client hung up, a gRPC call was
        cancelled): stop waiting for it at once, and mark it cancelled so that a worker that
        has not started it drops it unrun (``protocol.cancellation``). Returns False when the
        request is no longer in flight. Needs no await: callable from callbacks."""
        pending = self._in_flight.pop(request_id, None)
        if pending is None:
            return False
        self.replies.forget(request_id)  # the waiting gauge falls now, not at the deadline
        if not pending.future.done():
            pending.future.set_exception(
                ClientClosedRequest("the client went away before its answer was ready")
            )
        key = self.keys.cancelled(pending.model)
        marked = self.pipeline.submit(
            "EVAL",
            MARK_SCRIPT,
            1,
            key,
            *mark_args(request_id, pending.deadline_ms, self.clock.now_ms()),
        )
        marked.add_done_callback(_log_unmarked)
        log.debug("request abandoned by its caller", request_id=request_id, model=pending.model)
        return True

    def _watch(self, disconnected: Callable[[], Awaitable[None]], request_id: str) -> None:
        """Watch the caller of a request that has waited ``WATCH_AFTER_S``: one task per such
        request while it waits. Most requests are answered sooner and never cost a task; a
        caller that hung up before is seen at once (its ``receive`` returns at once)."""

        async def watch() -> None:
            try:
                await disconnected()
            except Exception as e:  # a transport that cannot tell: keep waiting, as before
                log.debug("cannot watch for the caller going away", error=str(e))
                return
            self.abandon(request_id)

        if request_id in self._in_flight:
            self._watchers[request_id] = asyncio.create_task(watch())

    def _admit(
        self, name: str, workers: int, max_batch: int, lane: Lane, deadline_s: float
    ) -> None:
        """Fail fast rather than queue: a failing model (breaker open), a backlog at its cap,
        or a queue that would outlast the request's deadline."""
        now = time.monotonic()
        breaker = self._breaker(name)
        if not breaker.allow(now):
            self.metrics.observe_rejected(name, "breaker_open")
            retry = breaker.retry_after_s(now)
            raise ServiceUnavailable(
                f"model '{name}' is failing most recent requests; failing fast for the next "
                f"{retry:.0f} s before trying it again",
                retry_after_s=max(1.0, retry),
            )
        service = self.service_times.get(name)
        # Ahead of this request: what Redis last reported unread (all gateways), or what this
        # gateway itself is waiting on (exact, and current), whichever is more.
        verdict = decide(
            backlog=max(self.registry.backlog(name, through=lane), self.waiting[name]),
            batch_s=service.batch_s if service else None,
            max_batch=max_batch,
            workers=workers,
            deadline_s=deadline_s,
            max_backlog=self.settings.max_backlog,
        )
        if not verdict.admitted:
            self.rejected += 1
            self.metrics.observe_rejected(name, verdict.kind)
            raise TooManyRequests(
                f"model '{name}' is overloaded: {verdict.reason}",
                retry_after_s=verdict.retry_after_s,
            )

    def _breaker(self, name: str) -> Breaker:
        breaker = self.breakers.get(name)
        if breaker is None:  # not setdefault: that would build a Breaker on every request
            breaker = self.breakers[name] = Breaker()
        return breaker

    def _observe(self, name: str, result: InferResult) -> None:
        t = result.timings
        if t.batch_size:
            service = self.service_times.get(name)
            if service is None:
                service = self.service_times[name] = ServiceTime()
            service.observe(t.infer_ms / 1000, t.batch_size)
        if result.status is not Status.EXPIRED:
            self._breaker(name).record(result.status is not Status.FAILED, time.monotonic())

    async def _redis(self, *args: Any, model: str) -> Any:
        try:
            return await self.pipeline.execute(*args)
        except RETRYABLE as e:
            self.metrics.observe_rejected(model, "redis_unavailable")
            raise redis_unavailable(e) from e


def _log_unmarked(marked: asyncio.Future[Any]) -> None:
    if not marked.cancelled() and marked.exception() is not None:
        # Best effort: unmarked, the request runs for nobody, which costs only the work.
        log.warning("could not mark an abandoned request cancelled", error=str(marked.exception()))


def _checked(result: InferResult, name: str, timeout_ms: int) -> InferResult:
    if result.status is Status.OK:
        return result
    if result.status is Status.EXPIRED:
        raise GatewayTimeout(
            f"model '{name}' could not start the request within its deadline of {timeout_ms} ms: "
            f"{result.error}"
        )
    if result.status is Status.INVALID:
        raise BadRequest(result.error or f"model '{name}' rejected the input")
    raise ModelFailed(result.error or f"model '{name}' failed")

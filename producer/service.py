"""The one inference handler behind every transport: prepare, look in the cache, queue, wait.

``prepare`` opens every request, submit-and-wait or job, under its ``Terms``: route, parse,
schedule, cache, admit, and the ``InferRequest`` to queue. ``infer`` (HTTP, gRPC) queues it
and waits on its ``Waiter``; ``producer.jobs`` queues it as a job. The routed version comes back
in ``InferOutcome.version`` or ``GatewayError.routed``. A cache miss costs two auto-pipelined
Redis commands (GET, XADD). Transports hold the body with ``hold_body()`` and report a caller
that goes away (``disconnected``, ``abandon``, or cancelling ``infer``): the request is then
no longer waited for, and marked so that a worker that has not started it drops it.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog

from producer.admission import ServiceTime, decide
from producer.breaker import Breaker
from producer.errors import (
    BadRequest,
    ClientClosedRequest,
    GatewayError,
    GatewayTimeout,
    ModelFailed,
    NotFound,
    ServiceUnavailable,
    TooManyRequests,
    redis_unavailable,
    unconfirmed,
)
from producer.inflight import BodyHold, InflightBytes
from producer.metrics import GatewayMetrics
from producer.pipeliner import AutoPipeline
from producer.registry import ModelEntry, ModelRegistry
from producer.replies import ReplyListener
from producer.routing import VersionRouter
from producer.settings import GatewaySettings
from producer.v2_request import InferRequestBody
from producer.waiters import Waiter
from protocol import ProtocolError
from protocol.cachekey import digest
from protocol.cancellation import MARK_SCRIPT, mark_args
from protocol.deadline import deadline_after
from protocol.demand import MAX_HINTS, encode_hint
from protocol.keys import Keys, Lane, is_valid_name, text
from protocol.messages import FIELD, InferRequest, InferResult, Kind, Status
from protocol.registry import ModelMetadata
from runtime.connections import RedisClock
from runtime.faults import RETRYABLE, describe, outcome_unknown
from runtime.tracing import REQUEST_TRACE, Stage

log = structlog.get_logger("inferq.gateway")

BREAKER_OUTCOMES: dict[Status, bool] = {Status.OK: True, Status.FAILED: False}
"""What a model's circuit breaker counts: the model's own outcomes, a success or a failure (it
raised, or answered what its config does not allow). Not what a caller caused: a request the
gateway refuses (400: zero rows, wrong shape) never reaches the model, and one the backend
refuses as invalid input (``Status.INVALID``) says nothing of the model's health; nor a request
whose deadline passed in the queue (``Status.EXPIRED``, the model never saw it), nor one that
timed out waiting (overload is admission's business). So one client's bad input cannot open
the breaker for everyone (issue #21; ARCHITECTURE.md, "Circuit breaker")."""

Decode = Callable[[ModelMetadata], InferRequestBody]
"""A transport's parser: the request body, validated against the model (or BadRequest)."""


@dataclass(frozen=True, slots=True)
class Terms:
    """The rules one kind of request is taken on, stated once per kind: submit-and-wait
    (``InferenceService.terms``) and async jobs (``JobService.terms``)."""

    kind: Kind
    default_timeout_ms: int | None
    """For a request that names no ``timeout``; None: the model's ``default_timeout_ms``."""
    max_timeout_ms: int
    unprioritised: Lane
    """The lane of a request that names no ``priority``."""
    cache: bool
    """Whether the result cache may answer it."""
    result_ttl_ms: int
    """How long a result not stored under a cache key is kept."""
    queue_cap: int | None
    """Refuse once the model has this many requests queued, whatever their deadlines (jobs,
    ``--max-job-backlog``). None: admission against the deadline (``_admit``)."""
    stage: str
    """The trace span from enqueue onwards (``queue wait``, ``enqueue``)."""


def infer_terms(settings: GatewaySettings) -> Terms:
    """Submit-and-wait: the model's default timeout, capped by ``--max-timeout-ms``; the
    normal lane unless a priority is named; the cache; admission against the deadline."""
    return Terms(
        kind=Kind.INFER,
        default_timeout_ms=None,
        max_timeout_ms=settings.max_timeout_ms,
        unprioritised=Lane.NORMAL,
        cache=True,
        result_ttl_ms=settings.result_ttl_s * 1000,
        queue_cap=None,
        stage="queue wait",  # enqueue to reply; the worker's spans join it
    )


@dataclass(frozen=True, slots=True)
class Schedule:
    """The V2 schedule-policy parameters of one request, validated, under its terms."""

    timeout_ms: int
    priority: int
    lane: Lane
    use_cache: bool


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request that passed every check, ready to queue."""

    body: InferRequestBody
    schedule: Schedule
    request: InferRequest
    partitions: int
    stage: Stage
    """The open span of the request's time in the queue; whoever queues it ends it."""

    @property
    def version(self) -> str:
        """The version it was routed to."""
        return self.request.version


@dataclass(frozen=True, slots=True)
class InferOutcome:
    body: InferRequestBody
    result: InferResult
    cached: bool
    version: str
    """The version the request was routed to."""


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
        inflight: InflightBytes | None = None,
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
        self.waiters = replies.waiters
        """The requests this gateway has registered and waits on (``producer.waiters``)."""
        self._abandon = self.abandon  # bound once: each waiter watching its caller holds it
        self._ids = itertools.count()
        self.router = VersionRouter()
        self._partition_turn: dict[str, int] = {}
        self.inflight = inflight or InflightBytes(settings.max_inflight_bytes)
        """The gateway's budget (shared with its HTTP server, which holds headers on it)."""
        self.terms = infer_terms(settings)
        self._queued_log = log.bind()
        """The logger of the one log call every request makes ("request queued", debug), bound
        once: the module's ``log`` is structlog's lazy proxy, which builds a logger at every
        call (about 3.5 µs, debug on or off). Bound when the gateway starts (``Gateway.start``),
        after the entry point has configured logging; a later ``structlog.configure`` does not
        reach it (``structlog.testing.capture_logs``, which edits the processors in place,
        does)."""

    def hold_body(self, header_bytes: int = 0) -> BodyHold:
        """A hold on a request's bytes against ``--max-inflight-bytes``: its headers' at once,
        then grow it as the body arrives (429 or 413 when it cannot), release it once the
        answer is sent."""
        return self.inflight.hold(header_bytes)

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

    async def prepare(
        self,
        name: str,
        version: str | None,
        decode: Decode,
        terms: Terms,
        *,
        no_cache: bool = False,
        traceparent: str | None = None,
        request_id: str | None = None,
    ) -> Prepared | InferOutcome:
        """Every request's opening (see the module docstring): the request to queue, or the
        answer when the cache holds it. Refusals raise GatewayError, with ``routed`` set once
        the version is chosen."""
        trace = REQUEST_TRACE.get()
        entry, version = await self.model(name, version)
        try:
            meta = entry.metadata
            body = decode(meta)
            sched = schedule(meta, body, terms, no_cache=no_cache)
            trace.since_start("receive and validate")
            if (
                terms.queue_cap is None
                and entry.workers == 0
                and not self.registry.on_demand(entry)
            ):
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
                        result = InferResult.decode(cached)
                        return InferOutcome(body, result, cached=True, version=version)
                    except ProtocolError:
                        log.warning("ignoring an undecodable cache entry", key=cache_key)
            self._admit(name, entry, sched, terms)
        except GatewayError as e:
            e.routed = version
            raise
        if request_id is None:
            request_id = f"{self._id_prefix}{next(self._ids):x}"
        now_ms = self.clock.now_ms()
        stage = trace.start(terms.stage)
        reply = terms.kind is Kind.INFER
        request = InferRequest(
            id=request_id,
            model=name,
            version=version,
            inputs=body.inputs,
            outputs=body.outputs,
            deadline_ms=deadline_after(now_ms, sched.timeout_ms),
            enqueued_ms=now_ms,
            result_key=cache_key or (self.keys.result(request_id) if reply else ""),
            result_ttl_ms=meta.cache_ttl_s * 1000 if cache_key else terms.result_ttl_ms,
            reply_to=self.replies.key if reply else None,
            kind=terms.kind,
            priority=sched.priority,
            client_id=body.client_id,
            traceparent=stage.propagate(traceparent),
        )
        return Prepared(body, sched, request, meta.partitions, stage)

    async def infer(
        self,
        name: str,
        version: str | None,
        decode: Decode,
        *,
        no_cache: bool = False,
        traceparent: str | None = None,
        disconnected: Callable[[], Awaitable[None]] | None = None,
    ) -> InferOutcome:
        """Submit and wait: the answer to a request ``decode`` parses (every transport ends
        here, so validation, cache, admission, routing and priority are the same for all)."""
        started = time.monotonic()
        prepared = await self.prepare(
            name, version, decode, self.terms, no_cache=no_cache, traceparent=traceparent
        )
        if isinstance(prepared, InferOutcome):
            return prepared
        timeout_ms = prepared.schedule.timeout_ms
        try:
            result = await self._queue_and_wait(prepared, started, disconnected)
            self._observe(name, result)
            checked = _checked(result, name, timeout_ms)
            return InferOutcome(prepared.body, checked, cached=False, version=prepared.version)
        except GatewayError as e:
            e.routed = prepared.version
            raise

    async def _queue_and_wait(
        self,
        prepared: Prepared,
        started: float,
        disconnected: Callable[[], Awaitable[None]] | None,
    ) -> InferResult:
        """Queue the request and wait for its answer, until ``started`` (monotonic) plus its
        timeout. An ``XADD`` whose reply was lost (``runtime.faults.outcome_unknown``: a stall,
        a restart, a huge request past the socket timeout) may have queued the request: its
        answer is waited for all the same, and if none comes, the 504 says it may have run."""
        request = prepared.request
        name = request.model
        waiter = self.waiters.expect(request.id, name, request.deadline_ms)
        lane = prepared.schedule.lane
        stream = self.keys.stream(name, lane, self.partition(name, prepared.partitions))
        timeout_ms = prepared.schedule.timeout_ms
        lost_reply: BaseException | None = None
        try:
            lost_reply = await self._enqueue(request, lane, stream, waiter)
            remaining = timeout_ms / 1000 - (time.monotonic() - started)
            return await waiter.wait(remaining, disconnected, self._abandon)
        except TimeoutError:
            if lost_reply is not None:
                raise unconfirmed(lost_reply, "the request", timeout_ms) from None
            raise GatewayTimeout(
                f"model '{name}' did not answer within the request's deadline of "
                f"{timeout_ms} ms (queue backlog or too few workers); the request will not "
                "run after its deadline"
            ) from None
        except asyncio.CancelledError:
            self.abandon(request.id)  # e.g. a cancelled gRPC call
            raise
        finally:
            waiter.close()
            prepared.stage.end()

    async def _enqueue(
        self, request: InferRequest, lane: Lane, stream: str, waiter: Waiter
    ) -> BaseException | None:
        """XADD the request to ``stream`` and tell ``waiter`` where it is. A refusal, or a
        command that never left, is the caller's 503 (it did not run). A reply lost after the
        XADD was sent is returned: the request may be queued, so it is waited for all the same
        (``Waiter.unconfirmed_in``)."""
        losses_seen = self.replies.losses  # a loss found after the send may have lost it
        try:
            entry_id = await self.pipeline.execute("XADD", stream, "*", FIELD, request.encode())
        except RETRYABLE as e:
            if not outcome_unknown(e):
                self.metrics.observe_rejected(request.model, "redis_unavailable")
                raise redis_unavailable(e) from e
            waiter.unconfirmed_in(stream, request.result_key, losses_seen)
            log.warning(
                "Redis did not confirm a request was queued; waiting for its answer",
                request_id=request.id,
                model=request.model,
                error=describe(e),
            )
            return e
        waiter.enqueued(stream, text(entry_id), request.result_key)
        self.registry.note_queued(request.model)
        await self._wake_loaders(request.model)
        self._queued_log.debug(
            "request queued",
            component="gateway",
            request_id=request.id,
            model=request.model,
            version=request.version,
            lane=lane.value,
            traceparent=request.traceparent,
        )
        return None

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
        request is no longer waited on. Needs no await: callable from callbacks."""
        waiter = self.waiters.get(request_id)
        if waiter is None:
            return False
        waiter.fail(ClientClosedRequest("the client went away before its answer was ready"))
        marked = self.pipeline.submit(
            "EVAL",
            MARK_SCRIPT,
            1,
            self.keys.cancelled(waiter.model),
            *mark_args(request_id, waiter.deadline_ms, self.clock.now_ms()),
        )
        marked.add_done_callback(_log_unmarked)
        log.debug("request abandoned by its caller", request_id=request_id, model=waiter.model)
        return True

    def _admit(self, name: str, entry: ModelEntry, sched: Schedule, terms: Terms) -> None:
        """Fail fast rather than queue. Under a ``queue_cap`` (jobs): a backlog at the cap.
        Else: a failing model (breaker open), a backlog at ``--max-backlog``, or a queue that
        would outlast the request's deadline."""
        if terms.queue_cap is not None:
            backlog = self.registry.backlog(name)
            if backlog >= terms.queue_cap:
                raise TooManyRequests(
                    f"model '{name}' has {backlog} requests queued, at its limit of "
                    f"{terms.queue_cap}; retry later",
                    retry_after_s=5,
                )
            return
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
            backlog=max(self.registry.backlog(name, through=sched.lane), self.waiters.count(name)),
            batch_s=service.batch_s if service else None,
            max_batch=entry.metadata.max_batch,
            workers=entry.workers,
            deadline_s=sched.timeout_ms / 1000,
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
        healthy = BREAKER_OUTCOMES.get(result.status)
        if healthy is not None:
            self._breaker(name).record(healthy, time.monotonic())

    async def _wake_loaders(self, name: str) -> None:
        """A request was queued for a model no live worker holds: hint the on-demand workers
        to load it now (``protocol.demand``). Only a wake-up: when it fails they find the
        request at their next look."""
        entry = self.registry.models.get(name)
        if entry is None or entry.workers or not entry.loadable:
            return  # held, or only a scaler can bring a worker (``--workers-on-demand``)
        hint = [x for pair in encode_hint(name).items() for x in pair]
        try:
            await self.pipeline.execute(
                "XADD", self.keys.demand, "MAXLEN", "~", str(MAX_HINTS), "*", *hint
            )
        except RETRYABLE as e:
            log.debug("demand hint not sent", model=name, error=str(e))

    async def _redis(self, *args: Any, model: str) -> Any:
        try:
            return await self.pipeline.execute(*args)
        except RETRYABLE as e:
            self.metrics.observe_rejected(model, "redis_unavailable")
            raise redis_unavailable(e) from e


def schedule(
    meta: ModelMetadata, body: InferRequestBody, terms: Terms, *, no_cache: bool
) -> Schedule:
    """The request's V2 schedule parameters (``timeout`` in µs, ``priority``, ``cache``),
    checked (400), under its terms: the default timeout and its cap, the lane when no
    priority is named, whether the cache may answer (``no_cache``: the caller wants a fresh
    answer)."""
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
    if timeout_us:
        timeout_ms = timeout_us // 1000
    elif terms.default_timeout_ms is None:
        timeout_ms = meta.default_timeout_ms
    else:
        timeout_ms = terms.default_timeout_ms
    return Schedule(
        timeout_ms=max(1, min(timeout_ms, terms.max_timeout_ms)),
        priority=priority,
        lane=Lane.for_priority(priority) if "priority" in params else terms.unprioritised,
        use_cache=cache and terms.cache and not no_cache and meta.cache_enabled,
    )


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

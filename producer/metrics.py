"""The gateway's Prometheus metrics, served at ``GET /metrics``.

One ``GatewayMetrics`` per gateway process (the ``Gateway`` owns it); every metric is declared
here once, with its help text and fixed label names. Who calls what:

- ``app.py``, a ``/metrics`` route: ``metrics_response(registry, request.headers.get("accept"))``.
- ``instrument.py`` ``Observation.end``, once per answered request of any route or transport,
  errors included: ``observe_request(model, version, endpoint, status, seconds, body_bytes=...)``.
  ``model=None`` (and ``version=None``) when the request never resolved to a known model (404 for
  an unknown name, 400 before the lookup): labels must never carry a name a client made up.
  ``body_bytes`` is the declared body size for ``infer`` and ``job_submit``, None elsewhere.
- ``service.py`` ``InferenceService.prepare``, after the cache ``GET``:
  ``observe_cache(model, hit=...)`` (only when the cache was consulted).
- ``service.py``, where a request is turned away before it is queued (``prepare`` for no live
  worker, ``_redis`` for Redis down, ``_admit`` for the backlog cap, the deadline estimate and
  the breaker): ``observe_rejected(model, reason)`` (see ``REJECT_REASONS``).
- ``gateway.py`` ``Gateway.start``: ``track_waiters(lambda: self.replies.waiting)``; then
  ``StreamGauges(metrics, self.redis, self.keys, self.clock.now_ms)``, whose ``run`` is one of
  the gateway's loops.

Stream gauges (length, lag, pending, live consumers, oldest pending age, dead letters) come from
the published backlog snapshot or ``runtime.lag.collect`` every ``interval_s`` (5 s), not per
scrape, so a scrape storm costs Redis nothing. Every gateway exports them: aggregate with
``max by (model, lane)``, never ``sum``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis.asyncio as aioredis
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from redis.exceptions import RedisError
from starlette.responses import Response

from protocol.keys import Keys
from protocol.stats import StatsSnapshot
from runtime.aio import cancelling
from runtime.backoff import Backoff
from runtime.lag import Backlog, LagError, collect
from runtime.metrics import (
    BYTES_BUCKETS,
    LATENCY_BUCKETS,
    RuntimeGauges,
    exposition,
    new_registry,
)
from runtime.stats import to_backlog

log = structlog.get_logger("inferq.gateway")

ENDPOINTS = (
    "infer",
    "model_metadata",
    "model_ready",
    "server_metadata",
    "health_live",
    "health_ready",
    "metrics",
    "job_submit",
    "job_status",
    "job_cancel",
    "job_events",
    "batch_events",
    "batch_create",
    "batch_list",
    "batch_status",
    "batch_delete",
    "batch_cancel",
    "batch_output",
    "batch_errors",
    "openapi",
)
"""Values of the ``endpoint`` label; anything else is recorded as ``other``."""

REJECT_REASONS = (
    "no_workers",
    "backlog_full",
    "wait_exceeds_deadline",
    "breaker_open",
    "redis_unavailable",
)
"""Values of the ``reason`` label of ``inferq_gateway_rejected_total``, one per way a request is
turned away before it is queued: no live worker (503), the backlog at ``max_backlog`` (429), the
estimated queue wait longer than the deadline (429), the model's circuit breaker open (503),
Redis unreachable or refusing writes (503). Anything else is recorded as ``other``."""

STREAM_REFRESH_S = 5.0


def _status_class(status: int) -> str:
    return f"{status // 100}xx" if 100 <= status < 600 else "other"


def _one_of(value: str, allowed: tuple[str, ...]) -> str:
    return value if value in allowed else "other"


class GatewayMetrics:
    """Every metric one gateway process exports, in its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._request_children: dict[
            tuple[str | None, str | None, str, int, str], tuple[Any, ...]
        ] = {}
        self.registry = new_registry() if registry is None else registry
        r = self.registry
        self.requests = Counter(
            "inferq_gateway_requests_total",
            "Requests answered, by model, version, endpoint, HTTP status code (a gRPC call "
            "counts under the HTTP status its gRPC code stands for) and protocol (http, grpc); "
            "model and version are empty when the request named no known model.",
            ["model", "version", "endpoint", "status", "protocol"],
            registry=r,
        )
        self.request_duration = Histogram(
            "inferq_gateway_request_duration_seconds",
            "End-to-end time from the request reaching the route to the response being ready, "
            "by model, version (the one it was routed to: compare a canary with the rest), "
            "endpoint, status class (2xx, 4xx, 5xx) and protocol (http, grpc).",
            ["model", "version", "endpoint", "status_class", "protocol"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_body = Histogram(
            "inferq_gateway_request_body_bytes",
            "Size of inference request bodies after decompression, by model.",
            ["model"],
            buckets=BYTES_BUCKETS,
            registry=r,
        )
        self.cache_hits = Counter(
            "inferq_gateway_cache_hits_total",
            "Inference requests answered from the result cache without queueing, by model.",
            ["model"],
            registry=r,
        )
        self.cache_misses = Counter(
            "inferq_gateway_cache_misses_total",
            "Inference requests that looked in the result cache, found nothing and were queued, "
            "by model.",
            ["model"],
            registry=r,
        )
        self.rejected = Counter(
            "inferq_gateway_rejected_total",
            "Inference requests turned away before queueing, by model and reason (no_workers, "
            "backlog_full, wait_exceeds_deadline, breaker_open, redis_unavailable).",
            ["model", "reason"],
            registry=r,
        )
        self.waiting = Gauge(
            "inferq_gateway_waiting_requests",
            "Requests queued by this gateway and waiting for their result (in-flight waiters).",
            registry=r,
        )
        self.batches_driven = Gauge(
            "inferq_gateway_batches_in_flight",
            "Batches not yet final that this gateway drives (holds the lease of); sum over "
            "gateways for the cluster's total.",
            registry=r,
        )
        self.batch_lines_pending = Gauge(
            "inferq_gateway_batch_lines_pending",
            "Input lines of the batches this gateway drives that are not answered yet.",
            registry=r,
        )
        self.batch_paced = Counter(
            "inferq_gateway_batch_paced_total",
            "Rounds of queueing batch lines that stopped early: the model's job backlog was "
            "at --max-job-backlog (or Redis refused), so the rest waited for the next round.",
            registry=r,
        )
        self.batch_lines = Counter(
            "inferq_gateway_batch_lines_total",
            "Batch lines answered by this gateway, by outcome (completed, failed).",
            ["outcome"],
            registry=r,
        )
        lane = ["model", "lane"]
        self.stream_length = Gauge(
            "inferq_stream_length",
            "Entries in a model's request stream (XLEN), read or not, by model and lane.",
            lane,
            registry=r,
        )
        self.stream_lag = Gauge(
            "inferq_stream_lag",
            "Entries in a model's request stream that no worker has read yet (consumer-group "
            "lag, XINFO GROUPS), by model and lane.",
            lane,
            registry=r,
        )
        self.stream_pending = Gauge(
            "inferq_stream_pending",
            "Entries read by a worker and not yet acknowledged (XPENDING), by model and lane.",
            lane,
            registry=r,
        )
        self.stream_consumers = Gauge(
            "inferq_stream_consumers",
            "Live workers (current heartbeat) in the consumer group of a model's request "
            "stream, by model and lane.",
            lane,
            registry=r,
        )
        self.stream_oldest_pending_age = Gauge(
            "inferq_stream_oldest_pending_age_seconds",
            "Time since the oldest pending (read, unacknowledged) entry was enqueued; 0 when "
            "nothing is pending. By model and lane.",
            lane,
            registry=r,
        )
        self.model_backlog = Gauge(
            "inferq_model_backlog",
            "Requests queued for a model and not yet answered (lag + pending), summed over its "
            "lanes and partitions: the signal to scale workers on (one series per model, so a "
            "KEDA Prometheus trigger sees the total, not the largest partition).",
            ["model"],
            registry=r,
        )
        self.partition_backlog = Gauge(
            "inferq_stream_partition_backlog",
            "Lag + pending of one partition of a model (partitions = N in its config), summed "
            "over its lanes; partition 0 only for unpartitioned models.",
            ["model", "partition"],
            registry=r,
        )
        self.dlq_length = Gauge(
            "inferq_dlq_length",
            "Entries in a model's dead-letter stream ({ns}:dlq:{model}).",
            ["model"],
            registry=r,
        )
        self.stream_refreshed = Gauge(
            "inferq_stream_gauges_last_refresh_timestamp_seconds",
            "Unix time of the last successful refresh of the inferq_stream_* and "
            "inferq_dlq_length gauges.",
            registry=r,
        )
        self.stream_refresh_failures = Counter(
            "inferq_stream_gauges_refresh_failures_total",
            "Refreshes of the stream gauges that failed (Redis unreachable or refused).",
            registry=r,
        )
        self.runtime = RuntimeGauges(r)
        self.webhooks = WebhookMetrics(r)

    def observe_request(
        self,
        model: str | None,
        version: str | None,
        endpoint: str,
        status: int,
        seconds: float,
        *,
        body_bytes: int | None = None,
        protocol: str = "http",
        exemplar: dict[str, str] | None = None,
    ) -> None:
        """One answered request (any status); ``protocol`` is ``http`` or ``grpc``.
        ``exemplar`` (a sampled request's trace id) labels its duration observation, shown in
        the OpenMetrics exposition."""
        key = (model, version, endpoint, status, protocol)
        children = self._request_children.get(key)
        if children is None:
            # labels() resolves and validates on every call; the label sets are few and fixed,
            # so resolve each once (this runs on every request).
            label = _one_of(endpoint, ENDPOINTS)
            children = self._request_children[key] = (
                self.requests.labels(model or "", version or "", label, str(status), protocol),
                self.request_duration.labels(
                    model or "", version or "", label, _status_class(status), protocol
                ),
                self.request_body.labels(model or ""),
            )
        count, duration, body = children
        count.inc()
        duration.observe(seconds, exemplar)
        if body_bytes is not None:
            body.observe(body_bytes)

    def observe_cache(self, model: str, *, hit: bool) -> None:
        (self.cache_hits if hit else self.cache_misses).labels(model).inc()

    def observe_rejected(self, model: str, reason: str) -> None:
        self.rejected.labels(model, _one_of(reason, REJECT_REASONS)).inc()

    def track_waiters(self, count: Callable[[], int]) -> None:
        """Read the number of waiting requests at scrape time (``ReplyListener.waiting``)."""
        self.waiting.set_function(count)


WEBHOOK_FAILURES = ("http_4xx", "http_5xx", "http_other", "timeout", "connect", "refused")
"""Values of the ``reason`` label of ``inferq_webhook_failures_total``: the receiver answered
4xx, 5xx or another non-2xx; no answer in ``--webhook-timeout-s``; no connection (refused,
reset, unresolvable host); the SSRF guard refused the address (never retried)."""


class WebhookMetrics:
    """The webhook deliverer's metrics (``producer.webhooks``), by kind (job, batch)."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.deliveries = Counter(
            "inferq_webhook_deliveries_total",
            "Webhook deliveries a receiver accepted (2xx), by kind and event (status).",
            ["kind", "event"],
            registry=r,
        )
        self.failures = Counter(
            "inferq_webhook_failures_total",
            "Webhook attempts that failed, by kind and reason (http_4xx, http_5xx, http_other, "
            "timeout, connect, refused).",
            ["kind", "reason"],
            registry=r,
        )
        self.retries = Counter(
            "inferq_webhook_retries_total",
            "Webhook attempts after a delivery's first, by kind.",
            ["kind"],
            registry=r,
        )
        self.dead_letters = Counter(
            "inferq_webhook_dead_letters_total",
            "Webhook deliveries given up and written to the webhook dead-letter stream, by kind.",
            ["kind"],
            registry=r,
        )
        self.lag = Histogram(
            "inferq_webhook_delivery_lag_seconds",
            "From the event (the job's or batch's change, on the Redis clock) to the receiver's "
            "2xx, retries included, by kind.",
            ["kind"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.held = Gauge(
            "inferq_webhook_held",
            "Webhook deliveries this gateway holds: being sent or waiting to be retried.",
            registry=r,
        )
        self.backlog = Gauge(
            "inferq_webhook_backlog",
            "Events no gateway's webhook deliverer has read yet (the webhook group's lag on "
            "the events stream), as this gateway last read it.",
            registry=r,
        )
        self.pending = Gauge(
            "inferq_webhook_pending",
            "Events read by some gateway's webhook deliverer and not yet done with (the "
            "group's pending entries), as this gateway last read it.",
            registry=r,
        )

    def failed(self, kind: str, reason: str) -> None:
        self.failures.labels(kind, _one_of(reason, WEBHOOK_FAILURES)).inc()


def metrics_response(registry: CollectorRegistry, accept: str | None = None) -> Response:
    """The body of ``GET /metrics``: pass the request's ``Accept`` header for OpenMetrics."""
    body, content_type = exposition(registry, accept)
    return Response(body, headers={"content-type": content_type})


class StreamGauges:
    """Keeps the stream gauges of ``GatewayMetrics`` current, every ``interval_s``: from the
    published backlog snapshot when a fresh one exists, else from ``runtime.lag.collect``
    (without ``SCAN``).

    ``run`` is a loop the gateway's ``Loops`` owns. A failed refresh keeps the previous values,
    counts a failure and logs once until it recovers; the last-refresh timestamp tells a
    dashboard how stale they are. Series of lanes, partitions and models that disappear are
    removed.
    """

    def __init__(
        self,
        metrics: GatewayMetrics,
        redis: aioredis.Redis,
        keys: Keys,
        clock_now_ms: Callable[[], int] | None = None,
        *,
        interval_s: float = STREAM_REFRESH_S,
        backoff: Backoff | None = None,
        stats: Callable[[], StatsSnapshot | None] | None = None,
    ) -> None:
        self.metrics = metrics
        self._stats = stats
        """The published backlog snapshot, when fresh (the registry keeps the latest)."""
        self._backoff = backoff or Backoff("stream-gauges", log, critical=False)
        self._redis = redis
        self._keys = keys
        self._now_ms = clock_now_ms
        self.interval_s = interval_s
        self._shown: dict[Gauge, set[tuple[str, ...]]] = {}

    async def refresh(self) -> None:
        """One refresh; Redis errors propagate (``run`` counts and logs them)."""
        stats = self._stats() if self._stats is not None else None
        if stats is not None:
            self.apply(to_backlog(stats, self._keys))
        else:
            self.apply(await collect(self._redis, self._keys, self._now_ms, scan=False))

    def apply(self, backlog: Backlog) -> None:
        """Set the gauges from one reading: per model and lane summed over partitions (the
        oldest pending age and live consumers: the largest), per partition, per model."""
        m = self.metrics
        lanes = backlog.by(lambda r: (r.model, r.lane.value))
        self._set(m.stream_length, {k: t.length for k, t in lanes.items()})
        self._set(m.stream_lag, {k: t.lag for k, t in lanes.items()})
        self._set(m.stream_pending, {k: t.pending for k, t in lanes.items()})
        self._set(m.stream_consumers, {k: t.consumers for k, t in lanes.items()})
        ages = {k: (t.oldest_pending_ms or 0) / 1000 for k, t in lanes.items()}
        self._set(m.stream_oldest_pending_age, ages)
        partitions = backlog.by(lambda r: (r.model, str(r.partition)))
        self._set(m.partition_backlog, {k: t.backlog for k, t in partitions.items()})
        models = backlog.by(lambda r: (r.model,))
        self._set(m.model_backlog, {k: t.backlog for k, t in models.items()})
        self._set(m.dlq_length, {(k,): n for k, n in backlog.dead_letters.items()})
        m.stream_refreshed.set(time.time())

    def _set(self, gauge: Gauge, values: Mapping[Any, float]) -> None:
        """Set each series of ``values`` (keyed by label tuples); remove the ones gone since."""
        for labels, value in values.items():
            gauge.labels(*labels).set(value)
        for labels in self._shown.get(gauge, set()) - values.keys():
            gauge.remove(*labels)
        self._shown[gauge] = set(values)

    async def run(self) -> None:
        """Refresh now, then every ``interval_s``, until cancelled."""
        while not cancelling():
            try:
                await self.refresh()
                self._backoff.succeeded()
            except (RedisError, OSError, LagError) as e:  # runtime.faults.RETRYABLE and more
                self.metrics.stream_refresh_failures.inc()
                self._backoff.record(e)
            await asyncio.sleep(self.interval_s)

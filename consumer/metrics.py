"""The worker's Prometheus metrics, served on ``--metrics-host``:``--metrics-port``
(``INFERQ_METRICS_HOST``, ``INFERQ_METRICS_PORT``).

One ``WorkerMetrics`` per worker process (the ``Worker`` owns it); every metric is declared here
once, with its help text and fixed label names. Who calls what:

- ``Worker.start``: ``set_info(self.id)``, ``track_held(lambda: self.holding)``; when the
  metrics port is not 0, ``MetricsServer(metrics.registry, port, host).start()``. ``Worker.stop``
  calls ``await asyncio.to_thread(server.stop)`` last.
- ``Reader.accept`` (entries from a read or a reclaim), once per call with a value per request
  decoded and queued: ``observe_dequeued_many(model, lane, [(now_ms - request.enqueued_ms) /
  1000, ...])`` (lane: ``LANES_BY_PRIORITY[slot.lane_of[stream]].value``); per entry sent to
  the dead-letter stream: ``observe_dead_letter(model, "undecodable")``, or ``"poison"`` when
  ``poison(i)`` named a reason.
- ``Worker._run_batch``, after the model call: ``observe_batch(model, requests=len(batch),
  rows=sum of rows_of(request), batch_waits_s=[started - d.read_at ...],
  inference_s=outcome.infer_s)``, and ``observe_results({(model, version, status): count})``.
- ``Worker._answer_expired``: ``observe_expired(model, len(deliveries))``.
- ``Dispatcher._drop_cancelled``, where a batch forms: ``observe_cancelled(model, count)`` for the
  requests dropped because their callers had gone.
- ``ResultWriter``, once the pipeline holding results and their reply notifications completed:
  ``observe_replies(model, [time.monotonic() - finished_at, ...])``, where ``finished_at`` is
  when the model call (or the expiry answer) ended; ``Outgoing`` carries the model and that
  time.
- ``ResultWriter``, per write step Redis refused: ``observe_write_failure(model, fault)``
  (``runtime.faults.classify``).
- ``Worker.start``: ``runtime.track_loops(loops.health)``; the advertiser's eviction check:
  ``runtime.set_policy(policy, evicting)``.
- ``Reclaimer.reclaim``, after ``XCLAIM``: ``observe_reclaimed(model, len(claimed))``, and
  ``observe_retry(model)`` for each claimed entry that will run again (not poison).
- ``Dispatcher._claim_jobs``, per job claimed again (a lapsed lease, a lost claim reply):
  ``observe_job_run_again(model)``.
- ``Worker.start``, for a model whose committed policy it cannot serve (a version the policy
  names has no folder, or does not load) and serves as its repository config says instead:
  ``observe_policy_fallback(model)``.
- ``OnDemand`` (``--load on-demand``), per load: ``observe_load(model, seconds, resident_bytes)``;
  per unload: ``observe_unload(model, reason)`` (reason: budget, idle or control).

Queue wait is measured on the Redis clock (gateway ``enqueued_ms`` to worker read), so host
clock skew does not enter it; the other stages use this process's monotonic clock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

import runtime
from runtime.faults import Fault
from runtime.metrics import COUNT_BUCKETS, LATENCY_BUCKETS, RuntimeGauges, new_registry

RESULT_STATUSES = ("ok", "invalid", "failed")
"""Values of the ``status`` label of ``inferq_worker_requests_total`` (``protocol.messages.Status``
less ``expired``, which has its own counter); else ``other``."""

UNLOAD_REASONS = ("budget", "idle", "control")
"""Values of the ``reason`` label of ``inferq_worker_model_unloads_total``: ``budget``, to make
room under ``--max-loaded-models`` or ``--max-model-memory-mib``; ``idle``, after
``--unload-idle-s`` without a request; ``control``, an administrator's unload."""

LOAD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
"""Model load seconds: a small ONNX graph loads in milliseconds, a large model in a minute."""

DEAD_LETTER_REASONS = ("undecodable", "poison")
"""``undecodable``: not a request message; ``poison``: delivered ``--max-deliveries`` times
without completing (it may crash workers). Anything else is recorded as ``other``."""


WRITE_FAILURE_REASONS = tuple(f.value for f in Fault)
"""Values of the ``reason`` label of ``inferq_worker_write_failures_total``: the kind of Redis
error (``runtime.faults.Fault``): oom, readonly, moved, tryagain, connection, ..."""


def _one_of(value: str, allowed: tuple[str, ...]) -> str:
    return value if value in allowed else "other"


class WorkerMetrics:
    """Every metric one worker process exports, in its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = new_registry() if registry is None else registry
        r = self.registry
        model = ["model"]
        self.requests = Counter(
            "inferq_worker_requests_total",
            "Requests run by this worker, by model, version and outcome (ok, invalid, failed).",
            ["model", "version", "status"],
            registry=r,
        )
        self.expired = Counter(
            "inferq_worker_expired_total",
            "Requests dropped unrun because their deadline passed before their batch started.",
            model,
            registry=r,
        )
        self.cancelled = Counter(
            "inferq_worker_cancelled_total",
            "Requests dropped unrun because their callers had gone (an HTTP client hung up, a "
            "call was cancelled) before their batch started, by model.",
            model,
            registry=r,
        )
        self.dead_lettered = Counter(
            "inferq_worker_dead_lettered_total",
            "Stream entries moved to the model's dead-letter stream, by model and reason "
            "(undecodable, poison: delivered too often without completing).",
            ["model", "reason"],
            registry=r,
        )
        self.retried = Counter(
            "inferq_worker_retried_total",
            "Requests run again after an interrupted attempt (reclaimed from a worker that "
            "died or stalled), by model.",
            model,
            registry=r,
        )
        self.reclaimed = Counter(
            "inferq_worker_reclaimed_total",
            "Pending entries of dead or stalled workers claimed by this worker (XCLAIM), by model.",
            model,
            registry=r,
        )
        self.jobs_run_again = Counter(
            "inferq_worker_jobs_run_again_total",
            "Async jobs this worker claimed again and ran: found running under a lapsed lease "
            "(their worker died or stalled) or under this worker's own claim whose reply was "
            "lost, by model.",
            model,
            registry=r,
        )
        self.rows = Counter(
            "inferq_worker_rows_total",
            "Input rows passed to the model (sum over batches); rate() gives rows per second.",
            model,
            registry=r,
        )
        self.queue_wait = Histogram(
            "inferq_worker_queue_wait_seconds",
            "Time from the gateway enqueueing a request to a worker reading it (Redis clock), "
            "by model and lane.",
            ["model", "lane"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_wait = Histogram(
            "inferq_worker_batch_wait_seconds",
            "Time from a worker reading a request to the start of the model call that runs it "
            "(batch formation), by model.",
            model,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inference = Histogram(
            "inferq_worker_inference_seconds",
            "Duration of one model call (one batch), by model.",
            model,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.reply = Histogram(
            "inferq_worker_reply_seconds",
            "Time from the end of the model call to the completed write of the result and the "
            "reply notification, by model.",
            model,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_requests = Histogram(
            "inferq_worker_batch_requests",
            "Requests per model call, by model.",
            model,
            buckets=COUNT_BUCKETS,
            registry=r,
        )
        self.batch_rows = Histogram(
            "inferq_worker_batch_rows",
            "Input rows per model call (the batch size the model sees), by model.",
            model,
            buckets=COUNT_BUCKETS,
            registry=r,
        )
        self.write_failures = Counter(
            "inferq_worker_write_failures_total",
            "Result, reply, job-transition or dead-letter writes Redis refused, by model and "
            "reason (oom, readonly, moved, tryagain, connection, ...). Each is retried; the "
            "entry is not acknowledged until everything it needs is stored.",
            ["model", "reason"],
            registry=r,
        )
        self.policy_fallbacks = Counter(
            "inferq_worker_policy_fallbacks_total",
            "Times this worker could not serve a model's committed admin policy (a version it "
            "names has no folder in the repository, or does not load) and served the model as "
            "its repository config says instead, by model. `inferq models reset MODEL` or a "
            "new load clears the policy.",
            model,
            registry=r,
        )
        self.loads = Counter(
            "inferq_worker_model_loads_total",
            "Models this worker loaded on demand (--load on-demand), by model.",
            model,
            registry=r,
        )
        self.unloads = Counter(
            "inferq_worker_model_unloads_total",
            "Models this worker unloaded, by model and reason: budget (to make room under "
            "--max-loaded-models or --max-model-memory-mib), idle (--unload-idle-s), control (an "
            "administrator's unload).",
            ["model", "reason"],
            registry=r,
        )
        self.load_seconds = Histogram(
            "inferq_worker_model_load_seconds",
            "Seconds an on-demand load took (every version loaded and warmed), by model.",
            model,
            buckets=LOAD_BUCKETS,
            registry=r,
        )
        self.loaded_models = Gauge(
            "inferq_worker_loaded_models",
            "Models this worker holds loaded now.",
            registry=r,
        )
        self.resident_bytes = Gauge(
            "inferq_worker_model_resident_bytes",
            "Resident memory each loaded model added to this worker when it loaded (RSS "
            "delta), by model; what --max-model-memory-mib counts.",
            model,
            registry=r,
        )
        self.runtime = RuntimeGauges(r)
        self.held = Gauge(
            "inferq_worker_held_entries",
            "Stream entries this worker has read and not yet acknowledged.",
            registry=r,
        )
        self.info = Info(
            "inferq_worker",
            "This worker's id (its consumer name in the group) and the inferq release.",
            registry=r,
        )
        self._queue_waits: dict[tuple[str, str], Histogram] = {}

    def set_info(self, worker_id: str) -> None:
        self.info.info({"worker": worker_id, "version": runtime.__version__})

    def track_held(self, count: Callable[[], int]) -> None:
        """Read the held-entry count at scrape time (``Worker.holding``)."""
        self.held.set_function(count)

    def observe_dequeued(self, model: str, lane: str, queue_wait_s: float) -> None:
        self.observe_dequeued_many(model, lane, (queue_wait_s,))

    def observe_dequeued_many(self, model: str, lane: str, queue_waits_s: Iterable[float]) -> None:
        """Requests of one model and lane read together: one queue-wait value per request, the
        labelled child looked up once (in a dict of our own, not by labels())."""
        child = self._queue_waits.get((model, lane))
        if child is None:
            child = self._queue_waits[(model, lane)] = self.queue_wait.labels(model, lane)
        for seconds in queue_waits_s:
            child.observe(max(0.0, seconds))

    def observe_batch(
        self,
        model: str,
        *,
        requests: int,
        rows: int,
        batch_waits_s: Sequence[float],
        inference_s: float,
        exemplar: dict[str, str] | None = None,
    ) -> None:
        """One model call: its size, its duration, and each request's batch-formation wait.
        ``exemplar`` (the inference span's trace id, when sampled) labels the duration."""
        self.batch_requests.labels(model).observe(requests)
        self.batch_rows.labels(model).observe(rows)
        self.rows.labels(model).inc(rows)
        self.inference.labels(model).observe(inference_s, exemplar)
        wait = self.batch_wait.labels(model)
        for seconds in batch_waits_s:
            wait.observe(max(0.0, seconds))

    def observe_results(self, counts: Mapping[tuple[str, str, str], int]) -> None:
        """A batch's results: how many per (model, version, status)."""
        for (model, version, status), count in counts.items():
            self.requests.labels(model, version, _one_of(status, RESULT_STATUSES)).inc(count)

    def observe_expired(self, model: str, count: int = 1) -> None:
        self.expired.labels(model).inc(count)

    def observe_cancelled(self, model: str, count: int = 1) -> None:
        self.cancelled.labels(model).inc(count)

    def observe_dead_letter(self, model: str, reason: str) -> None:
        self.dead_lettered.labels(model, _one_of(reason, DEAD_LETTER_REASONS)).inc()

    def observe_retry(self, model: str, count: int = 1) -> None:
        self.retried.labels(model).inc(count)

    def observe_job_run_again(self, model: str) -> None:
        self.jobs_run_again.labels(model).inc()

    def observe_reclaimed(self, model: str, count: int = 1) -> None:
        self.reclaimed.labels(model).inc(count)

    def observe_replies(self, model: str, seconds: Sequence[float]) -> None:
        """A flush's stored results of one model: each one's time since its model call ended."""
        reply = self.reply.labels(model)
        for s in seconds:
            reply.observe(max(0.0, s))

    def observe_policy_fallback(self, model: str) -> None:
        self.policy_fallbacks.labels(model).inc()

    def track_loaded(self, count: Callable[[], int]) -> None:
        """Read the loaded-model count at scrape time."""
        self.loaded_models.set_function(count)

    def observe_load(self, model: str, seconds: float, resident_bytes: int) -> None:
        self.loads.labels(model).inc()
        self.load_seconds.labels(model).observe(max(0.0, seconds))
        self.resident_bytes.labels(model).set(resident_bytes)

    def observe_unload(self, model: str, reason: str) -> None:
        self.unloads.labels(model, _one_of(reason, UNLOAD_REASONS)).inc()
        with contextlib.suppress(KeyError):  # loaded at start: never measured
            self.resident_bytes.remove(model)

    def observe_write_failure(self, model: str, reason: str) -> None:
        self.write_failures.labels(model, _one_of(reason, WRITE_FAILURE_REASONS)).inc()

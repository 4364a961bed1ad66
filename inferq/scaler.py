"""The autoscaler of ``inferq up --workers MIN:MAX``: a backlog reader, the policy, the metrics.

- ``BacklogProbe`` reads the backlog of every model of the namespace (``runtime.lag.collect``,
  one pipelined round trip, the models from the ``{ns}:models`` hash, no ``SCAN``) every
  ``--scale-interval-s`` on a thread of its own, with its own event loop and Redis client: the
  supervisor's loop is synchronous and must never wait on Redis.
- ``Autoscaler.tick`` runs on the supervisor's thread after each of its ticks: it feeds each new
  reading to the pure ``ScalingPolicy`` (``inferq.autoscale``), logs every change with its
  reason and the reading behind it, counts it, and applies it with ``Supervisor.scale``.
- ``UpMetrics``: the workers wanted and running, and the scaling events by reason and
  direction, on ``--scale-metrics-port`` when it is set (``inferq up`` has no HTTP server of its
  own; the gateways' ``/metrics`` belong to their own processes, and a port of its own keeps the
  supervisor free of a web stack).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from inferq.autoscale import Reading, Reason, Scaling, ScalingPolicy
from inferq.supervisor import Supervisor
from protocol.keys import Keys
from runtime.backoff import Backoff
from runtime.connections import RedisSettings
from runtime.faults import RETRYABLE
from runtime.lag import LagError, Totals, collect

log = structlog.get_logger("inferq.up")

_ERRORS: tuple[type[BaseException], ...] = (*RETRYABLE, LagError)

STALE_AFTER_INTERVALS = 3
"""A reading older than this many intervals is none (the probe cannot reach Redis)."""


@dataclass(frozen=True, slots=True)
class Sample:
    seq: int
    """Counts the readings taken: the autoscaler feeds each one to the policy once."""
    at: float
    """When it was taken (monotonic)."""
    reading: Reading


def reading_of(totals: Totals) -> Reading:
    """The policy's reading of every lane summed: the live consumers of the busiest lane are
    the workers serving (all of up's workers serve the same models)."""
    age = totals.oldest_pending_ms
    return Reading(totals.backlog, None if age is None else age / 1000, totals.consumers)


class BacklogProbe:
    """The latest backlog of the namespace, read every ``interval_s`` by a thread it owns."""

    def __init__(
        self,
        redis: RedisSettings,
        keys: Keys,
        interval_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self.interval_s = interval_s
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._sample: Sample | None = None

    def start(self) -> None:
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._run()), name="backlog-probe", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.interval_s + self._redis.socket_timeout_s + 1)
            self._thread = None

    def latest(self) -> Sample | None:
        """The last reading, or None when there is none younger than a few intervals."""
        with self._lock:
            sample = self._sample
        if sample is None or self._clock() - sample.at > self.interval_s * STALE_AFTER_INTERVALS:
            return None
        return sample

    async def _run(self) -> None:
        from runtime.broker import connect

        backoff = Backoff("backlog probe", log, critical=False)
        broker = None
        seq = 0
        try:
            while not self._stop.is_set():
                try:
                    if broker is None:
                        broker = await connect(self._redis, name="inferq-up-scaler")
                    backlog = await collect(broker.commands, self._keys, scan=False)
                except _ERRORS as e:
                    backoff.record(e)
                else:
                    backoff.succeeded()
                    seq += 1
                    sample = Sample(seq, self._clock(), reading_of(Totals.of(backlog.lanes)))
                    with self._lock:
                        self._sample = sample
                await asyncio.to_thread(self._stop.wait, self.interval_s)
        finally:
            if broker is not None:
                await broker.aclose()


class UpMetrics:
    """What ``inferq up`` exports about its workers, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.workers_wanted = Gauge(
            "inferq_up_workers_wanted",
            "Worker processes the autoscaler wants (MIN..MAX of --workers)",
            registry=self.registry,
        )
        self.workers_running = Gauge(
            "inferq_up_workers_running",
            "Worker processes running and wanted (starting ones included, draining ones not)",
            registry=self.registry,
        )
        self.scaling_events = Counter(
            "inferq_up_scaling_events",
            "Changes of the wanted worker count, by reason and direction (up, down)",
            ["reason", "direction"],
            registry=self.registry,
        )
        for reason in Reason:
            for direction in ("up", "down"):
                self.scaling_events.labels(reason.value, direction)


class Autoscaler:
    """Applies the policy's decisions to the supervisor's worker slots (see the module)."""

    def __init__(
        self,
        policy: ScalingPolicy,
        supervisor: Supervisor,
        probe: Any,
        metrics: UpMetrics,
        *,
        stop_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        logger: Any = log,
    ) -> None:
        self.policy = policy
        self._supervisor = supervisor
        self._probe = probe
        self._metrics = metrics
        self._stop_timeout_s = stop_timeout_s
        self._clock = clock
        self._log = logger
        self._seen = 0
        metrics.workers_wanted.set(policy.wanted)

    def tick(self) -> None:
        sample = self._probe.latest()
        if sample is None or sample.seq != self._seen:
            if sample is not None:
                self._seen = sample.seq
            change = self.policy.observe(None if sample is None else sample.reading, self._clock())
            if change is not None:
                self._apply(change)
        self._metrics.workers_running.set(self._supervisor.running("worker"))

    def _apply(self, change: Scaling) -> None:
        direction = "up" if change.up else "down"
        r = change.reading
        self._log.info(
            f"scaling {direction}",
            workers_before=change.before,
            workers_wanted=change.wanted,
            reason=change.reason.value,
            backlog=r.backlog,
            oldest_wait_s=None if r.oldest_wait_s is None else round(r.oldest_wait_s, 3),
        )
        self._metrics.workers_wanted.set(change.wanted)
        self._metrics.scaling_events.labels(change.reason.value, direction).inc()
        self._supervisor.scale("worker", change.wanted, stop_timeout_s=self._stop_timeout_s)

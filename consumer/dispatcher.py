"""One dispatcher per served model: asks the batch policy when to run, drops what expired,
drops requests whose callers have gone (``protocol.cancellation``), claims the batch's async
jobs, runs the batch on the model's own thread (the event loop keeps reading meanwhile) or, for a
model measured to be quick, on the loop itself (``consumer.inline``), and hands every outcome to
the writer.

Its Redis commands are the cancellation lookup and the job claim. When Redis cannot answer the
lookup the requests run (it only costs work); when it refuses the claim, the jobs go back to the
queue and the dispatcher backs off before it tries again, while the synchronous requests of the
batch run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable

import redis.asyncio as aioredis
import structlog
from redis.commands.core import AsyncScript

from consumer.batcher import Queued
from consumer.ledger import Ledger
from consumer.metrics import WorkerMetrics
from consumer.model import BatchOutcome, rows_of
from consumer.outgoing import Outcomes, Outgoing
from consumer.slots import Delivery, ModelSlot
from consumer.stats import WorkerStats
from protocol.cancellation import CHECK_AFTER_MS, cancelled_of
from protocol.jobs import JobStatus, transition_args
from protocol.keys import Keys
from protocol.messages import Kind, Status
from runtime.aio import cancelling
from runtime.backoff import Backoff
from runtime.cluster import script_per_slot
from runtime.faults import RETRYABLE
from runtime.tracing import Tracer

log = structlog.get_logger("inferq.worker")


class Dispatcher:
    def __init__(
        self,
        slot: ModelSlot,
        *,
        redis: aioredis.Redis,
        worker_id: str,
        keys: Keys,
        ledger: Ledger,
        outcomes: Outcomes,
        put: Callable[[list[Outgoing]], None],
        transition: AsyncScript,
        now_ms: Callable[[], int],
        wake_reader: Callable[[], None],
        draining: Callable[[], bool],
        metrics: WorkerMetrics,
        stats: WorkerStats,
        backoff: Backoff,
        tracer: Tracer | None = None,
    ) -> None:
        self.slot = slot
        self._redis = redis
        self._worker_id = worker_id
        self._keys = keys
        self._ledger = ledger
        self._outcomes = outcomes
        self._put = put
        self._transition = transition
        self._now_ms = now_ms
        self._wake_reader = wake_reader
        self._draining = draining
        self._metrics = metrics
        self._stats = stats
        self._backoff = backoff
        self._tracer = tracer if tracer is not None and tracer.enabled else None

    async def run(self) -> None:
        slot = self.slot
        while not cancelling():
            now = time.monotonic()
            self._drop_expired(now)
            if len(slot.queue):
                slot.idle.clear()
            else:
                slot.idle.set()
            wait = slot.policy.wait_s(
                slot.queue, now, drained=slot.drained or self._draining(), service_s=slot.service_s
            )
            if wait != 0.0:
                slot.changed.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):  # no task per wait, unlike wait_for
                        await slot.changed.wait()
                continue
            slot.busy = True
            self._wake_reader()
            try:
                taken = await self._drop_cancelled(slot.queue.take(slot.batch_limit()))
                batch = await self._claim_jobs(taken)
                if batch:
                    await self._run_batch(batch)
            finally:
                slot.busy = False
                self._wake_reader()

    def _drop_expired(self, now: float) -> None:
        expired = [q.item for q in self.slot.queue.drop_expired(now)]
        if not expired:
            return
        self._stats.expired += len(expired)
        self._metrics.observe_expired(self.slot.model.name, len(expired))
        for d in expired:
            r = d.request
            log.info(
                "request expired before it ran",
                request_id=r.id,
                model=r.model,
                version=r.version,
                traceparent=r.traceparent,
            )
        self._put([self._outcomes.expired(d) for d in expired])
        self._wake_reader()

    async def _drop_cancelled(self, batch: list[Queued[Delivery]]) -> list[Queued[Delivery]]:
        """Acknowledge, unrun, the requests whose callers have gone (``protocol.cancellation``):
        one ZMSCORE for the whole batch. If Redis cannot say, they run (it only costs work)."""
        oldest = self._now_ms() - CHECK_AFTER_MS
        # Jobs (no caller waits on a reply stream) are cancelled through their record instead.
        ids = [
            q.item.request.id
            for q in batch
            if q.item.request.reply_to and q.item.request.enqueued_ms <= oldest
        ]
        if not ids:
            return batch
        model = self.slot.model.name
        try:
            scores = await self._redis.zmscore(self._keys.cancelled(model), ids)
        except RETRYABLE as e:
            log.warning("could not check for cancelled requests", error=str(e))
            return batch
        gone = cancelled_of(ids, scores)
        if not gone:
            return batch
        dropped = [q.item for q in batch if q.item.request.id in gone]
        self._stats.cancelled += len(dropped)
        self._metrics.observe_cancelled(model, len(dropped))
        log.info("requests dropped: their callers have gone", model=model, count=len(dropped))
        self._put([self._outcomes.nothing(*d.entry) for d in dropped])
        return [q for q in batch if q.item.request.id not in gone]

    async def _claim_jobs(self, batch: list[Queued[Delivery]]) -> list[Delivery]:
        """Mark the batch's async jobs running; drop those cancelled or expired meanwhile.

        The check and the change are one atomic script, so a job cancelled before this point is
        never run, and a job claimed here can no longer be cancelled.
        """
        jobs = [q for q in batch if q.item.request.kind is Kind.JOB]
        if not jobs:
            return [q.item for q in batch]
        try:
            before = await script_per_slot(
                self._redis,
                self._transition,
                [self._keys.job(q.item.request.id) for q in jobs],
                [
                    JobStatus.QUEUED.value,
                    *transition_args(JobStatus.RUNNING, started_ms=self._now_ms()),
                ],
            )
        except RETRYABLE as e:
            for q in jobs:
                self.slot.queue.push(q)
            await self._backoff.failed(e)
            return [q.item for q in batch if q.item.request.kind is not Kind.JOB]
        self._backoff.succeeded()
        skipped: set[int] = set()
        for q, status in zip(jobs, before, strict=True):
            if status != JobStatus.QUEUED.value.encode():
                skipped.add(id(q))
                r = q.item.request
                log.info(
                    "job not run",
                    job_id=r.id,
                    model=r.model,
                    version=r.version,
                    status=status.decode() if status else "missing",
                    traceparent=r.traceparent,
                )
                self._stats.skipped_jobs += 1
        if skipped:
            self._put([self._outcomes.nothing(*q.item.entry) for q in jobs if id(q) in skipped])
        return [q.item for q in batch if id(q) not in skipped]

    async def _run_batch(self, batch: list[Delivery]) -> None:
        slot = self.slot
        self._ledger.running(d.entry for d in batch)
        requests = [d.request for d in batch]
        version, rows = requests[0].version, sum(rows_of(r) for r in requests)
        started = time.monotonic()
        inline = slot.inline.suits(version, rows)
        if inline:
            self._stats.inline_batches += 1
            outcome = slot.model.run(requests, self._worker_id)
        else:
            loop = asyncio.get_running_loop()
            outcome = await loop.run_in_executor(
                slot.executor, slot.model.run, requests, self._worker_id
            )
        slot.inline.observe(version, outcome.infer_s, rows, inline=inline)
        slot.service_s = (
            0.8 * slot.service_s + 0.2 * outcome.infer_s if slot.service_s else outcome.infer_s
        )
        self._observe(batch, outcome, started, rows)
        results = zip(batch, outcome.results, strict=True)
        self._put([self._outcomes.ran(d, result, started, len(batch)) for d, result in results])
        # An inline batch never awaited: let the writer send these results and the reader
        # read on before the next batch.
        await asyncio.sleep(0)

    def _observe(
        self, batch: list[Delivery], outcome: BatchOutcome, started: float, rows: int
    ) -> None:
        """Stats, metrics, the trace span and the logs of one batch: counted per batch, logged
        per request only when a request failed or debug logging is on."""
        slot = self.slot
        self._stats.batches += 1
        self._stats.requests += len(batch)
        self._stats.batch_sizes.append(len(batch))
        exemplar = None
        if self._tracer is not None:
            exemplar = self._tracer.batch(
                model=slot.model.name,
                worker=self._worker_id,
                requests=[(d.request.traceparent, d.read_at) for d in batch],
                started=started,
                finished=time.monotonic(),
                rows=rows,
                failed=outcome.model_failed,
            )
        self._metrics.observe_batch(
            slot.model.name,
            requests=len(batch),
            rows=rows,
            batch_waits_s=[started - d.read_at for d in batch],
            inference_s=outcome.infer_s,
            exemplar=exemplar,
        )
        self._metrics.observe_results(
            Counter((r.model, r.version, r.status.value) for r in outcome.results)
        )
        debug = log.is_enabled_for(logging.DEBUG)
        if not debug and not outcome.failures:
            self._stats.executed.extend(d.request.id for d in batch)
            return
        for d, result in zip(batch, outcome.results, strict=True):
            if debug:
                log.debug(
                    "request done",
                    component="worker",
                    request_id=d.request.id,
                    model=result.model,
                    version=result.version,
                    status=result.status.value,
                    batch_size=len(batch),
                    traceparent=d.request.traceparent,
                )
            if result.status is Status.OK:
                self._stats.executed.append(d.request.id)
            else:
                self._stats.failed += 1
                log.warning(
                    "request failed",
                    request_id=d.request.id,
                    model=result.model,
                    version=result.version,
                    error=result.error,
                    traceparent=d.request.traceparent,
                )

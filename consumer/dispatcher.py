"""One dispatcher per served model: when the batch policy says, it takes a batch, drops what
expired and what callers have gone from (``protocol.cancellation``), claims the batch's jobs,
runs the batch on the model's thread or, for a quick model, on the event loop
(``consumer.inline``), and hands every outcome to the writer.

When Redis cannot answer the cancellation lookup, the requests run (it only costs work); when it
refuses the job claim, the jobs go back to the queue and the dispatcher backs off. Jobs claimed
are announced as running on the events stream (event streams and webhooks tell it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from operator import attrgetter
from typing import Protocol

import redis.asyncio as aioredis
import structlog

from consumer.batcher import Queued
from consumer.context import WorkerContext
from consumer.leases import JobLeases
from consumer.model import BatchOutcome, rows_of
from consumer.slots import Delivery, ModelSlot
from protocol.cancellation import CHECK_AFTER_MS, cancelled_of
from protocol.jobs import Claim, JobStatus
from protocol.keys import JOB_EVENTS_MAXLEN
from protocol.messages import EVENT_STATUS_FIELD, JOB_EVENT_FIELD, Kind, Status
from runtime.aio import cancelling
from runtime.broker import Broker
from runtime.faults import RETRYABLE

log = structlog.get_logger("inferq.worker")

_RESULT_LABELS = attrgetter("model", "version", "status")
"""A result's (model, version, status): what ``inferq_worker_requests_total`` counts by."""


class ReadSide(Protocol):
    """What a dispatcher needs of the worker's reader (``consumer.reader.Reader``)."""

    draining: bool
    """The worker is shutting down: run what is queued without waiting for more."""

    def wake(self) -> None:
        """This model's wants changed: read for them."""


class Dispatcher:
    def __init__(
        self,
        context: WorkerContext,
        slot: ModelSlot,
        *,
        redis: aioredis.Redis,
        broker: Broker,
        leases: JobLeases,
        reader: ReadSide,
    ) -> None:
        self._ctx = context
        self.slot = slot
        self._redis = redis
        self._broker = broker
        self._leases = leases
        self._reader = reader
        self._keys = context.keys
        self._now_ms = context.clock.now_ms
        self._backoff = context.loops.backoff(f"dispatch-{slot.model.name}")

    async def run(self) -> None:
        slot, reader = self.slot, self._reader
        while not cancelling():
            now = time.monotonic()
            self._drop_expired(now)
            wait = slot.between_batches(now, draining=reader.draining)
            if wait != 0.0:
                await slot.wait_for_news(wait)
                continue
            slot.batch_started()
            reader.wake()
            try:
                taken = await self._drop_cancelled(slot.take_batch())
                batch = await self._claim_jobs(taken)
                try:
                    if batch:
                        await self._run_batch(batch, max(q.deadline for q in taken))
                finally:
                    self._leases.release(self._job_keys(batch))
            finally:
                slot.batch_ended()
                reader.wake()

    def _drop_expired(self, now: float) -> None:
        expired = self.slot.drop_expired(now)
        if not expired:
            return
        ctx = self._ctx
        ctx.stats.expired += len(expired)
        ctx.metrics.observe_expired(self.slot.model.name, len(expired))
        for d in expired:
            r = d.request
            ctx.stats.inference.expired(r.model, r.version, sum(d.waited(now)) / 1000)
            log.info(
                "request expired before it ran",
                request_id=r.id,
                model=r.model,
                version=r.version,
                traceparent=r.traceparent,
            )
        ctx.put([ctx.outcomes.expired(d) for d in expired])
        self._reader.wake()

    async def _drop_cancelled(self, batch: list[Queued[Delivery]]) -> list[Queued[Delivery]]:
        """Acknowledge, unrun, the requests whose callers have gone (``protocol.cancellation``):
        one ZMSCORE for the whole batch, on the broker's pipelining connection (``Broker.batch``:
        no pool checkout or redis-py packing per batch). If Redis cannot say, they run (it only
        costs work)."""
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
            (scores,) = await self._broker.batch([("ZMSCORE", self._keys.cancelled(model), *ids)])
            if isinstance(scores, BaseException):  # an error reply, returned, not raised
                raise scores
        except RETRYABLE as e:
            log.warning("could not check for cancelled requests", error=str(e))
            return batch
        gone = cancelled_of(ids, scores)
        if not gone:
            return batch
        dropped = [q.item for q in batch if q.item.request.id in gone]
        ctx = self._ctx
        ctx.stats.cancelled += len(dropped)
        ctx.metrics.observe_cancelled(model, len(dropped))
        log.info("requests dropped: their callers have gone", model=model, count=len(dropped))
        ctx.put([ctx.outcomes.nothing(*d.entry) for d in dropped])
        return [q for q in batch if q.item.request.id not in gone]

    def _job_keys(self, batch: list[Delivery]) -> list[str]:
        return [self._keys.job(d.request.id) for d in batch if d.request.kind is Kind.JOB]

    async def _claim_jobs(self, batch: list[Queued[Delivery]]) -> list[Delivery]:
        """Claim the batch's async jobs (``consumer.leases``); drop those cancelled or expired
        meanwhile, and leave those another worker runs under a live lease.

        The check and the change are one atomic script, so a job cancelled before this point is
        never run, and a job claimed here can no longer be cancelled. A job found running under
        this worker's own name (its claim ran, the reply was lost) or under a lapsed lease (its
        worker died) is claimed again and runs.
        """
        jobs = [q for q in batch if q.item.request.kind is Kind.JOB]
        if not jobs:
            return [q.item for q in batch]
        try:
            before = await self._leases.claim(
                [self._keys.job(q.item.request.id) for q in jobs], self._now_ms()
            )
        except RETRYABLE as e:
            for q in jobs:
                self.slot.enqueue(q)
            await self._backoff.failed(e)
            return [q.item for q in batch if q.item.request.kind is not Kind.JOB]
        self._backoff.succeeded()
        skipped: set[int] = set()
        leased: set[int] = set()
        for q, claim in zip(jobs, before, strict=True):
            r = q.item.request
            if claim == Claim.AGAIN:
                log.warning(
                    "job run again: it was left running by a worker whose lease lapsed, or by "
                    "this one's claim whose reply was lost",
                    job_id=r.id,
                    model=r.model,
                    version=r.version,
                    traceparent=r.traceparent,
                )
                self._ctx.stats.jobs_run_again += 1
                self._ctx.metrics.observe_job_run_again(r.model)
            elif claim == Claim.LEASED:
                leased.add(id(q))
                log.info("job left pending: another worker runs it", job_id=r.id, model=r.model)
            elif claim != Claim.CLAIMED:
                skipped.add(id(q))
                log.info(
                    "job not run",
                    job_id=r.id,
                    model=r.model,
                    version=r.version,
                    status=claim or "missing",
                    traceparent=r.traceparent,
                )
                self._ctx.stats.skipped_jobs += 1
        for q in jobs:
            if id(q) in leased:
                # Not acknowledged: it stays pending and is reclaimed once that lease lapses.
                self._ctx.ledger.abandon(q.item.entry)
        if skipped:
            nothing = self._ctx.outcomes.nothing
            self._ctx.put([nothing(*q.item.entry) for q in jobs if id(q) in skipped])
        gone = skipped | leased
        await self._announce_running([q.item.request.id for q in jobs if id(q) not in gone])
        return [q.item for q in batch if id(q) not in gone]

    async def _announce_running(self, job_ids: list[str]) -> None:
        """Tell the gateways (event streams, webhooks) that these jobs started. Best effort:
        unannounced, "running" is told with the job's final event."""
        if not job_ids:
            return
        pipe = self._redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.xadd(
                self._keys.job_events,
                {JOB_EVENT_FIELD: job_id, EVENT_STATUS_FIELD: JobStatus.RUNNING.value},
                maxlen=JOB_EVENTS_MAXLEN,
                approximate=True,
            )
        try:
            await pipe.execute()
        except RETRYABLE as e:
            log.warning("could not announce that jobs started", count=len(job_ids), error=str(e))

    async def _run_batch(self, batch: list[Delivery], deadline: float) -> None:
        """Run a batch whose last caller stops waiting at ``deadline`` (monotonic)."""
        slot, ctx = self.slot, self._ctx
        ctx.ledger.running(d.entry for d in batch)
        requests = [d.request for d in batch]
        version, rows = requests[0].version, sum(rows_of(r) for r in requests)
        started = time.monotonic()
        waited = [d.waited(started) for d in batch]
        inline = slot.runs_inline(version, rows)
        if inline:
            ctx.stats.inline_batches += 1
            outcome = slot.model.run(requests, ctx.worker_id, waited, deadline)
        else:
            loop = asyncio.get_running_loop()
            outcome = await loop.run_in_executor(
                slot.executor, slot.model.run, requests, ctx.worker_id, waited, deadline
            )
        slot.call_took(version, rows, outcome.infer_s, inline=inline)
        self._observe(batch, outcome, started, rows)
        result, finished = ctx.outcomes.result, time.monotonic()
        ctx.put([result(d, r, finished) for d, r in zip(batch, outcome.results, strict=True)])
        # An inline batch never awaited: let the writer send these results and the reader
        # read on before the next batch.
        await asyncio.sleep(0)

    def _observe(
        self, batch: list[Delivery], outcome: BatchOutcome, started: float, rows: int
    ) -> None:
        """Stats, metrics, the trace span and the logs of one batch: counted per batch, logged
        per request only when a request failed or debug logging is on."""
        slot, stats, tracer = self.slot, self._ctx.stats, self._ctx.tracer
        stats.batches += 1
        stats.requests += len(batch)
        stats.batch_sizes.append(len(batch))
        stats.inference.batch(
            outcome.results,
            [rows_of(d.request) for d in batch],
            input_s=outcome.input_s,
            infer_s=outcome.infer_s,
            output_s=outcome.output_s,
            ended_ms=self._now_ms(),
        )
        exemplar = None
        if tracer is not None:
            exemplar = tracer.batch(
                model=slot.model.name,
                worker=self._ctx.worker_id,
                requests=[(d.request.traceparent, d.read_at) for d in batch],
                started=started,
                finished=time.monotonic(),
                rows=rows,
                failed=outcome.model_failed,
            )
        metrics = self._ctx.metrics
        metrics.observe_batch(
            slot.model.name,
            requests=len(batch),
            rows=rows,
            batch_waits_s=[started - d.read_at for d in batch],
            inference_s=outcome.infer_s,
            exemplar=exemplar,
        )
        counts = Counter(map(_RESULT_LABELS, outcome.results))  # the tuples built in C
        metrics.observe_results({(m, v, s.value): n for (m, v, s), n in counts.items()})
        debug = log.is_enabled_for(logging.DEBUG)
        if not debug and not outcome.failures:
            stats.executed.extend(d.request.id for d in batch)
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
                stats.executed.append(d.request.id)
            else:
                stats.failed += 1
                log.warning(
                    "request failed",
                    request_id=d.request.id,
                    model=result.model,
                    version=result.version,
                    error=result.error,
                    traceparent=d.request.traceparent,
                )

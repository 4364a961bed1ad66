"""Driving batches to their end: every gateway runs one ``BatchRunner``; for each batch not yet
final, the gateway holding its lease (``LEASE_SCRIPT``) queues its lines as low-lane jobs
(``JobService.submit_many``: the one path of a job, ``SUBMIT_AT_ONCE`` lines in one round
trip), collects the jobs' ends into the batch's answers, and moves the batch on when every line
is answered.

Durable by construction: where ingesting stands is the record's ``ingested`` cursor, and each
line's job carries the Idempotency-Key ``batch-<id>-<line>``, so a gateway that dies between
queueing lines and moving the cursor is followed by one (after ``LEASE_MS``) that queues the same
lines again and gets the same jobs back. Answers are written with HSETNX per line: a line whose
job is collected twice is answered once. Pacing: at most ``WINDOW`` lines of a batch are in
flight, and a submission refused at ``--max-job-backlog`` ends this round's ingesting instead of
failing the line; real-time traffic rides higher lanes, which workers read first.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from dataclasses import dataclass, field
from typing import cast

import structlog

from producer.batches import BatchService
from producer.errors import (
    Conflict,
    GatewayError,
    Gone,
    NotFound,
    ServiceUnavailable,
    TooManyRequests,
)
from producer.jobs import JobAsk, JobService, document
from producer.metrics import GatewayMetrics
from producer.v2_request import parse_infer_request
from protocol import ProtocolError
from protocol.batches import (
    LEASE_SCRIPT,
    BatchLine,
    BatchRecord,
    BatchStatus,
    error_line,
    output_line,
)
from protocol.jobs import JobRecord, JobStatus
from runtime.aio import cancelling
from runtime.backoff import Backoff
from runtime.faults import RETRYABLE

log = structlog.get_logger("inferq.gateway")

LEASE_MS = 5_000
"""A gateway that stops renewing (it died) leaves its batches to another after this long."""
TICK_S = 0.2
"""How often a driven batch is advanced: lines queued, ends collected."""
WINDOW = 4096
"""Lines of one batch in flight (queued as jobs, not yet answered) at most."""
INGEST_CHUNK = 512
"""Lines queued per round, so one round of one batch stays short."""
SUBMIT_AT_ONCE = 64
"""Lines submitted together (``JobService.submit_many``: one round trip on one Redis)."""
COLLECT_AT_ONCE = 256
"""Lines whose job status one round trip of a collection asks (``BatchRunner._collect``)."""
FULL_COLLECT_S = 1.0
"""How often a collection looks at every line in flight, not only up to the first group of
``COLLECT_AT_ONCE`` where none ended."""
PROGRESS_S = 0.5
"""Progress is announced (event streams) at most this often per batch."""


@dataclass(slots=True)
class Driven:
    """What the lease holder keeps of one batch between rounds (rebuilt from Redis on
    takeover)."""

    in_flight: dict[int, tuple[str, str]] = field(default_factory=dict)
    """Line -> (job id, custom id) for lines queued and not answered."""
    stopped: bool = False
    """Cancelled or expired: the queued jobs were cancelled, the rest answered."""
    pending: int = 0
    """Lines not yet answered, as of the last round (the gauge)."""
    collected_at: float = 0.0
    swept_at: float = float("-inf")
    """When ``_collect`` last looked at every line in flight (monotonic)."""
    announced: tuple[int, int] = (-1, -1)
    announced_at: float = 0.0


class BatchRunner:
    def __init__(
        self,
        batches: BatchService,
        jobs: JobService,
        gateway_id: str,
        metrics: GatewayMetrics,
        backoff: Backoff,
    ) -> None:
        self.batches = batches
        self.jobs = jobs
        self.keys = batches.keys
        self.clock = batches.clock
        self._me = gateway_id
        self._metrics = metrics
        self._backoff = backoff
        self._broker = jobs.inference.pipeline.broker
        self._redis = self._broker.commands
        self._lease = self._broker.script(LEASE_SCRIPT)
        self._driven: dict[str, Driven] = {}

    async def run(self) -> None:
        while not cancelling():
            try:
                busy = await self.tick()
                self._backoff.succeeded()
            except RETRYABLE as e:
                self._driven.clear()  # rebuilt from Redis once it answers again
                await self._backoff.failed(e)
                continue
            # Straight on while lines are being queued (sleep(0) lets requests in between).
            await asyncio.sleep(0 if busy else TICK_S)

    async def tick(self) -> bool:
        """One round over every batch not yet final: drive those whose lease this gateway
        holds or takes. Whether any line was queued (more may be waiting)."""
        active = sorted(m.decode() for m in await self._redis.smembers(self.keys.batches_active))
        busy = False
        for batch_id in active:
            held = await self._lease(
                keys=[self.keys.batch(batch_id, "lease")], args=[self._me, LEASE_MS]
            )
            if not held:
                self._driven.pop(batch_id, None)
                continue
            busy = await self.drive(batch_id) > 0 or busy
        for gone in set(self._driven) - set(active):
            del self._driven[gone]
        self._metrics.batches_driven.set(len(self._driven))
        return busy

    async def drive(self, batch_id: str) -> int:
        """One round of one batch; the lines it queued."""
        record = await self.batches.load(batch_id)
        if record is None or record.status.final:
            await self._redis.srem(self.keys.batches_active, batch_id)
            self._driven.pop(batch_id, None)
            return 0
        driven = self._driven.get(batch_id)
        if driven is None:
            driven = self._driven[batch_id] = await self._resume(record)
        stopping = record.status is BatchStatus.CANCELLING or (
            self.clock.now_ms() >= record.deadline_ms
        )
        if stopping and not driven.stopped:
            await self._stop(record, driven)
        queued = 0
        if not stopping:
            queued = await self._ingest(record, driven)
        now = time.monotonic()
        if not queued or now - driven.collected_at >= TICK_S:
            # While lines are being queued round after round, ends are collected at most every
            # TICK_S: each collection asks the status of every line in flight.
            driven.collected_at = now
            await self._collect(record, driven, now)
        counts = await self.batches.counts(record)
        pending = counts.total - counts.completed - counts.failed
        driven.pending = pending
        self._metrics.batch_lines_pending.set(sum(d.pending for d in self._driven.values()))
        if pending <= 0:
            await self._finish(record, driven.stopped)
            return queued
        progress = (counts.completed, counts.failed)
        if progress != driven.announced and now - driven.announced_at >= PROGRESS_S:
            # With its status, so a resume from this entry knows where the client was.
            await self.batches.announce(batch_id, record.status)
            driven.announced, driven.announced_at = progress, now
        return queued

    async def _resume(self, record: BatchRecord) -> Driven:
        """What is in flight, from Redis: lines queued (``jobs``) and not yet answered."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.batch(record.id, "jobs"))
        pipe.hkeys(self.keys.batch(record.id, "output"))
        pipe.hkeys(self.keys.batch(record.id, "errors"))
        jobs, output, errors = await pipe.execute()
        answered = {int(n) for n in [*output, *errors]}
        driven = Driven()
        for n, raw in cast(dict[bytes, bytes], jobs).items():
            if int(n) not in answered:
                job_id, custom_id = json.loads(raw)
                driven.in_flight[int(n)] = (job_id, custom_id)
        if record.ingested or driven.in_flight:
            log.info(
                "batch resumed",
                batch_id=record.id,
                ingested=record.ingested,
                in_flight=len(driven.in_flight),
            )
        return driven

    async def _ingest(self, record: BatchRecord, driven: Driven) -> int:
        """Queue the next lines, as many as the window and the job backlog allow,
        ``SUBMIT_AT_ONCE`` at a time (``JobService.submit_many``); how many were taken."""
        room = min(WINDOW - len(driven.in_flight), INGEST_CHUNK, record.valid - record.ingested)
        if room <= 0:
            return 0
        raw = await self._redis.lrange(
            self.keys.batch(record.id, "lines"), record.ingested, record.ingested + room - 1
        )
        queued: dict[int, str] = {}
        failed: dict[int, bytes] = {}
        done = 0
        for start in range(0, len(raw), SUBMIT_AT_ONCE):
            group = raw[start : start + SUBMIT_AT_ONCE]
            lines = [_decoded(item) for item in group]
            readable = [line for line in lines if line is not None]
            if len(readable) < len(lines):
                log.error("unreadable batch line", batch_id=record.id)
            outcomes = iter(await self.jobs.submit_many([_ask(record, ln) for ln in readable]))
            paced = False
            for line in lines:
                if line is None:  # nothing to queue: counted as taken, never answered by a job
                    done += 1
                    continue
                outcome = next(outcomes, None)
                if outcome is None or isinstance(outcome, TooManyRequests | ServiceUnavailable):
                    # The backlog is full, or Redis or the model is not there: next round.
                    paced = True
                    break
                if isinstance(outcome, GatewayError):
                    # The model changed since the batch was checked.
                    answer = error_line(line.line, line.custom_id, "invalid_request", str(outcome))
                    failed[line.line] = answer
                else:
                    job_id = outcome.record.id
                    driven.in_flight[line.line] = (job_id, line.custom_id)
                    queued[line.line] = json.dumps([job_id, line.custom_id])
                done += 1
            if paced:
                self._metrics.batch_paced.inc()
                break  # the lines after the refused one wait (a later round replays them)
        if not done:
            return 0
        pipe = self._redis.pipeline(transaction=False)
        if queued:
            pipe.hset(self.keys.batch(record.id, "jobs"), mapping=queued)
        for n, answer in failed.items():
            pipe.hsetnx(self.keys.batch(record.id, "errors"), n, answer)
        pipe.hset(self.keys.batch(record.id), "ingested", record.ingested + done)
        await pipe.execute()
        return done

    async def _collect(self, record: BatchRecord, driven: Driven, now: float) -> None:
        """Answer the lines whose job has ended, oldest first, ``COLLECT_AT_ONCE`` lines a
        round trip, yielding the event loop between two (one pipeline over a full window held
        real-time requests up to ~90 ms: BENCHMARKS.md). Lines end about in the order they
        were queued, so the look stops at the first group where none ended; every
        ``FULL_COLLECT_S`` (``now``, monotonic) it goes through every line in flight, so a
        line that ended behind a group still running waits that long at most."""
        full = now - driven.swept_at >= FULL_COLLECT_S
        if full:
            driven.swept_at = now
        lines = list(driven.in_flight)
        for start in range(0, len(lines), COLLECT_AT_ONCE):
            ended = await self._collect_some(record, driven, lines[start : start + COLLECT_AT_ONCE])
            if not ended and not full:
                return
            await asyncio.sleep(0)  # requests run between two groups

    async def _collect_some(self, record: BatchRecord, driven: Driven, lines: list[int]) -> int:
        """Answer those of ``lines`` (in flight) whose job has ended; how many."""
        pipe = self._redis.pipeline(transaction=False)
        for n in lines:
            pipe.hget(self.keys.job(driven.in_flight[n][0]), "status")
        statuses = await pipe.execute()
        final = {s.value.encode() for s in JobStatus if s.final}
        ended = [n for n, s in zip(lines, statuses, strict=True) if s is None or s in final]
        if not ended:
            return 0
        pipe = self._redis.pipeline(transaction=False)
        for n in ended:
            pipe.hgetall(self.keys.job(driven.in_flight[n][0]))
        raws = await pipe.execute()
        pipe = self._redis.pipeline(transaction=False)
        outcomes = {"completed": 0, "failed": 0}
        for n, raw in zip(ended, raws, strict=True):
            part, answer = self._answer(n, driven.in_flight[n], raw)
            outcomes["completed" if part == "output" else "failed"] += 1
            pipe.hsetnx(self.keys.batch(record.id, part), n, answer)
        await pipe.execute()
        for n in ended:
            del driven.in_flight[n]
        for outcome, count in outcomes.items():
            if count:
                self._metrics.batch_lines.labels(outcome).inc(count)
        return len(ended)

    @staticmethod
    def _answer(n: int, job: tuple[str, str], raw: dict[bytes, bytes]) -> tuple[str, bytes]:
        job_id, custom_id = job
        if not raw:
            return "errors", error_line(
                n, custom_id, "lost", f"the record of job {job_id} is gone (Redis lost it)"
            )
        try:
            record = JobRecord.from_fields(raw)
        except ProtocolError as e:
            return "errors", error_line(n, custom_id, "lost", str(e))
        if record.status is JobStatus.SUCCEEDED:
            doc, _ = document(record, binary=False)
            return "output", output_line(n, custom_id, doc["result"])
        code = {JobStatus.FAILED: "model_failed"}.get(record.status, record.status.value)
        message = record.error or f"the line's job was {record.status.value}"
        return "errors", error_line(n, custom_id, code, message)

    async def _stop(self, record: BatchRecord, driven: Driven) -> None:
        """Cancelled or past its window: cancel the queued jobs (those running finish) and
        answer the lines never queued."""
        why = "cancelled" if record.status is BatchStatus.CANCELLING else "expired"
        for job_id, _ in list(driven.in_flight.values()):
            with contextlib.suppress(Conflict, NotFound, Gone):
                await self.jobs.cancel(job_id)
        if record.ingested < record.valid:
            rest = await self._redis.lrange(
                self.keys.batch(record.id, "lines"), record.ingested, -1
            )
            pipe = self._redis.pipeline(transaction=False)
            for item in rest:
                line = BatchLine.decode(item)
                answer = error_line(
                    line.line, line.custom_id, f"batch_{why}", f"the batch was {why} first"
                )
                pipe.hsetnx(self.keys.batch(record.id, "errors"), line.line, answer)
            pipe.hset(self.keys.batch(record.id), "ingested", record.valid)
            await pipe.execute()
        driven.stopped = True
        log.info("batch stopping", batch_id=record.id, why=why, in_flight=len(driven.in_flight))

    async def _finish(self, record: BatchRecord, stopped: bool) -> None:
        """Every line is answered: the batch's final status."""
        if record.status is BatchStatus.CANCELLING:
            await self.batches.move(record, BatchStatus.CANCELLED)
        elif stopped:
            await self.batches.move(record, BatchStatus.EXPIRED)
        elif record.status is BatchStatus.FINALIZING:  # a gateway died between the two moves
            await self.batches.move(record, BatchStatus.COMPLETED)
        elif await self.batches.move(record, BatchStatus.FINALIZING):
            finalizing = await self.batches.load(record.id)
            if finalizing is not None:
                await self.batches.move(finalizing, BatchStatus.COMPLETED)
        pipe = self._redis.pipeline(transaction=False)
        pipe.srem(self.keys.batches_active, record.id)
        pipe.delete(self.keys.batch(record.id, "lease"))
        await pipe.execute()
        self._driven.pop(record.id, None)
        final = await self.batches.load(record.id)
        log.info("batch ended", batch_id=record.id, status=final.status.value if final else None)


def _ask(record: BatchRecord, line: BatchLine) -> JobAsk:
    """A line as a job; its Idempotency-Key makes a repeat (a later round, another gateway)
    find the same job."""
    return JobAsk(
        line.model,
        line.version or None,
        functools.partial(parse_infer_request, line.body, None),
        idempotency_key=f"batch-{record.id}-{line.line}",
    )


def _decoded(item: bytes) -> BatchLine | None:
    try:
        return BatchLine.decode(item)
    except ProtocolError:
        return None

"""Publishes results: one pipeline per flush for every finished request.

For each request: ``SET result_key payload PX ttl NX`` (the key serves the cache and idempotent
redelivery, and is written only if absent), ``XADD reply_to NOMKSTREAM`` to wake the waiting
gateway (NOMKSTREAM: a gateway that has gone away must not get its stream recreated), then
``XACK``. An entry is acknowledged only after the pipeline holding its result has completed:
acks wait up to ``ack_delay_s`` (10 ms) or until ``ACK_BATCH`` have gathered, then ride along
with the next flush's writes, or go alone. Acks are not on any caller's critical path, and
batching them keeps Redis commands per request low. Flushes coalesce too: results finished
while one pipeline is in flight go out together in the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from consumer.metrics import WorkerMetrics
from protocol.jobs import JobStatus
from protocol.keys import GROUP
from protocol.messages import FIELD
from runtime.aio import cancelling
from runtime.tracing import Tracer

log = structlog.get_logger("inferq.worker")

DLQ_MAXLEN = 100_000
JOB_EVENTS_MAXLEN = 100_000
"""Gateways read job events as they come; the stream only needs to cover a reconnect."""
ACK_BATCH = 256
"""Acknowledge at once when this many entries wait for their XACK."""


@dataclass(frozen=True, slots=True)
class JobUpdate:
    """Move a job record from one status to another (atomically, see ``protocol.jobs``),
    refresh its TTL, and announce it on the job events stream."""

    key: str
    job_id: str
    required: JobStatus
    args: list[str | bytes | int]
    ttl_ms: int


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One finished stream entry: what to store and whom to wake before acknowledging it."""

    stream: str
    entry_id: bytes
    payload: bytes | None
    """The encoded result; None only acknowledges the entry (it was deleted from the stream)."""
    result_key: str | None = None
    ttl_ms: int = 0
    reply_to: str | None = None
    job: JobUpdate | None = None
    dead_letter: str | None = None
    """A dead-letter stream to copy the raw entry to (undecodable or poison entries)."""
    reason: str = ""
    raw: bytes | None = None
    """The entry's original payload, for the dead-letter stream."""
    model: str = ""
    finished_at: float = 0.0
    """When the model call (or the expiry answer) ended, monotonic: the reply-stage clock."""
    traceparent: str | None = None
    """The request's trace context, for its *result write* span when tracing is on."""


class ResultWriter:
    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        job_events: str = "",
        transition: AsyncScript | None = None,
        on_written: Callable[[list[Outgoing]], None] | None = None,
        metrics: WorkerMetrics | None = None,
        tracer: Tracer | None = None,
        ack_delay_s: float = 0.01,
        max_backoff_s: float = 1.0,
    ) -> None:
        self._redis = redis
        self._job_events = job_events
        self._transition = transition
        self._on_written = on_written
        self._metrics = metrics
        self._tracer = tracer if tracer is not None and tracer.enabled else None
        self._queue: list[Outgoing] = []
        self._unacked: list[Outgoing] = []
        self._ack_delay_s = ack_delay_s
        self._ack_due = 0.0
        self._ready = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._max_backoff_s = max_backoff_s
        self.flushes = 0

    def put(self, items: list[Outgoing]) -> None:
        if items:
            self._queue.extend(items)
            self._idle.clear()
            self._ready.set()

    async def wait_idle(self) -> None:
        """Until everything put so far is written and acknowledged."""
        await self._idle.wait()

    async def run(self) -> None:
        backoff = 0.05
        while not cancelling():
            if not self._queue:
                if self._unacked:
                    wait = self._ack_due - time.monotonic()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(max(0.0, wait)):
                            await self._ready.wait()
                else:
                    await self._ready.wait()
            batch, self._queue = self._queue, []
            self._ready.clear()
            acks: list[Outgoing] = []
            if len(self._unacked) >= ACK_BATCH or time.monotonic() >= self._ack_due:
                acks, self._unacked = self._unacked, []
            while not cancelling():
                try:
                    await self._write(batch, acks)
                    backoff = 0.05
                    break
                except (RedisConnectionError, RedisTimeoutError, OSError) as e:
                    log.warning("results not written, retrying", error=str(e), backoff_s=backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, self._max_backoff_s)
            if self._metrics is not None:
                now = time.monotonic()
                for out in batch:
                    if out.finished_at:
                        self._metrics.observe_reply(out.model, now - out.finished_at)
            if self._tracer is not None:
                now = time.monotonic()
                for out in batch:
                    if out.finished_at:
                        self._tracer.result_written(out.traceparent, out.finished_at, now)
            if acks and self._on_written is not None:
                self._on_written(acks)
            if batch:
                if not self._unacked:
                    self._ack_due = time.monotonic() + self._ack_delay_s
                self._unacked.extend(batch)
            if not self._queue and not self._unacked:
                self._idle.set()

    async def _write(self, batch: list[Outgoing], written_before: list[Outgoing]) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for out in batch:
            if out.dead_letter is not None:
                pipe.xadd(
                    out.dead_letter,
                    {
                        b"stream": out.stream,
                        b"id": out.entry_id,
                        b"reason": out.reason,
                        FIELD: out.raw or b"",
                    },
                    maxlen=DLQ_MAXLEN,
                    approximate=True,
                )
            if out.payload is not None:
                if out.result_key:
                    pipe.set(out.result_key, out.payload, px=max(1, out.ttl_ms), nx=True)
                if out.reply_to:
                    pipe.xadd(out.reply_to, {FIELD: out.payload}, nomkstream=True)
            if out.job is not None:
                assert self._transition is not None
                job = out.job
                await self._transition(
                    keys=[job.key], args=[job.required.value, *job.args], client=pipe
                )
                pipe.pexpire(job.key, max(1, job.ttl_ms))
                pipe.xadd(
                    self._job_events,
                    {b"job": job.job_id},
                    maxlen=JOB_EVENTS_MAXLEN,
                    approximate=True,
                )
        acks: dict[str, list[bytes]] = {}
        for out in written_before:
            acks.setdefault(out.stream, []).append(out.entry_id)
        for stream, ids in acks.items():
            pipe.xack(stream, GROUP, *ids)
        await pipe.execute(raise_on_error=False)
        self.flushes += 1

"""Publishes results: one pipeline per flush stores what every finished entry needs
(``consumer.outgoing``), checks every reply, then acknowledges.

Nothing is acknowledged that is not stored (the ledger refuses it): a step Redis refused is
retried alone, with backoff, while its entry stays pending; one refused for good
``MAX_PERMANENT_TRIES`` times is let go unacknowledged, for another worker to reclaim. Acks wait
up to ``ack_delay_s`` or ``ACK_BATCH`` entries and ride with the next flush, and a stream's trim
(``consumer.trim``) with its XACK at most every ``TRIM_INTERVAL_S``. Every refusal is counted in
``inferq_worker_write_failures_total``. More: ARCHITECTURE.md, "Writing results".
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from consumer.ledger import Entry, Ledger
from consumer.metrics import WorkerMetrics
from consumer.outgoing import Outgoing
from consumer.trim import TRIM_INTERVAL_S, TRIM_SCRIPT, TrimSchedule
from protocol.jobs import JobStatus
from protocol.keys import DLQ_MAXLEN, GROUP, JOB_EVENTS_MAXLEN
from protocol.messages import EVENT_STATUS_FIELD, FIELD, JOB_EVENT_FIELD
from runtime.aio import cancelling
from runtime.backoff import Backoff
from runtime.broker import Broker, Script
from runtime.faults import RETRYABLE, TRANSIENT, Fault, classify
from runtime.resp import Command
from runtime.tracing import Tracer

log = structlog.get_logger("inferq.worker")

ACK_BATCH = 256
"""Acknowledge at once when this many entries wait for their XACK."""
MAX_PERMANENT_TRIES = 3


@dataclass(slots=True)
class _Write:
    """An entry being stored: which of its steps are done, and how often a step was refused
    for a reason that does not go away by waiting."""

    out: Outgoing
    done: set[str] = field(default_factory=set)
    permanent_failures: int = 0
    undelivered: bool = False
    """Its reply stream was missing: a backed-up result is stored in its key instead."""


class ResultWriter:
    def __init__(
        self,
        broker: Broker,
        ledger: Ledger,
        *,
        job_events: str = "",
        transition: Script | None = None,
        metrics: WorkerMetrics | None = None,
        backoff: Backoff | None = None,
        tracer: Tracer | None = None,
        ack_delay_s: float = 0.01,
        trim_interval_s: float = TRIM_INTERVAL_S,
    ) -> None:
        self._broker = broker
        self._ledger = ledger
        self._job_events = job_events
        self._transition = transition
        self._trim = broker.script(TRIM_SCRIPT)
        self._metrics = metrics
        self._tracer = tracer if tracer is not None and tracer.enabled else None
        self._backoff = backoff or Backoff("writer", log)
        self._queue: list[_Write] = []
        self._unacked: list[Entry] = []
        self._ack_delay_s = ack_delay_s
        self._ack_due = 0.0
        self._trims = TrimSchedule(trim_interval_s)
        self._draining = False
        self._ready = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.failures = 0
        """Steps Redis refused (each is retried)."""

    def put(self, items: list[Outgoing]) -> None:
        if items:
            self._queue.extend(_Write(out) for out in items)
            self._idle.clear()
            self._ready.set()

    async def wait_idle(self) -> None:
        """Until everything put so far is stored and acknowledged."""
        await self._idle.wait()

    async def drain(self) -> None:
        """On shutdown: until everything put so far is stored and acknowledged, and every stream
        acknowledged since its last trim is trimmed. Acks and trims go at once from now on, not
        after their delays."""
        self._draining = True
        if self._trims.waiting:
            self._idle.clear()
        self._ready.set()
        await self._idle.wait()

    async def run(self) -> None:
        while not cancelling():
            await self._wait_for_work()
            batch, self._queue = self._queue, []
            self._ready.clear()
            acks: list[Entry] = []
            if (
                len(self._unacked) >= ACK_BATCH
                or time.monotonic() >= self._ack_due
                or self._draining
            ):
                acks, self._unacked = self._unacked, []
            try:
                refused = await self.flush(batch, acks)
            except RETRYABLE as e:  # the pipeline as a whole: nothing is known to be stored
                self._count_failures(batch, e)
                self._queue[:0] = batch
                self._unacked[:0] = acks
                await self._backoff.failed(e)
                continue
            if refused is None:
                self._backoff.succeeded()
            else:
                await self._backoff.failed(refused)
            if not self._queue and not self._unacked:
                if not (self._draining and self._trims.waiting):
                    self._idle.set()

    async def _wait_for_work(self) -> None:
        if self._queue or (self._draining and (self._unacked or self._trims.waiting)):
            return
        due = [self._ack_due] if self._unacked else []
        trim_due = self._trims.next_due()
        if trim_due is not None:
            due.append(trim_due)
        if not due:
            await self._ready.wait()
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, min(due) - time.monotonic())):
                await self._ready.wait()

    async def flush(self, batch: list[_Write], acks: list[Entry]) -> BaseException | None:
        """Store what ``batch`` still needs, acknowledge ``acks`` and trim the streams whose
        trim is due (``consumer.trim``) in one pipeline; check each reply. Writes not fully
        stored go back on the queue; the first transient refusal is returned (the caller backs
        off). Raises what the pipeline as a whole raised."""
        steps: list[tuple[_Write, str, int]] = []  # (write, step, replies it takes)
        by_stream: dict[str, list[bytes]] = {}
        for stream, entry_id in self._ledger.ackable(acks):
            by_stream.setdefault(stream, []).append(entry_id)
        now = time.monotonic()
        trims = self._trims.take(by_stream, now, all_due=self._draining)
        if not batch and not by_stream and not trims:
            return None
        commands: list[Command] = []
        for write in batch:
            for step, count in self._queue_steps(commands, write):
                steps.append((write, step, count))
        acked_at = len(commands)
        for stream, ids in by_stream.items():
            commands.append(("XACK", stream, GROUP, *ids))
        trimmed_at = len(commands)
        for stream in trims:  # after the XACKs: what they acknowledged goes too
            commands.append(self._trim.command([stream], [GROUP]))
        try:
            # One round trip on the broker's pipelining connection (``Broker.batch``): error
            # replies come back in place, each checked below.
            # Nothing to send when the batch only acknowledges (its XACKs ride the next flush).
            replies = await self._broker.batch(commands) if commands else []
        except BaseException:
            if not self._draining:
                self._trims.failed(trims, now)
            raise
        refused = self._check_steps(steps, replies)
        self._check_acks(by_stream, replies[acked_at:trimmed_at])
        self._check_trims(trims, replies[trimmed_at:], now)
        self._finish(batch)
        return refused

    def _queue_steps(self, commands: list[Command], write: _Write) -> list[tuple[str, int]]:
        """Append the commands of the steps this write has not done yet."""
        out, queued = write.out, []
        for step in _steps(write):
            if step in write.done:
                continue
            if step == "dead_letter":
                assert out.dead_letter is not None
                fields = out.letter().to_fields()
                commands.append(_xadd(out.dead_letter, fields, maxlen=DLQ_MAXLEN))
                queued.append((step, 1))
            elif step == "result":
                assert out.result_key is not None and out.payload is not None
                ttl = max(1, out.ttl_ms)
                commands.append(("SET", out.result_key, out.payload, "PX", ttl, "NX"))
                queued.append((step, 1))
            elif step == "reply":
                assert out.payload is not None and out.reply_to is not None
                commands.append(("XADD", out.reply_to, "NOMKSTREAM", "*", FIELD, out.payload))
                queued.append((step, 1))
            else:
                assert self._transition is not None and out.job is not None
                job = out.job
                transition = self._transition.command
                commands.append(transition([job.key], [job.required.value, *job.args]))
                moves = 1
                if job.if_running is not None:
                    running = [JobStatus.RUNNING.value, *job.if_running]
                    commands.append(transition([job.key], running))
                    moves += 1
                commands.append(("PEXPIRE", job.key, max(1, job.ttl_ms)))
                event: dict[bytes, str | bytes | int] = {JOB_EVENT_FIELD: job.job_id}
                # Two moves to different statuses: readers re-read the record.
                if job.if_running is None or job.if_running[0] == job.args[0]:
                    event[EVENT_STATUS_FIELD] = job.args[0]
                commands.append(_xadd(self._job_events, event, maxlen=JOB_EVENTS_MAXLEN))
                queued.append((step, moves + 2))
        return queued

    def _check_steps(
        self, steps: list[tuple[_Write, str, int]], replies: list[Any]
    ) -> BaseException | None:
        refused: BaseException | None = None
        i = 0
        for write, step, count in steps:
            errors = [r for r in replies[i : i + count] if isinstance(r, Exception)]
            i += count
            if not errors:
                write.done.add(step)
                if step == "reply" and replies[i - 1] is None:
                    # NOMKSTREAM: the reply stream is missing. A backed-up result is stored
                    # in its key instead (next flush), where the gateway's loss sweep looks.
                    write.undelivered = True
                continue
            error = errors[0]
            fault = classify(error)
            self.failures += 1
            if self._metrics is not None:
                self._metrics.observe_write_failure(write.out.model, fault.value)
            if fault in TRANSIENT:
                refused = refused or error
            else:
                write.permanent_failures += 1
                log.error(
                    "Redis refused a result write",
                    step=step,
                    stream=write.out.stream,
                    entry=write.out.entry_id,
                    error=str(error),
                    tries=write.permanent_failures,
                )
        return refused

    def _check_trims(self, trims: list[str], replies: list[Any], now: float) -> None:
        # The script never fails on its own (no stream or group trims nothing); a refused one
        # (out of memory, a moved slot) is tried again an interval later, or on shutdown left
        # to the reclaimers' periodic trim.
        failed = [s for s, r in zip(trims, replies, strict=True) if isinstance(r, Exception)]
        if failed and not self._draining:
            self._trims.failed(failed, now)

    def _check_acks(self, by_stream: dict[str, list[bytes]], replies: list[Any]) -> None:
        for (stream, ids), reply in zip(by_stream.items(), replies, strict=True):
            entries = [(stream, i) for i in ids]
            if isinstance(reply, Exception) and classify(reply) is not Fault.MISSING:
                self._unacked.extend(entries)  # stored, so acknowledge again later
                continue
            # A group or stream gone from Redis holds nothing to acknowledge any more.
            self._ledger.acknowledged(entries)

    def _finish(self, batch: list[_Write]) -> None:
        now = time.monotonic()
        replies: dict[str, list[float]] = {}
        for write in batch:
            out = write.out
            if _complete(write):
                self._ledger.stored(out.entry)
                if not self._unacked:
                    self._ack_due = now + self._ack_delay_s
                self._unacked.append(out.entry)
                if out.finished_at:
                    replies.setdefault(out.model, []).append(now - out.finished_at)
                if self._tracer is not None and out.finished_at:
                    self._tracer.result_written(out.traceparent, out.finished_at, now)
            elif write.permanent_failures >= MAX_PERMANENT_TRIES:
                log.error(
                    "giving up on storing a result; the entry stays pending for another worker "
                    "to reclaim (and dead-letter, if it keeps failing)",
                    stream=out.stream,
                    entry=out.entry_id,
                )
                self._ledger.abandon(out.entry)
            else:
                self._queue.append(write)
        if self._metrics is not None:
            for model, seconds in replies.items():
                self._metrics.observe_replies(model, seconds)

    def _count_failures(self, batch: list[_Write], error: BaseException) -> None:
        fault = classify(error)
        self.failures += len(batch)
        if self._metrics is not None:
            for write in batch:
                self._metrics.observe_write_failure(write.out.model, fault.value)


def _xadd(stream: str, fields: Mapping[bytes, str | bytes | int], *, maxlen: int) -> Command:
    """``XADD stream MAXLEN ~ maxlen * field value ...`` (as redis-py's ``xadd`` with
    ``approximate=True`` sends it)."""
    return ("XADD", stream, "MAXLEN", "~", maxlen, "*", *(x for kv in fields.items() for x in kv))


def _steps(write: _Write) -> list[str]:
    """Everything the write must have stored before its entry is acknowledged, in order."""
    out, steps = write.out, []
    if out.dead_letter is not None:
        steps.append("dead_letter")
    if out.payload is not None:
        if out.result_key and (not out.result_backup or not out.reply_to or write.undelivered):
            steps.append("result")
        if out.reply_to:
            steps.append("reply")
    if out.job is not None:
        steps.append("job")
    return steps


def _complete(write: _Write) -> bool:
    return write.done.issuperset(_steps(write))

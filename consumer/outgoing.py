"""What the writer stores for a finished stream entry, and how a request's outcome becomes one.

An ``Outgoing`` names one entry and everything that must be in Redis before it is acknowledged:
the reply, the result key (``SET NX``: the cache entry, a result nobody waits on a reply stream
for, or the backup of a reply that could not be delivered), the job transition, or a dead letter.
``Outcomes`` builds them, encoding each result once. An uncached synchronous result
(``result_key`` is ``Keys.result(id)``) goes only to its reply stream; its key is written only
when ``XADD ... NOMKSTREAM`` finds that stream missing, for the gateway's loss sweep
(``producer.losses``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from consumer.slots import Delivery
from protocol.jobs import JobStatus, transition_args
from protocol.keys import Keys
from protocol.messages import DeadLetter, InferRequest, InferResult, Kind, Status


@dataclass(frozen=True, slots=True)
class JobUpdate:
    """Move a job record from one status to another (atomically, see ``protocol.jobs``),
    refresh its TTL, and announce it on the job events stream."""

    key: str
    job_id: str
    required: JobStatus
    args: list[str | bytes | int]
    ttl_ms: int
    if_running: list[str | bytes | int] | None = None
    """A second move, tried after the first, for a job that is ``running`` instead: an
    expired delivery of a job whose worker was lost while it ran it (its lease lapsed, see
    ``consumer.leases``) fails the job rather than leave it running."""


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One finished stream entry: what to store and whom to wake before acknowledging it."""

    stream: str
    entry_id: bytes
    payload: bytes | None
    """The encoded result; None only acknowledges the entry (it was deleted from the stream)."""
    result_key: str | None = None
    ttl_ms: int = 0
    result_backup: bool = False
    """``result_key`` only backs up the reply: written only if the reply stream is missing."""
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

    @property
    def entry(self) -> tuple[str, bytes]:
        return self.stream, self.entry_id

    def letter(self) -> DeadLetter:
        return DeadLetter(self.stream, self.entry_id.decode(), self.reason, self.raw or b"")


class Outcomes:
    """Builds the ``Outgoing`` of each way a request can end on this worker."""

    def __init__(self, keys: Keys, now_ms: Callable[[], int], worker_id: str) -> None:
        self._keys = keys
        self._now_ms = now_ms
        self._worker_id = worker_id

    def nothing(self, stream: str, entry_id: bytes) -> Outgoing:
        """Only acknowledge: the entry was deleted, or its job is not to run."""
        return Outgoing(stream, entry_id, None, model=self._model(stream))

    def undecodable(self, stream: str, entry_id: bytes, reason: str, raw: bytes) -> Outgoing:
        model = self._model(stream)
        dlq = self._keys.dlq(model)
        return Outgoing(
            stream, entry_id, None, dead_letter=dlq, reason=reason, raw=raw, model=model
        )

    def _model(self, stream: str) -> str:
        parsed = self._keys.parse_stream(stream)
        return parsed[0] if parsed else ""

    def poisoned(self, d: Delivery, reason: str, raw: bytes) -> Outgoing:
        """Dead-lettered after too many deliveries; its caller is answered with the reason (a
        job fails with it, whether its record says queued or running)."""
        r = d.request
        failed = InferResult(
            r.id, Status.FAILED, r.model, r.version, error=reason, worker=self._worker_id
        )
        out = replace(
            self.result(d, failed),
            dead_letter=self._keys.dlq(r.model),
            reason=reason,
            raw=raw,
        )
        if out.job is None:
            return out
        # The record is "queued" when the last worker's lease lapsed and it was re-queued, or
        # still "running" when it had not yet: either way the job fails with the reason.
        failing = out.job.args  # the failed result's move (from running)
        return replace(out, job=replace(out.job, required=JobStatus.QUEUED, if_running=failing))

    def expired(self, d: Delivery) -> Outgoing:
        r = d.request
        result = InferResult(
            r.id,
            Status.EXPIRED,
            r.model,
            r.version,
            worker=self._worker_id,
            error=f"deadline passed after {max(0, d.read_ms - r.enqueued_ms)} ms in the queue "
            "before a worker could run the request",
        )
        return self.result(d, result)

    def result(
        self, d: Delivery, result: InferResult, finished_at: float | None = None
    ) -> Outgoing:
        """A request answered (run by the model, failed, expired): its result is encoded here,
        once, for every place it is stored. ``finished_at`` (monotonic) is when its model call
        ended, read once for a whole batch; by default, now."""
        r = d.request
        payload = result.encode()
        if finished_at is None:
            finished_at = time.monotonic()
        if r.kind is Kind.JOB:
            return Outgoing(
                d.stream,
                d.entry_id,
                payload,
                job=self._job_update(r, result, payload),
                model=r.model,
                finished_at=finished_at,
                traceparent=r.traceparent,
            )
        return Outgoing(
            d.stream,
            d.entry_id,
            payload,
            model=r.model,
            finished_at=finished_at,
            traceparent=r.traceparent,
            # Only successes are stored: the result key doubles as the cache entry.
            result_key=r.result_key if result.status is Status.OK else None,
            ttl_ms=r.result_ttl_ms,
            reply_to=r.reply_to,
            # Not a cache key, and a reply to carry the same bytes: see the module docstring.
            result_backup=r.reply_to is not None and r.result_key == self._keys.result(r.id),
        )

    def _job_update(self, r: InferRequest, result: InferResult, payload: bytes) -> JobUpdate:
        now = self._now_ms()
        if result.status is Status.OK:
            required = JobStatus.RUNNING
            args = transition_args(JobStatus.SUCCEEDED, finished_ms=now, result=payload)
        elif result.status is Status.EXPIRED:
            error = result.error or "expired"
            lost = (
                "deadline passed before the job could be run again: the worker running it "
                "stopped renewing its lease"
            )
            return JobUpdate(
                self._keys.job(r.id),
                r.id,
                JobStatus.QUEUED,
                transition_args(JobStatus.EXPIRED, finished_ms=now, error=error),
                r.result_ttl_ms,
                if_running=transition_args(JobStatus.FAILED, finished_ms=now, error=lost),
            )
        else:
            required = JobStatus.RUNNING
            error = result.error or "failed"
            args = transition_args(JobStatus.FAILED, finished_ms=now, error=error)
        return JobUpdate(self._keys.job(r.id), r.id, required, args, r.result_ttl_ms)

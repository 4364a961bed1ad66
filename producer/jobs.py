"""Async jobs: submit now, collect later, from any gateway.

A job rides the same streams as synchronous requests (the low-priority lane unless the request
names a ``priority``), with no reply stream: its record in Redis (``protocol.jobs``) is what
clients poll. Gateways keep no job state, so any gateway, including one started after the
submission, can answer for any job. Long polls (``?wait=``) wait on a subscription that the
gateway's one listener feeds from the job events stream: no Redis connection per waiter.
``JobService`` is also the ``producer.events.Watched`` of jobs, for their event streams and
webhooks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, cast

import structlog

from producer import jobindex
from producer.errors import (
    BadRequest,
    Conflict,
    GatewayError,
    Gone,
    NotFound,
    ServiceUnavailable,
    TooManyRequests,
    UnprocessableContent,
    job_unconfirmed,
    redis_unavailable,
)
from producer.events import WatchedState, Webhook
from producer.service import Decode, InferenceService, Prepared, Terms
from producer.settings import GatewaySettings
from producer.v2_request import InferRequestBody
from producer.v2_response import response_document
from producer.webhooks import WebhookPolicy, asked
from protocol import ProtocolError
from protocol.cachekey import digest
from protocol.deadline import has_expired
from protocol.jobs import (
    FINAL_STATUSES,
    JOB_ID_RANDOM_BYTES,
    RESERVE_SCRIPT,
    SUBMIT_SCRIPT,
    TRANSITION_SCRIPT,
    UNDO_SCRIPT,
    JobRecord,
    JobStatus,
    idempotency_value,
    job_id_issued_ms,
    new_job_id,
    parse_idempotency_value,
    transition_args,
)
from protocol.keys import JOB_EVENTS_MAXLEN, Lane, idempotency_tag_bytes
from protocol.messages import (
    EVENT_STATUS_FIELD,
    FIELD,
    JOB_EVENT_FIELD,
    InferRequest,
    InferResult,
    Kind,
)
from runtime.faults import RETRYABLE, outcome_unknown
from runtime.tracing import Stage

log = structlog.get_logger("inferq.gateway")

_JOB_ID = re.compile(r"^([A-Za-z0-9_-]{22}|[A-Za-z0-9_-]{32})$")
"""Job ids: 32 characters (``protocol.jobs.new_job_id``); 22 for those issued before."""
_IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")


@dataclass(frozen=True, slots=True)
class Submitted:
    record: JobRecord
    replayed: bool
    """True when an Idempotency-Key matched an earlier submission: no new job was made."""


@dataclass(frozen=True, slots=True)
class JobAsk:
    """One job for ``JobService.submit_many``: what ``submit`` takes, less the trace."""

    name: str
    version: str | None
    decode: Decode
    idempotency_key: str | None
    headers: Mapping[str, str] | None = None


@dataclass(frozen=True, slots=True)
class _Job:
    """A job checked and routed (``JobService._job``), on its way to Redis."""

    record: JobRecord
    request: InferRequest
    lane: Lane
    record_key: str
    stream: str
    key: str | None
    """The Idempotency-Key, if any..."""
    idem: str | None
    """... the Redis key that holds it..."""
    value: str
    """... and what it is to hold: the job id and the request's ``request_digest``."""
    webhook: Webhook | None
    stage: Stage

    @property
    def keys(self) -> list[str]:
        """The record's key, and the Idempotency-Key's (one slot on a cluster)."""
        return [self.record_key, *([self.idem] if self.idem is not None else [])]


def _took(
    jobs: Sequence[_Job], replies: Sequence[Any], earlier: dict[str, bytes | None]
) -> list[_Job]:
    """The jobs a script wrote (its reply ``{0}``); into ``earlier``, the others: the value of
    the Idempotency-Key that names an earlier job (``{1, value}``), or None (an error reply)."""
    wrote = []
    for job, reply in zip(jobs, replies, strict=True):
        if isinstance(reply, BaseException):
            earlier[job.record.id] = None
        elif reply[0] != 0:
            earlier[job.record.id] = cast(bytes, reply[1])
        else:
            wrote.append(job)
    return wrote


def _queued_anew(outcome: Submitted | GatewayError) -> bool:
    return isinstance(outcome, Submitted) and not outcome.replayed


def request_digest(asked_version: str | None, body: InferRequestBody) -> str:
    """What makes two job submissions the same request: the inputs (whether sent as JSON or as
    binary data), the requested outputs and their form, the version asked for (not the one a
    traffic split picked), the request id and parameters."""
    h = hashlib.blake2b(digest_size=16)
    h.update(digest(body.inputs, body.outputs).encode())
    rest = [asked_version, body.client_id, body.parameters, sorted(body.binary_outputs)]
    h.update(json.dumps([*rest, body.binary_all], sort_keys=True, separators=(",", ":")).encode())
    return h.hexdigest()


def job_terms(settings: GatewaySettings) -> Terms:
    """Jobs: ``--job-timeout-s`` unless the request names a timeout, capped by their retention
    (``--job-ttl``); the low lane unless a priority is named; never the cache; refused at
    ``--max-job-backlog`` queued, whatever the deadlines (a job waits as long as it must)."""
    return Terms(
        kind=Kind.JOB,
        default_timeout_ms=settings.job_timeout_s * 1000,
        max_timeout_ms=settings.job_ttl_s * 1000,
        unprioritised=Lane.LOW,
        cache=False,
        result_ttl_ms=settings.job_ttl_s * 1000,
        queue_cap=settings.max_job_backlog,
        stage="enqueue",  # the worker's spans of this job join it
    )


def iso(ms: int) -> str | None:
    if not ms:
        return None
    stamp = datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")


JOB_WEBHOOK_EVENTS = frozenset(s.value for s in JobStatus)
DEFAULT_WEBHOOK_EVENTS = frozenset(s.value for s in FINAL_STATUSES)


class JobService:
    field = JOB_EVENT_FIELD
    """Jobs as ``producer.events.Watched``: announced under this events field..."""
    path = "jobs"
    """... and served under ``/v2/jobs``."""

    def __init__(
        self,
        settings: GatewaySettings,
        inference: InferenceService,
        webhooks: WebhookPolicy | None = None,
    ) -> None:
        self.settings = settings
        self.inference = inference
        self.webhooks = webhooks or WebhookPolicy(settings)
        self.keys = inference.keys
        self.registry = inference.registry
        self.replies = inference.replies
        self.clock = inference.clock
        self._broker = inference.pipeline.broker
        self._redis = self._broker.commands
        self._transition = self._broker.script(TRANSITION_SCRIPT)
        self._submit = self._broker.script(SUBMIT_SCRIPT)
        self._reserve = self._broker.script(RESERVE_SCRIPT)
        self._undo = self._broker.script(UNDO_SCRIPT)
        self.terms = job_terms(settings)
        self._id_key = settings.job_id_mac_key()

    async def submit(
        self,
        name: str,
        version: str | None,
        decode: Decode,
        *,
        idempotency_key: str | None,
        traceparent: str | None,
        headers: Mapping[str, str] | None = None,
    ) -> Submitted:
        """Queue a job for the request ``decode`` parses, or find the one an Idempotency-Key
        names; the record of either (its ``version`` is the one the job was routed to). A
        webhook is asked for in the request's parameters or in ``headers``
        (``producer.webhooks.asked``)."""
        job = await self._job(JobAsk(name, version, decode, idempotency_key, headers), traceparent)
        try:
            existing = await self._claim(job)
        except GatewayError as e:
            e.routed = job.request.version
            raise
        finally:
            job.stage.end()
        if existing is not None:
            return Submitted(existing, replayed=True)
        await self._queued(job)
        log.info(
            "job queued",
            job_id=job.record.id,
            model=name,
            version=job.request.version,
            lane=job.lane.value,
            traceparent=traceparent,
        )
        return Submitted(job.record, replayed=False)

    async def submit_many(self, asks: Sequence[JobAsk]) -> list[Submitted | GatewayError]:
        """``submit`` for many jobs at once (a batch's lines): each ask's outcome in order, a
        refusal as its error. Under ``--job-durability async`` the submissions share their round
        trips (``_enqueue_together``): one on one Redis (a ``SUBMIT_SCRIPT`` each: every job
        still one atomic step), two on a Redis Cluster (``_enqueue``'s steps); under
        ``replicated`` each takes ``submit``'s steps, all at once. An Idempotency-Key
        that names an earlier job is replayed as ``submit`` replays it. An ask refused with
        "retry later" (429 at ``--max-job-backlog``, 503) ends the list: the asks after it are
        not tried, so a backlog at its cap is filled in order. Raises what Redis raises when
        the shared round trip fails: its submissions' outcome is unknown, and asking again
        with the same Idempotency-Keys finds the jobs that were queued."""
        outcomes: list[Submitted | GatewayError] = []
        jobs: list[tuple[int, _Job]] = []
        for ask in asks:
            try:
                job = await self._job(ask, None)
            except (TooManyRequests, ServiceUnavailable) as e:
                outcomes.append(e)
                break
            except GatewayError as e:
                outcomes.append(e)
                continue
            jobs.append((len(outcomes), job))
            outcomes.append(Submitted(job.record, replayed=False))
        together: list[_Job] = []
        if len(jobs) > 1 and self.settings.job_durability != "replicated":
            together = [job for _, job in jobs]
        try:
            # Of those queued together: each job id whose Idempotency-Key named an earlier job
            # (the key's value), or whose script failed (None: it takes submit's own steps).
            earlier = await self._enqueue_together(together) if together else {}
            sent = {job.record.id for job in together if job.record.id not in earlier}
            rest = [(i, job) for i, job in jobs if job.record.id not in sent]
            claims = await asyncio.gather(
                *(self._claim(job, earlier.get(job.record.id)) for _, job in rest),
                return_exceptions=True,
            )
        finally:
            for _, job in jobs:
                job.stage.end()
        for (i, job), claim in zip(rest, claims, strict=True):
            if isinstance(claim, GatewayError):
                claim.routed = job.request.version
                outcomes[i] = claim
            elif isinstance(claim, BaseException):
                raise claim
            elif claim is not None:
                outcomes[i] = Submitted(claim, replayed=True)
        queued = [job for i, job in jobs if _queued_anew(outcomes[i])]
        for job in queued:
            await self._queued(job)
        if queued:
            log.info("jobs queued", count=len(queued), model=queued[0].record.model)
        return outcomes

    async def _job(self, ask: JobAsk, traceparent: str | None) -> _Job:
        """A job checked and routed, not yet queued (its ``stage`` open: whoever queues it ends
        it)."""
        key = ask.idempotency_key
        if key is not None and not _IDEMPOTENCY_KEY.match(key):
            raise BadRequest("Idempotency-Key must be 1 to 255 visible ASCII characters")
        random = secrets.token_bytes(JOB_ID_RANDOM_BYTES)
        if key:
            # The record shares the key's slot on a cluster (protocol.keys, JOB_TAG).
            tag = idempotency_tag_bytes(ask.name, key)
            random = tag + random[len(tag) :]
        job_id = new_job_id(self.clock.now_ms(), random, self._id_key)
        prepared = await self.inference.prepare(
            ask.name,
            ask.version,
            ask.decode,
            self.terms,
            traceparent=traceparent,
            request_id=job_id,
        )
        assert isinstance(prepared, Prepared), "jobs are never answered from the cache"
        request, body = prepared.request, prepared.body
        try:
            webhook = await self._webhook(body.parameters, ask.headers or {})
        except GatewayError as e:
            prepared.stage.end()
            e.routed = request.version
            raise
        record = JobRecord(
            id=job_id,
            model=ask.name,
            version=request.version,
            status=JobStatus.QUEUED,
            created_ms=request.enqueued_ms,
            deadline_ms=request.deadline_ms,
            client_id=body.client_id or "",
            binary_outputs=tuple(sorted(body.binary_outputs)),
            binary_all=body.binary_all,
            webhook=webhook.url if webhook else "",
            webhook_events=tuple(sorted(webhook.events)) if webhook else (),
        )
        idem = self.keys.idempotency(ask.name, key) if key else None
        fingerprint = request_digest(ask.version or None, body) if key else ""
        value = idempotency_value(job_id, fingerprint) if idem else ""
        stream = self.keys.stream(
            ask.name,
            prepared.schedule.lane,
            self.inference.partition(ask.name, prepared.partitions),
        )
        return _Job(
            record,
            request,
            prepared.schedule.lane,
            self.keys.job(job_id),
            stream,
            key,
            idem,
            value,
            webhook,
            prepared.stage,
        )

    async def _queued(self, job: _Job) -> None:
        """What follows a job's queueing: the backlog counts it, and a webhook that asked for
        ``queued`` hears it."""
        self.registry.note_queued(job.record.model)
        if job.webhook is not None and JobStatus.QUEUED.value in job.webhook.events:
            # Best effort: unannounced, "queued" is told with the job's next change.
            with contextlib.suppress(*RETRYABLE):
                await self._announce(job.record.id, JobStatus.QUEUED)

    def _one_step(self, job: _Job) -> bool:
        """Whether one script may name the job's record, key and stream (one Redis)."""
        return len(self._broker.colocated([*job.keys, job.stream])) == 1

    def _submit_call(self, job: _Job, replacing: bytes) -> tuple[list[Any], list[Any]]:
        """``SUBMIT_SCRIPT``'s keys and arguments for one job: the one way a job is queued in
        one step, alone (``_enqueue``) or with others (``_enqueue_together``)."""
        fields = [item for pair in job.record.to_fields().items() for item in pair]
        return (
            [job.keys[0], job.stream, *job.keys[1:]],
            [self.terms.result_ttl_ms, FIELD, job.request.encode(), job.value, replacing, *fields],
        )

    async def _enqueue_together(self, jobs: Sequence[_Job]) -> dict[str, bytes | None]:
        """Queue ``jobs`` in one round trip, indexed with them, where each is ``_one_step``;
        else (a Redis Cluster) as ``_enqueue`` does, each step one round trip for all: the
        records and keys (``RESERVE_SCRIPT``), then the requests, and a job whose request
        could not be queued is taken back (``UNDO_SCRIPT``). Nothing stays written for the
        jobs it returns: by job id, the value of an Idempotency-Key that names an earlier job,
        or None where a step answered an error (Redis out of memory): ``_claim`` takes those
        on, as ``submit`` would."""
        index = jobindex.commands(self.keys, {j.record.id: j.record.created_ms for j in jobs})
        earlier: dict[str, bytes | None] = {}
        if all(self._one_step(job) for job in jobs):
            calls = [self._submit_call(job, b"") for job in jobs]
            _took(jobs, await self._submit.batch(calls, then=index), earlier)
            return earlier
        calls = [(job.keys, self._reserve_args(job, b"")) for job in jobs]
        reserved = _took(jobs, await self._reserve.batch(calls, then=index), earlier)
        if not reserved:
            return earlier
        try:
            queued = await self._broker.batch(
                [("XADD", job.stream, "*", FIELD, job.request.encode()) for job in reserved]
            )
        except RETRYABLE as e:
            if not outcome_unknown(e):  # none was queued: take them back
                with contextlib.suppress(*RETRYABLE):
                    await self._undo_all(reserved)
            raise
        failed = [j for j, r in zip(reserved, queued, strict=True) if isinstance(r, BaseException)]
        await self._undo_all(failed)
        earlier.update((job.record.id, None) for job in failed)
        return earlier

    async def _undo_all(self, jobs: Sequence[_Job]) -> None:
        for job in jobs:
            await self._undo(keys=job.keys, args=[job.value])

    def _reserve_args(self, job: _Job, replacing: bytes) -> list[Any]:
        """``RESERVE_SCRIPT``'s arguments for one job (its keys: ``job.keys``)."""
        fields = [item for pair in job.record.to_fields().items() for item in pair]
        return [self.terms.result_ttl_ms, job.value, replacing, *fields]

    async def _webhook(
        self, parameters: Mapping[str, object], headers: Mapping[str, str]
    ) -> Webhook | None:
        ask = asked(parameters, headers)
        if ask is None:
            return None
        return await self.webhooks.check(ask, JOB_WEBHOOK_EVENTS, DEFAULT_WEBHOOK_EVENTS)

    async def _claim(self, job: _Job, earlier: bytes | None = None) -> JobRecord | None:
        """Queue the job and claim its Idempotency-Key, if any: None once queued, or the earlier
        job the key names (``earlier``: the key's value, when a submission together with
        others already found it taken)."""
        replacing = b""
        try:
            for _ in range(3):
                if earlier is None:
                    earlier = await self._enqueue(job, replacing)
                    if earlier is None:
                        return None
                existing = await self._replay(job.record.model, job.key or "", earlier, job.value)
                if existing is not None:
                    return existing
                replacing, earlier = earlier, None  # its job is past retention: the key is free
        except RETRYABLE as e:
            if outcome_unknown(e):
                raise job_unconfirmed(e, job.record.id) from e
            raise redis_unavailable(e, "queue the job") from e
        raise ServiceUnavailable("could not claim the Idempotency-Key; retry")

    async def _enqueue(self, job: _Job, replacing: bytes) -> bytes | None:
        """Write the record, enqueue the job and claim the key. None when queued; else the
        value of the key, which names an earlier job.

        Where one script may reach the record, the key and the request stream (one Redis), one
        atomic step (``SUBMIT_SCRIPT``), followed on the same pipeline by the job index's two
        commands (``producer.jobindex``: no round trip of their own). A Redis Cluster keeps the
        stream in another slot than the record and the key: there the record and the key are
        written first, atomically (``RESERVE_SCRIPT``), the request is queued second, and if
        that fails both are taken back (``UNDO_SCRIPT``), so a job that was never queued is not
        shown for long. A replay
        arriving between the two steps gets the job that the first step is about to queue.

        Under ``--job-durability replicated`` each step ends with ``WAIT 1`` on the node that
        wrote it: the job is accepted only once a replica has all of it.

        A step whose reply was lost (``runtime.faults.outcome_unknown``) may have been carried
        out. The one atomic step is then looked for: found, the job is queued; not found (or
        on a cluster, where the record is kept and expires at its deadline if the request
        never got queued), ``_claim`` answers that the job may have been queued."""
        record, request, stream = job.record, job.request, job.stream
        keys, value, key = job.keys, job.value, job.record_key
        replicated = self.settings.job_durability == "replicated"
        if self._one_step(job):
            pipe = self._redis.pipeline(transaction=False)
            self._submit.queue(pipe, *self._submit_call(job, replacing))
            jobindex.queue_add(pipe, self.keys, record.id, record.created_ms)
            if replicated:
                await self._wait_on(pipe, key)
            try:
                replies = await pipe.execute()
            except RETRYABLE as e:
                if replicated or not outcome_unknown(e) or not await self._exists(key):
                    raise
                return None  # its reply was lost, not the job
            if replies[0][0] != 0:
                return cast(bytes, replies[0][1])
            if replicated:
                await self._confirmed(record, [replies[-1]])
            return None
        pipe = self._redis.pipeline(transaction=False)
        self._reserve.queue(pipe, keys, self._reserve_args(job, replacing))
        jobindex.queue_add(pipe, self.keys, record.id, record.created_ms)
        if replicated:
            await self._wait_on(pipe, key)
        reserved = await pipe.execute()
        if reserved[0][0] != 0:
            return cast(bytes, reserved[0][1])
        try:
            pipe = self._redis.pipeline(transaction=False)
            pipe.xadd(stream, {FIELD: request.encode()})
            if replicated:
                await self._wait_on(pipe, stream)
            queued = await pipe.execute()
        except RETRYABLE as e:
            if not outcome_unknown(e):  # not queued: take the record back
                with contextlib.suppress(*RETRYABLE):
                    await self._undo(keys=keys, args=[value])
            raise
        if replicated:
            await self._confirmed(record, [reserved[-1], queued[-1]])
        return None

    async def _exists(self, key: str) -> bool:
        """Whether Redis holds ``key`` (False when it cannot say)."""
        try:
            return bool(await self._redis.exists(key))
        except RETRYABLE:
            return False

    async def _wait_on(self, pipe: Any, key: str) -> None:
        """Queue ``WAIT 1`` on the node that owns ``key``: it covers the writes before it."""
        wait_ms = self.settings.job_replica_wait_ms
        await self._broker.queue_wait(pipe, key, replicas=1, timeout_ms=wait_ms)

    async def _confirmed(self, record: JobRecord, acks: list[Any]) -> None:
        """Every WAIT saw a replica; or the job is cancelled (so it never runs) and refused."""
        if all(isinstance(n, int) and n >= 1 for n in acks):
            return
        log.warning(
            "job not confirmed by a replica; cancelled (--job-durability replicated needs a "
            "replica of every master: INFO replication, connected_slaves)",
            job_id=record.id,
            model=record.model,
            wait_ms=self.settings.job_replica_wait_ms,
        )
        with contextlib.suppress(*RETRYABLE):
            before = await self._move(record, JobStatus.CANCELLED)
            if before is not None and before != JobStatus.QUEUED.value.encode():
                return  # a worker has started it already: it runs, so it is accepted
        raise ServiceUnavailable(
            f"the job could not be confirmed on a replica within "
            f"{self.settings.job_replica_wait_ms} ms, so it was not accepted; retry",
            retry_after_s=1,
        )

    async def _replay(self, model: str, key: str, earlier: bytes, value: str) -> JobRecord | None:
        """The earlier job under an Idempotency-Key, if the request is the same (422 if not);
        None when that job is past retention."""
        try:
            job_id, earlier_digest = parse_idempotency_value(earlier)
        except ProtocolError:
            return None  # unreadable: take the key over
        record = await self._load(job_id)
        if record is None:
            return None
        _, digest = parse_idempotency_value(value.encode())
        if earlier_digest and earlier_digest != digest:
            # The job id is not in the message: keys are scoped per model, not per caller, and
            # a job id is what gives access to a job's result.
            raise UnprocessableContent(
                f"Idempotency-Key '{key}' was already used for model '{model}' with a different "
                "request; a key can be reused only to retry the same request (same inputs, "
                "outputs, version and parameters): use a new key for a new request"
            )
        return record

    async def _load(self, job_id: str) -> JobRecord | None:
        raw = cast(dict[bytes, bytes], await self._redis.hgetall(self.keys.job(job_id)))
        if not raw:
            return None
        try:
            record = JobRecord.from_fields(raw)
        except ProtocolError as e:
            log.error("unreadable job record", job_id=job_id, error=str(e))
            return None
        if record.status is JobStatus.QUEUED and has_expired(
            record.deadline_ms, self.clock.now_ms()
        ):
            # Nobody ran it in time: make that final, so no worker starts it now.
            await self._move(
                record,
                JobStatus.EXPIRED,
                error="deadline passed before a worker could start the job",
            )
            return await self._load(job_id)
        return record

    async def _move(self, record: JobRecord, to: JobStatus, **fields: str | int) -> bytes | None:
        before = await self._transition(
            keys=[self.keys.job(record.id)],
            args=[
                record.status.value,
                *transition_args(to, finished_ms=self.clock.now_ms(), **fields),
            ],
        )
        was = before[0] if before else None
        if was == record.status.value.encode():  # it moved: tell the watchers where to
            await self._announce(record.id, to)
        return was

    async def _announce(self, job_id: str, status: JobStatus) -> None:
        await self._redis.xadd(
            self.keys.job_events,
            {JOB_EVENT_FIELD: job_id, EVENT_STATUS_FIELD: status.value},
            maxlen=JOB_EVENTS_MAXLEN,
            approximate=True,
        )

    async def get(self, job_id: str, wait_s: float = 0.0) -> JobRecord:
        if not _JOB_ID.match(job_id):
            raise NotFound(f"no job '{job_id}'")
        wait_s = max(0.0, min(wait_s, self.settings.max_job_wait_s))
        events = self.replies.events
        changed = events.subscribe(JOB_EVENT_FIELD, job_id) if wait_s else None
        try:
            record = await self._read(job_id)
            deadline = time.monotonic() + wait_s
            while changed is not None and not record.status.final:
                # Any change wakes it ("running" too): wait on until a final one, or the end.
                remaining = deadline - time.monotonic()
                if remaining <= 0 or await changed.next(remaining) is None:
                    break
                record = await self._read(job_id)
            return record
        finally:
            if changed is not None:
                events.unsubscribe(changed)

    async def state(self, object_id: str) -> WatchedState | None:
        """The job as ``GET /v2/jobs/{id}`` shows it, with the states it went through (its
        event stream and webhooks; ``producer.events``)."""
        if not _JOB_ID.match(object_id):
            return None
        record = await self._load(object_id)
        return None if record is None else watched_state(record)

    async def _read(self, job_id: str) -> JobRecord:
        try:
            record = await self._load(job_id)
        except RETRYABLE as e:
            raise redis_unavailable(e, "read the job") from e
        if record is None:
            raise self._missing(job_id)
        return record

    def _missing(self, job_id: str) -> Gone | NotFound:
        """404 for an id nobody issued (its MAC fails) or a job past its retention; 410 for a
        job issued within the retention window whose record is gone: Redis lost it. An id
        stamped after this gateway's now was issued by a gateway whose estimate of the Redis
        clock runs a little ahead of this one's: it is recent, not unknown."""
        issued_ms = job_id_issued_ms(job_id, self._id_key)
        now_ms = self.clock.now_ms()
        if issued_ms is not None and now_ms - issued_ms < self.settings.job_ttl_s * 1000:
            return Gone(
                f"job '{job_id}' was accepted at {iso(issued_ms)}, but Redis no longer has its "
                "record: Redis lost data (it restarted without persistence, or evicted keys "
                "under its maxmemory-policy). The job may not have run; submit it again"
            )
        return NotFound(f"no job '{job_id}' (unknown, or past its retention)")

    async def cancel(self, job_id: str) -> JobRecord:
        record = await self.get(job_id)
        if record.status is JobStatus.QUEUED:
            try:
                before = await self._move(record, JobStatus.CANCELLED)
            except RETRYABLE as e:
                raise redis_unavailable(e, "cancel the job") from e
            record = await self.get(job_id)
            if before == JobStatus.QUEUED.value.encode():
                log.info("job cancelled", job_id=job_id, model=record.model)
                return record
        if record.status is JobStatus.CANCELLED:
            return record
        if record.status is JobStatus.RUNNING:
            raise Conflict(f"job '{job_id}' has already started and can no longer be cancelled")
        raise Conflict(f"job '{job_id}' has already finished ({record.status.value})")


def watched_state(record: JobRecord) -> WatchedState:
    """A job's state and the ones before it, each with its document as JSON alone (binary
    outputs as JSON data: an event or a webhook body carries no binary part)."""
    webhook = Webhook(record.webhook, frozenset(record.webhook_events)) if record.webhook else None

    def at(status: JobStatus) -> WatchedState:
        doc, _ = document(record.at(status), binary=False)
        return WatchedState(doc, status.value, status.final, webhook)

    earlier = tuple(at(status) for status in record.status.path[:-1])
    return replace(at(record.status), earlier=earlier)


def render(record: JobRecord) -> tuple[bytes, int | None]:
    """The job as JSON, with the V2 inference response under ``result`` once it succeeded;
    with the binary tensor extension (the header length returned) when the result has binary
    outputs."""
    doc, blobs = document(record)
    header = json.dumps(doc, separators=(",", ":")).encode()
    return (b"".join([header, *blobs]), len(header)) if blobs else (header, None)


def document(record: JobRecord, *, binary: bool = True) -> tuple[dict[str, Any], list[bytes]]:
    """The job's JSON document and the binary outputs that follow it (``binary``: as the
    submitter asked; else none, every output as JSON data where JSON can carry it)."""
    doc: dict[str, Any] = {
        "id": record.id,
        "model_name": record.model,
        "model_version": record.version,
        "status": record.status.value,
        "created_at": iso(record.created_ms),
        "started_at": iso(record.started_ms),
        "finished_at": iso(record.finished_ms),
        "deadline_at": iso(record.deadline_ms),
    }
    blobs: list[bytes] = []
    if record.status is JobStatus.SUCCEEDED and record.result:
        result = InferResult.decode(record.result)
        doc["result"], blobs = response_document(
            client_id=record.client_id or None,
            model_name=result.model,
            model_version=result.version,
            outputs=result.outputs,
            binary_outputs=frozenset(record.binary_outputs) if binary else frozenset(),
            binary_all=record.binary_all and binary,
        )
    elif record.error:
        doc["error"] = record.error
    if record.webhook:
        doc["webhook"] = {"url": record.webhook, "events": list(record.webhook_events)}
    return doc, blobs if binary else []

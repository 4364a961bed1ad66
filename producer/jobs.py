"""Async jobs: submit now, collect later, from any gateway.

A job rides the same streams as synchronous requests (the low-priority lane unless the request
names a ``priority``), with no reply stream: its record in Redis (``protocol.jobs``) is what
clients poll. Gateways keep no job state, so any gateway, including one started after the
submission, can answer for any job. Long polls (``?wait=``) wait on a future that the gateway's
one listener resolves from the job events stream: no Redis connection per waiter.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

import structlog
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from producer.errors import BadRequest, Conflict, NotFound, ServiceUnavailable, TooManyRequests
from producer.routing import ROUTED_VERSION
from producer.service import InferenceService
from producer.settings import GatewaySettings
from producer.v2 import encode_infer_response, parse_infer_request
from protocol import ProtocolError
from protocol.jobs import TRANSITION_SCRIPT, JobRecord, JobStatus, transition_args
from protocol.keys import Lane
from protocol.messages import FIELD, InferRequest, InferResult, Kind
from runtime.tracing import REQUEST_TRACE

log = structlog.get_logger("inferq.gateway")

_JOB_ID = re.compile(r"^[A-Za-z0-9_-]{22}$")
_IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")


@dataclass(frozen=True, slots=True)
class Submitted:
    record: JobRecord
    replayed: bool
    """True when an Idempotency-Key matched an earlier submission: no new job was made."""


def new_job_id() -> str:
    """128 random bits, URL-safe: unguessable, so a job id is its own access token."""
    return secrets.token_urlsafe(16)


def iso(ms: int) -> str | None:
    if not ms:
        return None
    stamp = datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")


class JobService:
    def __init__(self, settings: GatewaySettings, inference: InferenceService) -> None:
        self.settings = settings
        self.inference = inference
        self.keys = inference.keys
        self.registry = inference.registry
        self.replies = inference.replies
        self.clock = inference.clock
        self._redis = inference.pipeline.redis
        self._transition: AsyncScript = self._redis.register_script(TRANSITION_SCRIPT)

    async def submit(
        self,
        name: str,
        version: str | None,
        raw: bytes,
        header_length: int | None,
        *,
        idempotency_key: str | None,
        traceparent: str | None,
    ) -> Submitted:
        entry, version = await self.inference.model(name, version)
        ROUTED_VERSION.set(version)
        meta = entry.metadata
        body = parse_infer_request(raw, header_length, meta)
        sched = self.inference.schedule(meta, body, no_cache=True)  # validates the parameters
        if idempotency_key is not None and not _IDEMPOTENCY_KEY.match(idempotency_key):
            raise BadRequest("Idempotency-Key must be 1 to 255 visible ASCII characters")
        backlog = self.registry.backlog(name)
        if backlog >= self.settings.max_job_backlog:
            raise TooManyRequests(
                f"model '{name}' has {backlog} requests queued, at its limit of "
                f"{self.settings.max_job_backlog}; retry later",
                retry_after_s=5,
            )
        timeout_us = body.parameters.get("timeout")
        timeout_ms = timeout_us // 1000 if timeout_us else self.settings.job_timeout_s * 1000
        timeout_ms = max(1, min(timeout_ms, self.settings.job_ttl_s * 1000))
        lane = Lane.for_priority(sched.priority) if "priority" in body.parameters else Lane.LOW
        job_id = new_job_id()
        ttl_ms = self.settings.job_ttl_s * 1000
        trace = REQUEST_TRACE.get()
        trace.since_start("receive and validate")
        enqueue = trace.start("enqueue")  # the worker's spans of this job join it
        try:
            if idempotency_key is not None:
                existing = await self._claim_idempotency(name, idempotency_key, job_id, ttl_ms)
                if existing is not None:
                    return Submitted(existing, replayed=True)
            now = self.clock.now_ms()
            record = JobRecord(
                id=job_id,
                model=name,
                version=version,
                status=JobStatus.QUEUED,
                created_ms=now,
                deadline_ms=now + timeout_ms,
                client_id=body.client_id or "",
                binary_outputs=tuple(sorted(body.binary_outputs)),
                binary_all=body.binary_all,
            )
            request = InferRequest(
                id=job_id,
                model=name,
                version=version,
                inputs=body.inputs,
                outputs=body.outputs,
                deadline_ms=record.deadline_ms,
                enqueued_ms=now,
                result_key="",
                result_ttl_ms=ttl_ms,
                kind=Kind.JOB,
                priority=sched.priority,
                client_id=body.client_id,
                traceparent=enqueue.propagate(traceparent),
            )
            # One round trip, in order: the record exists before any worker can read the job.
            pipe = self._redis.pipeline(transaction=False)
            pipe.hset(self.keys.job(job_id), mapping=cast(Any, record.to_fields()))
            pipe.pexpire(self.keys.job(job_id), ttl_ms)
            pipe.xadd(self.keys.stream(name, lane), {FIELD: request.encode()})
            await pipe.execute()
        except (RedisError, OSError) as e:
            raise ServiceUnavailable(
                f"the queue (Redis) is unreachable: {e}", retry_after_s=1
            ) from e
        finally:
            enqueue.end()
        self.registry.note_queued(name)
        log.info(
            "job queued",
            job_id=job_id,
            model=name,
            version=version,
            lane=lane.value,
            traceparent=traceparent,
        )
        return Submitted(record, replayed=False)

    async def _claim_idempotency(
        self, model: str, key: str, job_id: str, ttl_ms: int
    ) -> JobRecord | None:
        """The earlier job under this key, or None after claiming the key for ``job_id``."""
        idem = self.keys.idempotency(model, key)
        for _ in range(3):
            if await self._redis.set(idem, job_id, nx=True, px=ttl_ms):
                return None
            earlier = cast(bytes | None, await self._redis.get(idem))
            if earlier is not None:
                record = await self._load(earlier.decode())
                if record is not None:
                    return record
                await self._redis.delete(idem)  # its job has expired from retention
        raise ServiceUnavailable("could not claim the Idempotency-Key; retry", retry_after_s=1)

    async def _load(self, job_id: str) -> JobRecord | None:
        raw = cast(dict[bytes, bytes], await self._redis.hgetall(self.keys.job(job_id)))
        if not raw:
            return None
        try:
            record = JobRecord.from_fields(raw)
        except ProtocolError as e:
            log.error("unreadable job record", job_id=job_id, error=str(e))
            return None
        if record.status is JobStatus.QUEUED and self.clock.now_ms() >= record.deadline_ms:
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
        await self._redis.xadd(
            self.keys.job_events, {b"job": record.id}, maxlen=100_000, approximate=True
        )
        return before[0] if before else None

    async def get(self, job_id: str, wait_s: float = 0.0) -> JobRecord:
        if not _JOB_ID.match(job_id):
            raise NotFound(f"no job '{job_id}'")
        wait_s = max(0.0, min(wait_s, self.settings.max_job_wait_s))
        changed = self.replies.expect_job(job_id) if wait_s else None
        try:
            record = await self._read(job_id)
            if changed is not None and not record.status.final:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait_s):
                        await changed
                record = await self._read(job_id)
            return record
        finally:
            if changed is not None:
                self.replies.forget_job(job_id, changed)

    async def _read(self, job_id: str) -> JobRecord:
        try:
            record = await self._load(job_id)
        except (RedisError, OSError) as e:
            raise ServiceUnavailable(
                f"the queue (Redis) is unreachable: {e}", retry_after_s=1
            ) from e
        if record is None:
            raise NotFound(f"no job '{job_id}' (unknown, or past its retention)")
        return record

    async def cancel(self, job_id: str) -> JobRecord:
        record = await self.get(job_id)
        if record.status is JobStatus.QUEUED:
            try:
                before = await self._move(record, JobStatus.CANCELLED)
            except (RedisError, OSError) as e:
                raise ServiceUnavailable(f"the queue (Redis) is unreachable: {e}") from e
            record = await self.get(job_id)
            if before == JobStatus.QUEUED.value.encode():
                log.info("job cancelled", job_id=job_id, model=record.model)
                return record
        if record.status is JobStatus.CANCELLED:
            return record
        if record.status is JobStatus.RUNNING:
            raise Conflict(f"job '{job_id}' has already started and can no longer be cancelled")
        raise Conflict(f"job '{job_id}' has already finished ({record.status.value})")


def render(record: JobRecord) -> tuple[bytes, int | None]:
    """The job as JSON, with the V2 inference response under ``result`` once it succeeded;
    with the binary tensor extension when the submission asked for binary outputs."""
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
    tail = b""
    if record.status is JobStatus.SUCCEEDED and record.result:
        result = InferResult.decode(record.result)
        body, header_length = encode_infer_response(
            client_id=record.client_id or None,
            model_name=result.model,
            model_version=result.version,
            outputs=result.outputs,
            binary_outputs=frozenset(record.binary_outputs),
            binary_all=record.binary_all,
        )
        if header_length is None:
            doc["result"] = json.loads(body)
        else:
            doc["result"] = json.loads(body[:header_length])
            tail = body[header_length:]
    elif record.error:
        doc["error"] = record.error
    header = json.dumps(doc, separators=(",", ":")).encode()
    return (header + tail, len(header)) if tail else (header, None)

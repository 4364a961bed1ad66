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
from protocol.keys import Lane, idempotency_tag
from protocol.messages import FIELD, InferRequest, InferResult, Kind

log = structlog.get_logger("inferq.gateway")

_JOB_ID = re.compile(r"^[A-Za-z0-9_-]{22}$")
_IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")


@dataclass(frozen=True, slots=True)
class Submitted:
    record: JobRecord
    replayed: bool
    """True when an Idempotency-Key matched an earlier submission: no new job was made."""


def new_job_id(tag: str | None = None) -> str:
    """22 URL-safe characters, unguessable, so a job id is its own access token: 128 random
    bits; or, for a submission with an Idempotency-Key, that key's hash tag (JOB_TAG_CHARS
    characters, so the record shares a slot with the key, see ``protocol.keys``) and 108
    random bits."""
    token = secrets.token_urlsafe(16)
    return token if tag is None else tag + token[len(tag) :]


def iso(ms: int) -> str | None:
    if not ms:
        return None
    stamp = datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")


class JobService:
    def __init__(
        self, settings: GatewaySettings, inference: InferenceService, *, cluster: bool = False
    ) -> None:
        self.settings = settings
        self.inference = inference
        self.keys = inference.keys
        self.registry = inference.registry
        self.replies = inference.replies
        self.clock = inference.clock
        self._redis = inference.pipeline.redis
        self.cluster = cluster
        """A Redis Cluster: the record and the request are written in two steps."""
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
        job_id = new_job_id(
            idempotency_tag(name, idempotency_key) if idempotency_key is not None else None
        )
        ttl_ms = self.settings.job_ttl_s * 1000
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
                traceparent=traceparent,
            )
            stream = self.keys.stream(name, lane, self.inference.partition(name, meta.partitions))
            await self._enqueue(record, stream, request.encode(), ttl_ms)
        except (RedisError, OSError) as e:
            raise ServiceUnavailable(
                f"the queue (Redis) is unreachable: {e}", retry_after_s=1
            ) from e
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

    async def _enqueue(self, record: JobRecord, stream: str, payload: bytes, ttl_ms: int) -> None:
        """Write the job record, then queue the request: the record must exist before any
        worker can read the job (a worker skips a job it finds no record for).

        One Redis: one pipeline, executed in order. A Redis Cluster splits a pipeline per node
        and sends the parts concurrently, and the stream lives in another slot than the record,
        so there the record goes first and the request second, in two round trips; if queueing
        fails the record is deleted again, so a job that was never queued is never shown.

        Under ``--job-durability replicated`` each part ends with ``WAIT 1`` on the connection
        (and node) that wrote it: the job is accepted only once a replica has both."""
        key = self.keys.job(record.id)
        replicated = self.settings.job_durability == "replicated"
        pipe = self._redis.pipeline(transaction=False)
        pipe.hset(key, mapping=cast(Any, record.to_fields()))
        pipe.pexpire(key, ttl_ms)
        if not self.cluster:
            pipe.xadd(stream, {FIELD: payload})
            if replicated:
                pipe.execute_command("WAIT", 1, self.settings.job_replica_wait_ms)
            replies = await pipe.execute()
            if replicated:
                await self._confirmed(record, [replies[-1]])
            return
        if replicated:
            self._wait_on(pipe, key)
        replies = await pipe.execute()
        try:
            pipe = self._redis.pipeline(transaction=False)
            pipe.xadd(stream, {FIELD: payload})
            if replicated:
                self._wait_on(pipe, stream)
            queued = await pipe.execute()
        except (RedisError, OSError):
            with contextlib.suppress(RedisError, OSError):
                await self._redis.delete(key)
            raise
        if replicated:
            await self._confirmed(record, [replies[-1], queued[-1]])

    def _wait_on(self, pipe: Any, key: str) -> None:
        """Queue ``WAIT 1`` on the node that owns ``key`` (a cluster pipeline runs each node's
        commands in order on one connection, so it covers the writes before it)."""
        node = self._redis.get_node_from_key(key)  # type: ignore[attr-defined]
        pipe.execute_command("WAIT", 1, self.settings.job_replica_wait_ms, target_nodes=node)

    async def _confirmed(self, record: JobRecord, acks: list[Any]) -> None:
        """Every WAIT saw a replica, or the job is cancelled (so it never runs) and refused."""
        if all(isinstance(n, int) and n >= 1 for n in acks):
            return
        log.warning(
            "job not confirmed by a replica; cancelled (--job-durability replicated needs a "
            "replica of every master: INFO replication, connected_slaves)",
            job_id=record.id,
            model=record.model,
            wait_ms=self.settings.job_replica_wait_ms,
        )
        with contextlib.suppress(RedisError, OSError):
            before = await self._move(record, JobStatus.CANCELLED)
            if before is not None and before != JobStatus.QUEUED.value.encode():
                return  # a worker has started it already: it runs, so it is accepted
        raise ServiceUnavailable(
            f"the job could not be confirmed on a replica within "
            f"{self.settings.job_replica_wait_ms} ms, so it was not accepted; retry",
            retry_after_s=1,
        )

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

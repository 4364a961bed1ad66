"""Async jobs: the record kept in Redis for each job, and its legal state changes.

A job record is a Redis hash under ``Keys.job(id)``; ``JobRecord`` is its one codec. A job moves
``queued -> running -> succeeded | failed``, or ``queued -> cancelled | expired``. Every
conditional move goes through ``TRANSITION_SCRIPT`` (atomic in Redis), so a cancel and a worker
starting the job cannot both win: whichever runs first decides, and the model never runs a job
that was cancelled or had expired.

A running job is leased: ``CLAIM_SCRIPT`` records the worker that runs it and until when
(``worker``, ``lease_until_ms``, Redis time), and that worker's heartbeat renews the lease
(``RENEW_SCRIPT``). A job whose lease lapsed (its worker died, or stalled past it) is
**re-queued**, never failed on that account: its request entry is still pending in the stream,
and the worker that reclaims the entry claims the job again and runs it (at least once, as every
request of a worker that dies mid-batch). The same worker claiming again finds its own name (its
first claim ran but the reply was lost) and runs it. A job that keeps killing its workers ends
``failed`` when its entry is dead-lettered after ``--max-deliveries``. So every accepted job
reaches a final state.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from dataclasses import dataclass, field, replace
from enum import StrEnum

from protocol.errors import ProtocolError

JOB_ID_RANDOM_BYTES = 14
"""112 random bits: a job id is its own access token, so it must be unguessable (well past the
64 bits OWASP asks of a session id)."""
_STAMP_BYTES = 6  # milliseconds since the epoch fit in 48 bits until the year 10889
_MAC_BYTES = 4
_MAC_PERSON = b"inferq-job-id"
JOB_ID_LENGTH = 32
"""Characters of a job id: (6 + 14 + 4) bytes in URL-safe base64, no padding."""


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"

    @property
    def final(self) -> bool:
        return self not in (JobStatus.QUEUED, JobStatus.RUNNING)

    @property
    def path(self) -> tuple[JobStatus, ...]:
        """The statuses a job in this one has had, oldest first, ending with this one: a job's
        moves are fixed (queued, then running, then succeeded or failed; or from queued
        straight to cancelled or expired), so its history follows from where it is."""
        if self is JobStatus.QUEUED:
            return (self,)
        if self in (JobStatus.CANCELLED, JobStatus.EXPIRED):
            return (JobStatus.QUEUED, self)
        running = (JobStatus.QUEUED, JobStatus.RUNNING)
        return running if self is JobStatus.RUNNING else (*running, self)


FINAL_STATUSES: tuple[JobStatus, ...] = tuple(s for s in JobStatus if s.final)
"""What a job's webhook reports when the submission names no ``webhook_events``."""


TRANSITION_SCRIPT = """
-- KEYS: job records. ARGV[1]: required current status, ARGV[2]: new status,
-- ARGV[3..]: field/value pairs to set with it. Returns each record's status before the call
-- (false where the record does not exist); records not in ARGV[1] are left alone.
local out = {}
for i, key in ipairs(KEYS) do
  local status = redis.call('HGET', key, 'status')
  out[i] = status
  if status == ARGV[1] then
    redis.call('HSET', key, 'status', ARGV[2], unpack(ARGV, 3))
  end
end
return out
"""


CLAIM_SCRIPT = """
-- A worker claims jobs it is about to run, each under a lease that its heartbeat renews
-- (RENEW_SCRIPT), so that a job whose worker died (or whose claim's reply was lost) is run
-- again instead of staying 'running' for good. The lease is in Redis time (TIME), so no
-- worker's clock matters.
-- KEYS: job records. ARGV[1]: the worker's name, ARGV[2]: the lease (ms), ARGV[3]: started_ms.
-- Returns per key: 'claimed' (it was queued: now running here), 'again' (it was running,
-- claimed by this worker already, whose reply was lost, or by one whose lease has lapsed: now
-- running here, to be run again), 'leased' (running under another worker's live lease: left
-- alone), else its status (false where the record does not exist), left alone.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease_until = now + tonumber(ARGV[2])
local out = {}
for i, key in ipairs(KEYS) do
  local f = redis.call('HMGET', key, 'status', 'worker', 'lease_until_ms')
  if f[1] == 'queued' then
    redis.call('HSET', key, 'status', 'running', 'started_ms', ARGV[3],
               'worker', ARGV[1], 'lease_until_ms', lease_until)
    out[i] = 'claimed'
  elseif f[1] == 'running' then
    if f[2] == ARGV[1] or (tonumber(f[3]) or 0) <= now then
      redis.call('HSET', key, 'worker', ARGV[1], 'lease_until_ms', lease_until)
      out[i] = 'again'
    else
      out[i] = 'leased'
    end
  else
    out[i] = f[1]
  end
end
return out
"""

RENEW_SCRIPT = """
-- The heartbeat of a worker's running jobs: each lease this worker holds moves to now + the
-- lease. KEYS: job records. ARGV[1]: the worker's name, ARGV[2]: the lease (ms).
-- Returns per key 1 where it renewed the lease, 0 where not (the job finished, or another
-- worker took it over after this one's lease lapsed).
local t = redis.call('TIME')
local lease_until = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[2])
local out = {}
for i, key in ipairs(KEYS) do
  local f = redis.call('HMGET', key, 'status', 'worker')
  out[i] = 0
  if f[1] == 'running' and f[2] == ARGV[1] then
    redis.call('HSET', key, 'lease_until_ms', lease_until)
    out[i] = 1
  end
end
return out
"""


class Claim(StrEnum):
    """What ``CLAIM_SCRIPT`` did with one job (its other answers are the job's status)."""

    CLAIMED = "claimed"
    AGAIN = "again"
    LEASED = "leased"


SUBMIT_SCRIPT = """#!lua
-- Submitting a job is one atomic step: the record, the enqueue and the Idempotency-Key are
-- written together or not at all, so a replay of the key never finds a job that was never
-- queued. The shebang (no flags) makes Redis refuse the whole script up front when it is out of
-- memory, instead of failing at its first write; any other failure of the enqueue undoes the
-- record. On Redis Cluster the keys must share a hash slot: the model's streams, its
-- idempotency keys and its jobs' records would all carry the model's hash tag, and a job id
-- would carry that tag too, so that GET /v2/jobs/{id} still finds the record from the id alone.
--
-- KEYS[1]: the job record, KEYS[2]: the request stream, KEYS[3] (optional): the idempotency key.
-- ARGV[1]: TTL (ms) of the record and the key, ARGV[2]: the stream entry's field,
-- ARGV[3]: the encoded request, ARGV[4]: the idempotency value (job id and request digest),
-- ARGV[5]: an idempotency value to replace (its job is past retention; '' for none),
-- ARGV[6..]: the record's field/value pairs.
-- Returns {0} when queued, or {1, value} when the key names an earlier job (nothing written).
if KEYS[3] then
  local earlier = redis.call('GET', KEYS[3])
  if earlier and earlier ~= ARGV[5] then
    return {1, earlier}
  end
end
redis.call('HSET', KEYS[1], unpack(ARGV, 6))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
local queued = redis.pcall('XADD', KEYS[2], '*', ARGV[2], ARGV[3])
if type(queued) == 'table' and queued.err then
  redis.call('DEL', KEYS[1])
  return queued
end
if KEYS[3] then
  redis.call('SET', KEYS[3], ARGV[4], 'PX', ARGV[1])
end
return {0}
"""


RESERVE_SCRIPT = """#!lua
-- Redis Cluster's first step of a submission: the record and the Idempotency-Key (one slot:
-- the job id carries the key's hash tag, see protocol.keys), written together or not at all.
-- The request stream lives in another slot, so the enqueue follows as a second step, and
-- UNDO_SCRIPT takes both back if it fails.
-- KEYS[1]: the job record, KEYS[2] (optional): the idempotency key.
-- ARGV[1]: TTL (ms), ARGV[2]: the idempotency value, ARGV[3]: a value to replace ('' for none),
-- ARGV[4..]: the record's field/value pairs.
-- Returns {0} when written, or {1, value} when the key names an earlier job (nothing written).
if KEYS[2] then
  local earlier = redis.call('GET', KEYS[2])
  if earlier and earlier ~= ARGV[3] then
    return {1, earlier}
  end
end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
if KEYS[2] then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[1])
end
return {0}
"""

UNDO_SCRIPT = """
-- Take back a RESERVE_SCRIPT whose enqueue failed. KEYS[1]: the job record, KEYS[2]
-- (optional): the idempotency key, deleted only while it still names this job (ARGV[1]).
redis.call('DEL', KEYS[1])
if KEYS[2] and redis.call('GET', KEYS[2]) == ARGV[1] then
  redis.call('DEL', KEYS[2])
end
return 0
"""


def idempotency_value(job_id: str, request_digest: str) -> str:
    """What an idempotency key stores: the job it made and a digest of the request that made it,
    so that the key's reuse with a different request is recognised."""
    return f"{job_id} {request_digest}"


def parse_idempotency_value(raw: bytes) -> tuple[str, str]:
    """(job id, request digest); the digest is '' for keys written before digests were kept."""
    try:
        job_id, _, request_digest = raw.decode().partition(" ")
    except UnicodeDecodeError as e:
        raise ProtocolError(f"idempotency key value is malformed: {e}") from e
    return job_id, request_digest


@dataclass(frozen=True, slots=True)
class JobRecord:
    """One job as stored. Times are milliseconds on the Redis clock; 0 means not yet."""

    id: str
    model: str
    version: str
    status: JobStatus
    created_ms: int
    deadline_ms: int
    started_ms: int = 0
    finished_ms: int = 0
    client_id: str = ""
    binary_outputs: tuple[str, ...] = ()
    """Outputs the submitter asked to get back as binary data."""
    binary_all: bool = False
    result: bytes = b""
    """The encoded ``InferResult`` once succeeded."""
    error: str = ""
    webhook: str = ""
    """The URL told of the job's changes (``producer.webhooks``); "" for none."""
    webhook_events: tuple[str, ...] = ()
    """The statuses the webhook is told of."""
    extra: dict[str, str] = field(default_factory=dict)

    def at(self, status: JobStatus) -> JobRecord:
        """The record as it was while the job was in ``status`` (one of ``self.status.path``):
        each move sets its own fields only (``started_ms`` on running; ``finished_ms`` and the
        result or error at the end), so an earlier state is this one without them."""
        if status is self.status:
            return self
        earlier = replace(self, status=status, finished_ms=0, result=b"", error="")
        return earlier if status is JobStatus.RUNNING else replace(earlier, started_ms=0)

    def to_fields(self) -> dict[str, str | bytes | int]:
        webhook: dict[str, str] = {}
        if self.webhook:  # most jobs have none: no empty fields in every record
            webhook = {"webhook": self.webhook, "webhook_events": ",".join(self.webhook_events)}
        return {
            "id": self.id,
            "model": self.model,
            "version": self.version,
            "status": self.status.value,
            "created_ms": self.created_ms,
            "deadline_ms": self.deadline_ms,
            "started_ms": self.started_ms,
            "finished_ms": self.finished_ms,
            "client_id": self.client_id,
            "binary_outputs": ",".join(self.binary_outputs),
            "binary_all": int(self.binary_all),
            "result": self.result,
            "error": self.error,
            **webhook,
        }

    @classmethod
    def from_fields(cls, raw: dict[bytes, bytes]) -> JobRecord:
        try:
            f = {k.decode(): v for k, v in raw.items()}
            text = {k: v.decode() for k, v in f.items() if k != "result"}
            return cls(
                id=text["id"],
                model=text["model"],
                version=text["version"],
                status=JobStatus(text["status"]),
                created_ms=int(text["created_ms"]),
                deadline_ms=int(text["deadline_ms"]),
                started_ms=int(text.get("started_ms", 0)),
                finished_ms=int(text.get("finished_ms", 0)),
                client_id=text.get("client_id", ""),
                binary_outputs=tuple(o for o in text.get("binary_outputs", "").split(",") if o),
                binary_all=text.get("binary_all", "0") == "1",
                result=f.get("result", b""),
                error=text.get("error", ""),
                webhook=text.get("webhook", ""),
                webhook_events=tuple(e for e in text.get("webhook_events", "").split(",") if e),
            )
        except (KeyError, ValueError, UnicodeDecodeError, AttributeError) as e:
            raise ProtocolError(f"job record is malformed: {e!r}") from e


def transition_args(new: JobStatus, **fields: str | bytes | int) -> list[str | bytes | int]:
    """ARGV tail for ``TRANSITION_SCRIPT``: the new status and the fields to set with it."""
    args: list[str | bytes | int] = [new.value]
    for name, value in fields.items():
        args += [name, value]
    return args


def new_job_id(now_ms: int, random: bytes, key: bytes) -> str:
    """A job id: when it was issued (Redis clock), 112 random bits and a 32-bit keyed MAC.

    The time lets any gateway tell a job whose record Redis lost (issued within the retention
    window, record missing: 410) from an id nobody issued or one past its retention (404). The
    MAC, keyed with ``key`` (``--job-id-key``, the same on every gateway), is what makes the
    time trustworthy: an id whose time a caller made up fails it, and answers 404, not a 410
    that says Redis lost data (issue #21; an unkeyed checksum could be recomputed). The random
    bits are what make an id unguessable."""
    if len(random) != JOB_ID_RANDOM_BYTES:
        raise ValueError(f"a job id needs {JOB_ID_RANDOM_BYTES} random bytes")
    body = now_ms.to_bytes(_STAMP_BYTES, "big") + random
    return base64.urlsafe_b64encode(body + _mac(body, key)).decode()


def job_id_issued_ms(job_id: str, key: bytes) -> int | None:
    """When the job id was issued (Redis-clock milliseconds), or None if it is not one that
    ``new_job_id`` made with ``key`` (another format, a typo, a forgery)."""
    if len(job_id) != JOB_ID_LENGTH:
        return None
    try:
        raw = base64.urlsafe_b64decode(job_id.encode())
    except (binascii.Error, ValueError):
        return None
    body, mac = raw[:-_MAC_BYTES], raw[-_MAC_BYTES:]
    if len(raw) != _STAMP_BYTES + JOB_ID_RANDOM_BYTES + _MAC_BYTES:
        return None
    if not hmac.compare_digest(_mac(body, key), mac):
        return None
    return int.from_bytes(body[:_STAMP_BYTES], "big")


def job_id_key(secret: str) -> bytes:
    """The MAC key for job ids from a configured secret of any length (BLAKE2b takes at most
    64 bytes of key)."""
    return hashlib.blake2b(secret.encode(), digest_size=32, person=_MAC_PERSON).digest()


def _mac(body: bytes, key: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=_MAC_BYTES, key=key, person=_MAC_PERSON).digest()

"""Batches over HTTP: create one from a JSONL body, read it, list, cancel, delete, and stream its
answers. ``producer.batchrunner`` drives each batch to its end; this module only checks what comes
in and reads and writes the records (``protocol.batches``). ``BatchService`` is also the
``producer.events.Watched`` of batches, for their event streams and webhooks.

Why no ``POST /v2/files``: a batch's input is read once, checked line by line and stored with the
batch (its lines are what the runner resumes from), so an upload step would keep a second copy
with a lifecycle of its own and add a round trip, for nothing the batch needs. OpenAI-style tools
that upload a file first send the same bytes as the body of ``POST /v2/batches``.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import structlog

from producer.errors import (
    BadRequest,
    Conflict,
    GatewayError,
    NotFound,
    PayloadTooLarge,
    TooManyRequests,
    redis_unavailable,
)
from producer.events import WatchedState, Webhook
from producer.jobs import iso
from producer.service import InferenceService
from producer.settings import GatewaySettings
from producer.v2_request import parse_infer_request
from producer.webhooks import WebhookPolicy, asked
from protocol import ProtocolError
from protocol.batches import (
    BATCH_EVENT_FIELD,
    BATCH_FINAL_STATUSES,
    BATCH_PARTS,
    BATCH_RANDOM_BYTES,
    BATCH_WEBHOOK_EVENTS,
    DEFAULT_WINDOW_S,
    BatchLine,
    BatchRecord,
    BatchStatus,
    LineError,
    error_line,
    is_batch_id,
    new_batch_id,
    parse_line,
    parse_window,
)
from protocol.jobs import TRANSITION_SCRIPT, transition_args
from protocol.keys import JOB_EVENTS_MAXLEN, Keys, text
from protocol.messages import EVENT_STATUS_FIELD
from runtime.faults import RETRYABLE

log = structlog.get_logger("inferq.gateway")

STORE_CHUNK = 1000
"""Lines per RPUSH / answers per HMGET: bounded commands, few round trips."""
MAX_LIST_LIMIT = 100


@dataclass(frozen=True, slots=True)
class BatchOptions:
    """What a batch asks for besides its lines (query parameters, or the fields of a JSON
    body)."""

    model: str = ""
    version: str = ""
    window_s: int = DEFAULT_WINDOW_S
    metadata: dict[str, str] = field(default_factory=dict)
    webhook: Webhook | None = None


@dataclass(frozen=True, slots=True)
class Counts:
    total: int
    completed: int
    failed: int


class BatchService:
    field = BATCH_EVENT_FIELD
    """Batches as ``producer.events.Watched``: announced under this events field..."""
    path = "batches"
    """... and served under ``/v2/batches``."""

    def __init__(
        self, settings: GatewaySettings, inference: InferenceService, webhooks: WebhookPolicy
    ) -> None:
        self.settings = settings
        self.inference = inference
        self.webhooks = webhooks
        self.keys = inference.keys
        self.clock = inference.clock
        self._broker = inference.pipeline.broker
        self._redis = self._broker.commands
        self._transition = self._broker.script(TRANSITION_SCRIPT)

    # -- create ----------------------------------------------------------------------------

    async def options(self, raw: Mapping[str, object], headers: Mapping[str, str]) -> BatchOptions:
        """The batch's options from query parameters or a JSON body's fields; BadRequest
        naming the one that is wrong."""
        model, version = raw.get("model") or "", raw.get("version") or ""
        if not isinstance(model, str) or not isinstance(version, str):
            raise BadRequest("'model' and 'version' must be strings")
        try:
            window_s = parse_window(raw.get("completion_window", DEFAULT_WINDOW_S))
        except ProtocolError as e:
            raise BadRequest(str(e)) from None
        if window_s > self.settings.batch_ttl_s:
            raise BadRequest(
                f"'completion_window' of {window_s} s is longer than batches are kept "
                f"(--batch-ttl {self.settings.batch_ttl_s} s)"
            )
        metadata = raw.get("metadata") or {}
        if isinstance(metadata, str):
            try:
                metadata = json.loads(metadata)
            except ValueError:
                raise BadRequest("'metadata' must be a JSON object") from None
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise BadRequest("'metadata' must be an object of strings")
        ask = asked(raw, headers)
        webhook = None
        if ask is not None:
            webhook = await self.webhooks.check(ask, BATCH_WEBHOOK_EVENTS, BATCH_FINAL_STATUSES)
        return BatchOptions(model, version, window_s, metadata, webhook)

    def too_large(self, error: PayloadTooLarge) -> PayloadTooLarge:
        return PayloadTooLarge(f"{error} (--max-batch-bytes {self.settings.max_batch_bytes})")

    async def create(self, lines: list[bytes], options: BatchOptions) -> dict[str, Any]:
        """Check every line, store the valid ones and an error line for each other, and write
        the record: the batch is then the runner's. 413 past ``--max-batch-lines``, 429 past
        ``--max-batches-in-flight``."""
        s = self.settings
        numbered = [(n, raw) for n, raw in enumerate(lines, 1) if raw.strip()]
        if len(numbered) > s.max_batch_lines:
            raise PayloadTooLarge(
                f"the batch has {len(numbered)} lines, more than the limit of "
                f"{s.max_batch_lines} (--max-batch-lines)"
            )
        if not numbered:
            raise BadRequest("the batch has no lines: send one JSON request per line")
        try:
            in_flight = int(await self._redis.scard(self.keys.batches_active))
        except RETRYABLE as e:
            raise redis_unavailable(e, "create the batch") from e
        if in_flight >= s.max_batches_in_flight:
            raise TooManyRequests(
                f"{in_flight} batches are in flight, the limit (--max-batches-in-flight "
                f"{s.max_batches_in_flight}); retry once one has finished",
                retry_after_s=10,
            )
        valid, errors = await self._check(numbered, options)
        now_ms = self.clock.now_ms()
        batch_id = new_batch_id(now_ms, secrets.token_bytes(BATCH_RANDOM_BYTES))
        status = BatchStatus.IN_PROGRESS if valid else BatchStatus.FAILED
        record = BatchRecord(
            id=batch_id,
            status=status,
            model=options.model,
            version=options.version,
            created_ms=now_ms,
            deadline_ms=now_ms + options.window_s * 1000,
            total=len(numbered),
            valid=len(valid),
            stamps={BatchStatus.VALIDATING.value: now_ms, status.value: self.clock.now_ms()},
            metadata=options.metadata,
            webhook=options.webhook.url if options.webhook else "",
            webhook_events=tuple(sorted(options.webhook.events)) if options.webhook else (),
        )
        try:
            await self._store(record, valid, errors)
        except RETRYABLE as e:
            raise redis_unavailable(e, "store the batch") from e
        log.info(
            "batch accepted",
            batch_id=batch_id,
            lines=record.total,
            invalid=len(errors),
            status=status.value,
        )
        return await self.document(batch_id)

    async def _check(
        self, numbered: list[tuple[int, bytes]], options: BatchOptions
    ) -> tuple[list[BatchLine], dict[int, bytes]]:
        """The lines that can run, and an error line for every other (by line number)."""
        valid: list[BatchLine] = []
        errors: dict[int, bytes] = {}
        seen: set[str] = set()
        models: dict[tuple[str, str], Any] = {}
        for n, raw in numbered:
            try:
                line = parse_line(raw, n, options.model, options.version)
                if line.custom_id in seen:
                    raise LineError(
                        f"line {n}: custom_id {line.custom_id!r} is already used by an "
                        "earlier line; each line needs its own",
                        line.custom_id,
                    )
                key = (line.model, line.version)
                if key not in models:
                    try:
                        entry, _ = await self.inference.model(
                            line.model, line.version or None, route=False
                        )
                        models[key] = entry.metadata
                    except GatewayError as e:
                        models[key] = e
                meta = models[key]
                if isinstance(meta, GatewayError):
                    raise LineError(f"line {n}: {meta}", line.custom_id)
                try:
                    parse_infer_request(line.body, None, meta)
                except GatewayError as e:
                    raise LineError(f"line {n}: {e}", line.custom_id) from None
            except LineError as e:
                errors[n] = error_line(n, e.custom_id, "invalid_request", str(e))
                continue
            seen.add(line.custom_id)
            valid.append(line)
        return valid, errors

    async def _store(
        self, record: BatchRecord, valid: list[BatchLine], errors: dict[int, bytes]
    ) -> None:
        """Lines and error lines first, the record last: a batch is seen only once whole."""
        ttl_ms = self.settings.batch_ttl_s * 1000
        lines_key = self.keys.batch(record.id, "lines")
        errors_key = self.keys.batch(record.id, "errors")
        pipe = self._redis.pipeline(transaction=False)
        for i in range(0, len(valid), STORE_CHUNK):
            pipe.rpush(lines_key, *(line.encode() for line in valid[i : i + STORE_CHUNK]))
        items = list(errors.items())
        for i in range(0, len(items), STORE_CHUNK):
            pipe.hset(errors_key, mapping=dict(items[i : i + STORE_CHUNK]))
        for part in BATCH_PARTS:
            if part != "lease":
                pipe.pexpire(self.keys.batch(record.id, part), ttl_ms)
        await pipe.execute()
        pipe = self._redis.pipeline(transaction=False)
        key = self.keys.batch(record.id)
        pipe.hset(key, mapping=record.to_fields())
        pipe.pexpire(key, ttl_ms)
        pipe.zadd(self.keys.batches, {record.id: 0})
        if not record.status.final:
            pipe.sadd(self.keys.batches_active, record.id)
        await pipe.execute()
        await self.announce(record.id, record.status)

    # -- read ------------------------------------------------------------------------------

    async def load(self, batch_id: str) -> BatchRecord | None:
        if not is_batch_id(batch_id):
            return None
        raw = cast(dict[bytes, bytes], await self._redis.hgetall(self.keys.batch(batch_id)))
        return _decoded(batch_id, raw)

    async def counts(self, record: BatchRecord) -> Counts:
        pipe = self._redis.pipeline(transaction=False)
        queue_counts(pipe, self.keys, record.id)
        completed, failed = await pipe.execute()
        return Counts(record.total, int(completed), int(failed))

    async def read(self, batch_id: str) -> tuple[BatchRecord, Counts]:
        try:
            record = await self.load(batch_id)
            if record is None:
                raise NotFound(f"no batch '{batch_id}' (unknown, deleted or past its retention)")
            return record, await self.counts(record)
        except RETRYABLE as e:
            raise redis_unavailable(e, "read the batch") from e

    async def document(self, batch_id: str) -> dict[str, Any]:
        record, counts = await self.read(batch_id)
        return render(record, counts)

    async def state(self, object_id: str) -> WatchedState | None:
        """The batch as ``GET /v2/batches/{id}`` shows it, with the statuses it went through
        before (from its per-status timestamps): event streams and webhooks report them."""
        record = await self.load(object_id)
        if record is None:
            return None
        doc = render(record, await self.counts(record))
        webhook = (
            Webhook(record.webhook, frozenset(record.webhook_events)) if record.webhook else None
        )
        order = list(BatchStatus)
        before = sorted(
            (ms, order.index(BatchStatus(name)), name)
            for name, ms in record.stamps.items()
            if name != record.status.value
        )  # by time, then (same millisecond) by the order of the moves
        earlier = tuple(
            WatchedState({**doc, "status": name}, name, False, webhook) for *_, name in before
        )
        return WatchedState(doc, record.status.value, record.status.final, webhook, earlier)

    async def list(self, after: str | None, limit: int) -> dict[str, Any]:
        """Newest first; ``after``: the last id of the previous page."""
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise BadRequest(f"'limit' must be 1 to {MAX_LIST_LIMIT}")
        if after is not None and not is_batch_id(after):
            raise BadRequest(f"'after' must be a batch id, got {after!r}")
        try:
            data, more = await read_page(self._redis, self.keys, after, limit)
        except RETRYABLE as e:
            raise redis_unavailable(e, "list the batches") from e
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": more,
        }

    async def answers(self, record: BatchRecord, part: str) -> AsyncIterator[bytes]:
        """The batch's output or error lines in input order, one JSON document a line."""
        key = self.keys.batch(record.id, part)
        for start in range(1, record.total + 1 + STORE_CHUNK, STORE_CHUNK):
            numbers = range(start, start + STORE_CHUNK)
            found = await self._redis.hmget(key, list(numbers))
            chunk = b"".join(a + b"\n" for a in found if a is not None)
            if chunk:
                yield chunk

    # -- change ----------------------------------------------------------------------------

    async def cancel(self, batch_id: str) -> dict[str, Any]:
        """Stop running what has not started: the runner cancels the queued lines' jobs and
        answers the lines not yet queued, and the batch ends ``cancelled``."""
        record, _ = await self.read(batch_id)
        if record.status is BatchStatus.IN_PROGRESS:
            try:
                moved = await self.move(record, BatchStatus.CANCELLING)
            except RETRYABLE as e:
                raise redis_unavailable(e, "cancel the batch") from e
            if moved:
                log.info("batch cancelling", batch_id=batch_id)
            record, _ = await self.read(batch_id)
        if record.status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
            return await self.document(batch_id)
        raise Conflict(f"batch '{batch_id}' has already ended ({record.status.value})")

    async def delete(self, batch_id: str) -> dict[str, Any]:
        """Remove a finished batch, its input and its answers."""
        record, _ = await self.read(batch_id)
        if not record.status.final:
            raise Conflict(
                f"batch '{batch_id}' is {record.status.value}: cancel it, then delete it once "
                "it is cancelled"
            )
        try:
            pipe = self._redis.pipeline(transaction=False)
            for part in ("", *BATCH_PARTS):
                pipe.delete(self.keys.batch(batch_id, part))
            pipe.zrem(self.keys.batches, batch_id)
            await pipe.execute()
        except RETRYABLE as e:
            raise redis_unavailable(e, "delete the batch") from e
        log.info("batch deleted", batch_id=batch_id)
        return {"id": batch_id, "object": "batch.deleted", "deleted": True}

    async def move(self, record: BatchRecord, to: BatchStatus, **fields: str | int) -> bool:
        """Move the batch from its status to ``to`` (atomic: a cancel and the runner's
        completion cannot both win) and announce it; whether it moved."""
        before = await self._transition(
            keys=[self.keys.batch(record.id)],
            args=[
                record.status.value,
                *transition_args(to, **{f"{to.value}_ms": self.clock.now_ms()}, **fields),
            ],
        )
        moved = bool(before) and before[0] == record.status.value.encode()
        if moved:
            await self.announce(record.id, to)
        return moved

    async def announce(self, batch_id: str, status: BatchStatus | None) -> None:
        """An events entry: a change of status, or of progress (the same status again)."""
        fields: dict[bytes, bytes | str] = {BATCH_EVENT_FIELD: batch_id}
        if status is not None:
            fields[EVENT_STATUS_FIELD] = status.value
        await self._redis.xadd(
            self.keys.job_events, fields, maxlen=JOB_EVENTS_MAXLEN, approximate=True
        )


def queue_counts(pipe: Any, keys: Keys, batch_id: str) -> None:
    """Queue what ``Counts`` reads (answered and failed lines): two replies."""
    pipe.hlen(keys.batch(batch_id, "output"))
    pipe.hlen(keys.batch(batch_id, "errors"))


async def read_page(
    redis: Any, keys: Keys, after: str | None, limit: int
) -> tuple[list[dict[str, Any]], bool]:
    """Up to ``limit`` batches newest first below ``after``, rendered, and whether more
    follow: two round trips whatever ``limit`` (the ids, then every record and its counts in
    one pipeline). A batch gone between the two is left out."""
    top = f"({after}" if after else "+"
    found = await redis.zrevrangebylex(keys.batches, top, "-", 0, limit + 1)
    more = len(found) > limit
    ids = [text(raw) for raw in found[:limit]]
    if not ids:
        return [], more
    pipe = redis.pipeline(transaction=False)
    for batch_id in ids:
        pipe.hgetall(keys.batch(batch_id))
        queue_counts(pipe, keys, batch_id)
    replies = await pipe.execute()
    data = []
    for i, batch_id in enumerate(ids):
        raw, completed, failed = replies[3 * i : 3 * i + 3]
        record = _decoded(batch_id, raw)
        if record is not None:
            data.append(render(record, Counts(record.total, int(completed), int(failed))))
    return data, more


def _decoded(batch_id: str, raw: dict[bytes, bytes]) -> BatchRecord | None:
    """A batch record from its hash; None for none (past its retention) or one unreadable."""
    if not raw:
        return None
    try:
        return BatchRecord.from_fields(raw)
    except ProtocolError as e:
        log.error("unreadable batch record", batch_id=batch_id, error=str(e))
        return None


def render(record: BatchRecord, counts: Counts) -> dict[str, Any]:
    """The batch object (the shape of OpenAI's): status, counts, when it entered each status,
    and where its answers are."""
    doc: dict[str, Any] = {
        "id": record.id,
        "object": "batch",
        "status": record.status.value,
        "model": record.model or None,
        "completion_window": f"{(record.deadline_ms - record.created_ms) // 1000}s",
        "request_counts": {
            "total": counts.total,
            "completed": counts.completed,
            "failed": counts.failed,
        },
        "created_at": iso(record.created_ms),
        "expires_at": iso(record.deadline_ms),
        **{f"{s.value}_at": iso(record.stamps.get(s.value, 0)) for s in BatchStatus},
        "output_url": f"/v2/batches/{record.id}/output",
        "errors_url": f"/v2/batches/{record.id}/errors",
        "metadata": record.metadata,
    }
    if record.version:
        doc["model_version"] = record.version
    if record.webhook:
        doc["webhook"] = {"url": record.webhook, "events": list(record.webhook_events)}
    return doc

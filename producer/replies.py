"""Results come back to the gateway on one reply stream per gateway process.

Workers ``XADD`` each result to the stream named in the request; one listener task per gateway
reads it with a blocking ``XREAD`` on a dedicated connection and resolves the waiting request's
future. Waiting requests hold no Redis connection: 10,000 waiters cost 10,000 futures and one
connection (on one Redis, ``runtime.resp``'s lean connection: at concurrency 1 this read is
one round trip per request, and redis-py's client cost more than the rest of the gateway's Redis
work together). The listener remembers the last id it read, so after a reconnect it continues where
it stopped and no result is lost; it trims what it has read (``XTRIM MINID``, every thousand
entries or second, in the same round trip as a read). The stream carries a TTL that the gateway
refreshes; workers write with ``NOMKSTREAM``, so the stream of a gateway that died expires and is
not recreated.

Both loops (the listener and the keepalive) survive every Redis error with backoff, and report
their health to readiness. The keepalive notices when the stream it keeps alive has vanished
(its TTL ran out while Redis refused writes, Redis evicted it or restarted empty): it recreates
it and sweeps the waiting requests at once (``producer.losses``), answering those whose results
are stored and failing those Redis lost. Every keepalive also sweeps, so requests whose entries
vanished from a request stream are failed within two heartbeats rather than at their deadline.

Job events (``Keys.job_events``, which every gateway reads to wake its long polls) ride in the
same ``XREAD`` on one Redis. On a Redis Cluster the two streams sit in different slots, which one
command cannot read together, so ``run_job_events`` reads them in a second loop (a second
blocking connection per gateway: still O(1)).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import redis.asyncio as aioredis
import structlog

from producer.errors import ServiceUnavailable
from producer.losses import sweep
from producer.waiters import Waiter, Waiters
from protocol import ProtocolError
from protocol.keys import next_id, text
from protocol.messages import FIELD, JOB_EVENT_FIELD, KEEPALIVE_FIELD, InferResult
from runtime.aio import cancelling
from runtime.backoff import Backoff
from runtime.faults import RETRYABLE
from runtime.resp import RespConnection

log = structlog.get_logger("inferq.gateway")

TRIM_EVERY = 1000
TRIM_INTERVAL_S = 1.0
EVENTS_START_POLL_S = 0.1
LOST = (
    "Redis lost the request before a worker answered it (Redis restarted without its data, or "
    "evicted or trimmed the request stream); it may not have run. Retry it"
)


def _pairs(flat: list[Any]) -> dict[Any, Any]:
    """A stream entry's fields as RESP sends them (name, value, name, value...), as a dict."""
    it = iter(flat)
    return dict(zip(it, it, strict=True))


class ReplyListener:
    def __init__(
        self,
        reader: aioredis.Redis,
        commands: aioredis.Redis,
        key: str,
        *,
        block_ms: int,
        ttl_s: float,
        job_events: str | None = None,
        separate_job_events: bool = False,
        count: int = 1000,
        reads: Backoff | None = None,
        keepalives: Backoff | None = None,
        events: Backoff | None = None,
        lean: RespConnection | None = None,
    ) -> None:
        self._reader = reader
        self._lean = lean
        """Reads (and trims) over this connection instead of ``reader``'s, when given."""
        self._commands = commands
        self.key = key
        self._block_ms = block_ms
        self._ttl_ms = int(ttl_s * 1000)
        self._count = count
        self.waiters = Waiters()
        """The requests waiting on this stream's replies."""
        self._last_id = "$"
        self._made = False
        """Whether this listener's stream has existed (so a missing one means it was lost)."""
        self.job_events = job_events
        self.separate_job_events = separate_job_events
        """Read job events in ``run_job_events`` instead of with the replies (a cluster)."""
        self._events_id: str | None = None
        self._job_waiters: dict[str, set[asyncio.Future[None]]] = {}
        self._reads = reads or Backoff("replies", log)
        self._keepalives = keepalives or Backoff("reply-keepalive", log)
        self._events = events or Backoff("job-events", log)
        self.losses = 0
        """Times the reply stream was found gone."""
        self.lost = 0
        """Waiting requests failed because Redis lost them."""

    @property
    def waiting(self) -> int:
        return len(self.waiters)

    @property
    def healthy(self) -> bool:
        return self._reads.healthy and self._keepalives.healthy

    def expect_job(self, job_id: str) -> asyncio.Future[None]:
        """A future resolved when any worker or gateway announces that the job changed.

        Register before reading the job record, so a change between the read and the wait is
        not missed."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._job_waiters.setdefault(job_id, set()).add(future)
        return future

    def forget_job(self, job_id: str, future: asyncio.Future[None]) -> None:
        waiters = self._job_waiters.get(job_id)
        if waiters is not None:
            waiters.discard(future)
            if not waiters:
                del self._job_waiters[job_id]

    # -- the keepalive ---------------------------------------------------------------------

    async def keepalive(self) -> None:
        """Create the stream if missing and push its expiry forward. Found missing after it
        existed, the stream was lost with any replies on their way to it: sweep at once."""
        pipe = self._commands.pipeline(transaction=False)
        pipe.exists(self.key)
        pipe.xadd(self.key, {KEEPALIVE_FIELD: b"1"})
        pipe.pexpire(self.key, self._ttl_ms)
        if self.job_events is not None and self._events_id is None:
            pipe.xrevrange(self.job_events, count=1)
        replies = await pipe.execute()
        lost = self._made and not replies[0]
        self._made = True
        if self._last_id == "$":
            self._last_id = text(replies[1])
        if self.job_events is not None and self._events_id is None:
            self._events_id = text(replies[3][0][0]) if replies[3] else "0-0"
        if lost:
            self.losses += 1
            log.warning(
                "the reply stream was gone (expired while Redis refused writes, evicted, or "
                "Redis restarted empty); recreated it, checking the waiting requests",
                stream=self.key,
                waiting=len(self.waiters),
            )
            self._last_id = "0-0"  # read everything on the new stream
            await self.sweep(after_loss=True)

    async def sweep(self, *, after_loss: bool = False) -> None:
        """Answer waiters whose results are stored, and fail those Redis lost (see
        ``producer.losses``)."""
        verdict = await sweep(self._commands, self.waiters, after_loss=after_loss)
        for waiter, payload in verdict.found:
            # The waiter itself: a cache key holds the result of whichever request filled it.
            self._resolve_payload(payload, waiter)
        lost = [w for w in verdict.lost if w.fail(ServiceUnavailable(LOST, retry_after_s=1))]
        self.lost += len(lost)
        if lost:
            log.warning("requests lost by Redis failed at once", count=len(lost))

    async def run_keepalive(self, interval_s: float) -> None:
        """Keep the stream alive and sweep every ``interval_s``; on a Redis error, retry with
        backoff (sooner than the interval), reporting the failure to readiness meanwhile."""
        while not cancelling():
            try:
                await self.keepalive()
                await self.sweep()
            except RETRYABLE as e:
                await self._keepalives.failed(e)
                continue
            self._keepalives.succeeded()
            await asyncio.sleep(interval_s)

    # -- the listener ----------------------------------------------------------------------

    async def run(self) -> None:
        unread_trimmed = 0
        last_trim = time.monotonic()
        reconnected = False
        while not cancelling():
            # Trim what has been read, but only every TRIM_EVERY entries or TRIM_INTERVAL_S:
            # one XTRIM per read would be a Redis command per few requests for no benefit.
            trim = unread_trimmed >= TRIM_EVERY or (
                unread_trimmed and time.monotonic() - last_trim >= TRIM_INTERVAL_S
            )
            try:
                if reconnected:
                    # Redis may have come back empty: recreate the reply stream before anything
                    # is queued, or workers (writing with NOMKSTREAM) would drop replies.
                    await self.keepalive()
                    reconnected = False
                streams = {self.key: self._last_id}
                if (
                    self.job_events is not None
                    and self._events_id is not None
                    and not self.separate_job_events
                ):
                    streams[self.job_events] = self._events_id
                read = await self._read(streams, bool(trim))
            except RETRYABLE as e:
                reconnected = True
                await self._reads.failed(e)
                continue
            self._reads.succeeded()
            if trim:
                unread_trimmed, last_trim = 0, time.monotonic()
            for stream, entries in read:
                if text(stream) == self.job_events:
                    self._events_id = text(entries[-1][0])
                    for _, fields in entries:
                        self._job_changed(fields)
                    continue
                for entry_id, fields in entries:
                    self._last_id = text(entry_id)
                    unread_trimmed += 1
                    self._resolve(fields)

    async def _read(self, streams: dict[str, str], trim: bool) -> list[tuple[Any, list[Any]]]:
        """One blocking ``XREAD`` of ``streams`` (after an ``XTRIM`` of what was read, when
        ``trim``): [(stream, [(entry id, fields as a dict)])]."""
        if self._lean is None:
            pipe = self._reader.pipeline(transaction=False)
            if trim:
                pipe.xtrim(self.key, minid=next_id(self._last_id), approximate=False)
            pipe.xread(cast(Any, streams), count=self._count, block=self._block_ms)
            replies = await pipe.execute()
            return list(replies[-1] or [])
        commands: list[tuple[Any, ...]] = []
        if trim:
            commands.append(("XTRIM", self.key, "MINID", next_id(self._last_id)))
        names, ids = list(streams), list(streams.values())
        commands.append(
            ("XREAD", "COUNT", self._count, "BLOCK", self._block_ms, "STREAMS", *names, *ids)
        )
        replies = await self._lean.execute(commands)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply  # as redis-py's pipeline raises the first error reply
        return [
            (stream, [(entry_id, _pairs(flat)) for entry_id, flat in entries])
            for stream, entries in replies[-1] or []
        ]

    async def run_job_events(self) -> None:
        """Read the job events stream alone (on a cluster; see the module docstring)."""
        while not cancelling() and self.job_events is not None:
            if self._events_id is None:
                # The first keepalive finds where to start; until then there is nothing to read.
                await asyncio.sleep(EVENTS_START_POLL_S)
                continue
            try:
                reply: Any = await self._reader.xread(
                    {self.job_events: self._events_id}, count=self._count, block=self._block_ms
                )
            except RETRYABLE as e:
                await self._events.failed(e)
                continue
            self._events.succeeded()
            for _, entries in reply or []:
                self._events_id = text(entries[-1][0])
                for _, fields in entries:
                    self._job_changed(fields)

    def _job_changed(self, fields: dict[Any, Any]) -> None:
        job_id = fields.get(JOB_EVENT_FIELD)
        for future in self._job_waiters.pop(text(job_id), ()) if job_id else ():
            if not future.done():
                future.set_result(None)

    def _resolve(self, fields: dict[Any, Any]) -> None:
        payload = fields.get(FIELD)
        if payload is not None:  # else a keepalive entry
            self._resolve_payload(payload)

    def _resolve_payload(self, payload: bytes, waiter: Waiter | None = None) -> None:
        try:
            result = InferResult.decode(payload)
        except ProtocolError as e:
            log.error("undecodable reply ignored", error=str(e))
            return
        waiter = waiter or self.waiters.get(result.id)
        if waiter is not None:
            waiter.resolve(result)

    async def close(self) -> None:
        """Close the lean connection, if reads use one (the loops are stopped first)."""
        if self._lean is not None:
            await self._lean.close()

    def fail_all(self, error: Exception) -> None:
        """Fail every waiting request (the gateway is stopping)."""
        self.waiters.fail_all(error)

"""Results come back to the gateway on one reply stream per gateway process.

Workers ``XADD`` each result to the stream named in the request; one listener task per gateway
reads it with a blocking ``XREAD`` on a connection of its own (``Broker.blocking_reads``) and
resolves the waiting request's future. Waiting requests hold no Redis connection: 10,000 waiters
cost 10,000 futures and one connection. The listener remembers the last id it read, so after a
reconnect it continues where it stopped and no result is lost; it trims what it has read
(``XTRIM MINID``, every thousand entries or second, in the same round trip as a read). The
stream carries a TTL that the gateway refreshes; workers write with ``NOMKSTREAM``, so the
stream of a gateway that died expires and is not recreated.

Both loops (the listener and the keepalive) survive every Redis error with backoff, and report
their health to readiness. The keepalive notices when the stream it keeps alive has vanished
(its TTL ran out while Redis refused writes, Redis evicted it or restarted empty): it recreates
it and sweeps the waiting requests at once (``producer.losses``), answering those whose results
are stored and failing those Redis lost. Every keepalive also sweeps, so requests whose entries
vanished from a request stream are failed within two heartbeats rather than at their deadline.

Job events (``Keys.job_events``, which every gateway reads to wake its long polls, event streams
and webhook deliverer: ``events``, a ``producer.events.EventFanout``) ride in the same ``XREAD``
where one command may read both streams; where it may not (a Redis Cluster puts them in
different slots) the listener reads them in a second loop, on a second connection: still O(1).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog

from producer.errors import ServiceUnavailable
from producer.events import EventFanout
from producer.losses import sweep
from producer.waiters import Waiter, Waiters
from protocol import ProtocolError
from protocol.keys import next_id, text
from protocol.messages import FIELD, KEEPALIVE_FIELD, InferResult
from runtime.aio import cancelling
from runtime.backoff import Backoff
from runtime.broker import Broker
from runtime.faults import RETRYABLE
from runtime.readconn import BlockingReads, recover

log = structlog.get_logger("inferq.gateway")

TRIM_EVERY = 1000
TRIM_INTERVAL_S = 1.0
EVENTS_START_POLL_S = 0.1
LOST = (
    "Redis lost the request before a worker answered it (Redis restarted without its data, or "
    "evicted or trimmed the request stream); it may not have run. Retry it"
)


class ReplyListener:
    def __init__(
        self,
        broker: Broker,
        key: str,
        *,
        block_ms: int,
        ttl_s: float,
        reader_name: str = "inferq-gateway-replies",
        job_events: str | None = None,
        count: int = 1000,
        reads: Backoff | None = None,
        keepalives: Backoff | None = None,
        events: Backoff | None = None,
    ) -> None:
        self._broker = broker
        self._commands = broker.commands
        self._reader_name = reader_name
        """The client name of the read connections."""
        self._connections: list[BlockingReads] = []
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
        self._events_id: str | None = None
        self.events = EventFanout()
        """Who hears the job events: long polls, event streams, the webhook deliverer."""
        self._reads = reads or Backoff("replies", log)
        self._keepalives = keepalives or Backoff("reply-keepalive", log)
        self._events = events or Backoff("job-events", log)
        self.losses = 0
        """Times the reply stream was found gone (what ``Waiter.unconfirmed_in`` records)."""
        self._swept = 0
        """Of ``losses``, how many a sweep has judged the waiters after: a loss whose sweep
        failed (a pooled connection still to the Redis that went away) is swept again."""
        self.lost = 0
        """Waiting requests failed because Redis lost them."""

    @property
    def waiting(self) -> int:
        return len(self.waiters)

    @property
    def healthy(self) -> bool:
        return self._reads.healthy and self._keepalives.healthy

    # -- the keepalive ---------------------------------------------------------------------

    async def keepalive(self) -> None:
        """Create the stream if missing and push its expiry forward. Found missing after it
        existed, the stream was lost with any replies on their way to it: sweep at once, and
        at every keepalive after until one such sweep has succeeded (this one's XADD has made
        the stream again, so the loss would not be seen twice)."""
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
            self.events.position = self._events_id
        if lost:
            self.losses += 1
            log.warning(
                "the reply stream was gone (expired while Redis refused writes, evicted, or "
                "Redis restarted empty); recreated it, checking the waiting requests",
                stream=self.key,
                waiting=len(self.waiters),
            )
            self._last_id = "0-0"  # read everything on the new stream
        if self._swept < self.losses:
            await self.sweep(after_loss=True)

    async def sweep(self, *, after_loss: bool = False) -> None:
        """Answer waiters whose results are stored, and fail those Redis lost (see
        ``producer.losses``). ``after_loss``: a loss was found; once this sweep has judged
        every waiter, that loss counts as swept. Redis errors propagate."""
        losses = self.losses
        verdict = await sweep(self._commands, self.waiters, after_loss=after_loss, losses=losses)
        if after_loss:
            self._swept = max(self._swept, losses)
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
        """Read the reply stream and the job events: one loop, or one for each where one command
        may not read both (see the module docstring)."""
        streams = [self.key, *([self.job_events] if self.job_events else [])]
        await asyncio.gather(*(self._listen(group) for group in self._broker.colocated(streams)))

    async def _listen(self, group: list[str]) -> None:
        replies = self.key in group
        backoff = self._reads if replies else self._events
        reads = self._broker.blocking_reads(
            group[0], name=self._reader_name, block_ms=self._block_ms
        )
        self._connections.append(reads)
        unread_trimmed = 0
        last_trim = time.monotonic()
        reconnected = False
        while not cancelling():
            streams = self._positions(group)
            if not streams:
                # The first keepalive finds where job events start; until then nothing to read.
                await asyncio.sleep(EVENTS_START_POLL_S)
                continue
            # Trim what has been read, but only every TRIM_EVERY entries or TRIM_INTERVAL_S:
            # one XTRIM per read would be a Redis command per few requests for no benefit.
            trim = replies and (
                unread_trimmed >= TRIM_EVERY
                or (unread_trimmed > 0 and time.monotonic() - last_trim >= TRIM_INTERVAL_S)
            )
            try:
                if reconnected and replies:
                    # Redis may have come back empty: recreate the reply stream before anything
                    # is queued, or workers (writing with NOMKSTREAM) would drop replies.
                    await self.keepalive()
                reconnected = False
                before = [("XTRIM", self.key, "MINID", next_id(self._last_id))] if trim else []
                read = await reads.xread(
                    streams, count=self._count, block_ms=self._block_ms, before=before
                )
            except RETRYABLE as e:
                reconnected = True
                await recover(reads, e, backoff)
                continue
            backoff.succeeded()
            if trim:
                unread_trimmed, last_trim = 0, time.monotonic()
            for stream, entries in read:
                if text(stream) == self.job_events:
                    self._events_id = text(entries[-1][0])
                    self.events.publish(entries)
                    continue
                for entry_id, fields in entries:
                    self._last_id = text(entry_id)
                    unread_trimmed += 1
                    self._resolve(fields)

    def _positions(self, group: list[str]) -> dict[str, str]:
        """The streams of ``group`` to read now, each from where the listener stopped."""
        streams = {self.key: self._last_id} if self.key in group else {}
        if self.job_events in group and self._events_id is not None:
            streams[self.job_events] = self._events_id
        return streams

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
        """Close the read connections (the loops are stopped first)."""
        for reads in self._connections:
            await reads.aclose()
        self._connections.clear()

    def fail_all(self, error: Exception) -> None:
        """Fail every waiting request (the gateway is stopping)."""
        self.waiters.fail_all(error)

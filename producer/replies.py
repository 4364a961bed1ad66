"""Results come back to the gateway on one reply stream per gateway process.

Workers ``XADD`` each result to the stream named in the request; one listener task per gateway
reads it with a blocking ``XREAD`` on a dedicated connection and resolves the waiting request's
future. Waiting requests hold no Redis connection: 10,000 waiters cost 10,000 futures and one
connection. The listener remembers the last id it read, so after a reconnect it continues where
it stopped and no result is lost; it trims what it has read (``XTRIM MINID``, every thousand
entries or second, in the same round trip as a read). The stream carries a TTL that the gateway
refreshes; workers write with ``NOMKSTREAM``, so the stream of a gateway that died expires and is
not recreated.

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
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from protocol import ProtocolError
from protocol.messages import FIELD, InferResult
from runtime.aio import cancelling

log = structlog.get_logger("inferq.gateway")

_CONNECTION_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)
TRIM_EVERY = 1000
MAX_BACKOFF_S = 1.0
"""Reconnect attempts are cheap; retrying at least every second brings service back fast."""
TRIM_INTERVAL_S = 1.0


def _next_id(entry_id: str) -> str:
    ms, _, seq = entry_id.partition("-")
    return f"{ms}-{int(seq or 0) + 1}"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _expire(future: asyncio.Future[InferResult]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


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
    ) -> None:
        self._reader = reader
        self._commands = commands
        self.key = key
        self._block_ms = block_ms
        self._ttl_ms = int(ttl_s * 1000)
        self._count = count
        self._waiters: dict[str, asyncio.Future[InferResult]] = {}
        self._last_id = "$"
        self.job_events = job_events
        self.separate_job_events = separate_job_events
        """Read job events in ``run_job_events`` instead of with the replies (a cluster)."""
        self._events_id: str | None = None
        self._job_waiters: dict[str, set[asyncio.Future[None]]] = {}
        self.healthy = False

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def expect(self, request_id: str) -> asyncio.Future[InferResult]:
        """Register interest before enqueueing, so even an instant reply finds its waiter."""
        future: asyncio.Future[InferResult] = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = future
        return future

    async def wait(self, future: asyncio.Future[InferResult], timeout_s: float) -> InferResult:
        """The result, or TimeoutError after ``timeout_s``. One timer per request and no extra
        task, which is what ``asyncio.wait_for`` would cost on this hot path."""
        handle = asyncio.get_running_loop().call_later(max(0.0, timeout_s), _expire, future)
        try:
            return await future
        finally:
            handle.cancel()

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

    def forget(self, request_id: str) -> None:
        self._waiters.pop(request_id, None)

    async def keepalive(self) -> None:
        """Create the stream if missing and push its expiry forward."""
        pipe = self._commands.pipeline(transaction=False)
        pipe.xadd(self.key, {b"keepalive": b"1"})
        pipe.pexpire(self.key, self._ttl_ms)
        if self.job_events is not None and self._events_id is None:
            pipe.xrevrange(self.job_events, count=1)
        replies = await pipe.execute()
        if self._last_id == "$":
            self._last_id = _text(replies[0])
        if self.job_events is not None and self._events_id is None:
            self._events_id = _text(replies[2][0][0]) if replies[2] else "0-0"

    async def run_keepalive(self, interval_s: float) -> None:
        while not cancelling():
            await asyncio.sleep(interval_s)
            try:
                await self.keepalive()
            except _CONNECTION_ERRORS as e:
                log.warning("reply stream keepalive failed", error=str(e))

    async def run(self) -> None:
        backoff = 0.05
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
                pipe = self._reader.pipeline(transaction=False)
                if trim:
                    pipe.xtrim(self.key, minid=_next_id(self._last_id), approximate=False)
                streams = {self.key: self._last_id}
                if (
                    self.job_events is not None
                    and self._events_id is not None
                    and not self.separate_job_events
                ):
                    streams[self.job_events] = self._events_id
                pipe.xread(cast(Any, streams), count=self._count, block=self._block_ms)
                replies = await pipe.execute()
                self.healthy = True
                backoff = 0.05
            except _CONNECTION_ERRORS as e:
                self.healthy = False
                reconnected = True
                log.warning(
                    "reply listener lost Redis, reconnecting", error=str(e), backoff_s=backoff
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            if trim:
                unread_trimmed, last_trim = 0, time.monotonic()
            for stream, entries in replies[-1] or []:
                if _text(stream) == self.job_events:
                    self._events_id = _text(entries[-1][0])
                    for _, fields in entries:
                        self._job_changed(fields)
                    continue
                for entry_id, fields in entries:
                    self._last_id = _text(entry_id)
                    unread_trimmed += 1
                    self._resolve(fields)

    async def run_job_events(self) -> None:
        """Read the job events stream alone (on a cluster; see the module docstring)."""
        backoff = 0.05
        while not cancelling() and self.job_events is not None:
            if self._events_id is None:
                await asyncio.sleep(backoff)  # the first keepalive finds where to start
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            try:
                reply: Any = await self._reader.xread(
                    {self.job_events: self._events_id}, count=self._count, block=self._block_ms
                )
                backoff = 0.05
            except _CONNECTION_ERRORS as e:
                log.warning("job events listener lost Redis, retrying", error=str(e))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            for _, entries in reply or []:
                self._events_id = _text(entries[-1][0])
                for _, fields in entries:
                    self._job_changed(fields)

    def _job_changed(self, fields: dict[Any, Any]) -> None:
        job_id = fields.get(b"job")
        for future in self._job_waiters.pop(_text(job_id), ()) if job_id else ():
            if not future.done():
                future.set_result(None)

    def _resolve(self, fields: dict[Any, Any]) -> None:
        payload = fields.get(FIELD)
        if payload is None:
            return  # a keepalive entry
        try:
            result = InferResult.decode(payload)
        except ProtocolError as e:
            log.error("undecodable reply ignored", error=str(e))
            return
        future = self._waiters.pop(result.id, None)
        if future is not None and not future.done():
            future.set_result(result)

    def fail_all(self, error: Exception) -> None:
        for future in self._waiters.values():
            if not future.done():
                future.set_exception(error)
        self._waiters.clear()

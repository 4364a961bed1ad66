"""Automatic pipelining: commands issued in the same event-loop turn go to Redis together.

Thousands of concurrent requests each need one or two short commands (GET the cache, XADD the
request). Sent one by one they would each take a pooled connection and a round trip; here they
queue, and a flusher sends everything queued as one pipeline on one connection. While a pipeline
is in flight the next batch accumulates, so under load each round trip carries many commands,
and the number of round trips in flight is bounded by ``max_in_flight`` whatever the
concurrency. Each batch goes out as one ``Broker.batch``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from runtime.broker import Broker

_Queued = tuple[tuple[Any, ...], asyncio.Future[Any]]


class AutoPipeline:
    def __init__(self, broker: Broker, *, max_in_flight: int = 2, max_batch: int = 512) -> None:
        self.broker = broker
        self._queue: list[_Queued] = []
        self._slots = asyncio.Semaphore(max_in_flight)
        self._max_batch = max_batch
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.round_trips = 0

    async def execute(self, *args: Any) -> Any:
        """Queue one command and wait for its reply (an error reply raises)."""
        return await self.submit(*args)

    def submit(self, *args: Any) -> asyncio.Future[Any]:
        """Queue one command without waiting: its reply, or error, lands on the future. For
        writes nobody waits on (from a callback, or a task being cancelled)."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append((args, future))
        if not self._scheduled:
            self._schedule()
        return future

    def _schedule(self) -> None:
        self._scheduled = True
        task = asyncio.create_task(self._flush())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _flush(self) -> None:
        async with self._slots:
            # From here on, new commands schedule the next flush, which waits for a free slot
            # and so collects everything that arrives while this pipeline is in flight.
            self._scheduled = False
            batch = self._queue[: self._max_batch]
            del self._queue[: self._max_batch]
            if batch:
                await self._send(batch)
        if self._queue and not self._scheduled:
            self._schedule()

    async def _send(self, batch: list[_Queued]) -> None:
        try:
            self.round_trips += 1
            replies = await self.broker.batch([args for args, _ in batch])
        except BaseException as e:
            for _, future in batch:
                if not future.done():
                    future.set_exception(e if isinstance(e, Exception) else ConnectionError(str(e)))
            if not isinstance(e, Exception):
                raise
            return
        for (_, future), reply in zip(batch, replies, strict=True):
            if future.done():
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    async def close(self) -> None:
        """Cancel the batches in flight (the broker's owner closes the broker)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

"""Recovering work from workers that died, and protecting work from being recovered too early.

Every ``interval_s`` for each served stream:
- **Renew.** Entries this worker has held longer than a third of ``claim_idle_ms`` (a long batch,
  a slow model) are re-claimed by this worker with ``XCLAIM ... JUSTID``, which resets their
  idle time without counting a delivery, so no other worker takes them over while they run.
- **Reclaim.** Entries pending longer than ``claim_idle_ms`` (their worker died, or lost its
  read in a connection drop) are claimed with ``XCLAIM`` and queued here, as far as this
  worker has room. ``XCLAIM`` with a minimum idle time is atomic, so two workers reclaiming at
  once cannot both take an entry.
- **Poison.** An entry already delivered ``max_deliveries`` times (it keeps crashing workers)
  is not run again: it goes to the dead-letter stream with the reason, and its caller is answered
  with that reason instead of waiting for a deadline.

Duplicate executions are possible (a worker that was only slow, not dead); duplicate replies are
not: result keys are written only if absent and the gateway resolves each request once.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, cast

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from inferq.aio import cancelling
from protocol.keys import GROUP

if TYPE_CHECKING:
    from consumer.worker import Worker

log = structlog.get_logger("inferq.worker")


class Reclaimer:
    def __init__(
        self,
        redis: aioredis.Redis,
        worker: Worker,
        *,
        claim_idle_ms: int,
        max_deliveries: int,
        interval_s: float,
    ) -> None:
        self._redis = redis
        self._worker = worker
        self._claim_idle_ms = claim_idle_ms
        self._max_deliveries = max_deliveries
        self._interval_s = interval_s
        self.reclaimed = 0
        self.renewed = 0

    async def run(self) -> None:
        while not cancelling():
            await asyncio.sleep(self._interval_s)
            try:
                await self.tick()
            except (RedisError, OSError) as e:
                log.warning("reclaim pass failed", error=str(e))

    async def tick(self) -> None:
        await self.renew()
        for name, slot in self._worker.slots.items():
            for stream in slot.streams:
                room = self._worker.room(name)
                if room <= 0:
                    break
                await self.reclaim(stream, room)

    async def renew(self) -> None:
        threshold = time.monotonic() - self._claim_idle_ms / 3000
        stale: dict[str, list[bytes]] = {}
        for (stream, entry_id), read_at in list(self._worker.held_since().items()):
            if read_at < threshold:
                stale.setdefault(stream, []).append(entry_id)
        for stream, ids in stale.items():
            await self._redis.xclaim(
                stream, GROUP, self._worker.id, 0, cast(list[Any], ids), justid=True
            )
            self.renewed += len(ids)
            for entry_id in ids:
                if (stream, entry_id) in self._worker.held_since():
                    self._worker.held_since()[(stream, entry_id)] = time.monotonic()

    async def reclaim(self, stream: str, room: int) -> None:
        pending: list[dict[str, Any]] = await self._redis.xpending_range(
            stream, GROUP, min="-", max="+", count=room, idle=self._claim_idle_ms
        )
        held = self._worker.held_since()
        candidates = [p for p in pending if (stream, p["message_id"]) not in held]
        if not candidates:
            return
        deliveries = {p["message_id"]: int(p["times_delivered"]) for p in candidates}
        claimed = await self._redis.xclaim(
            stream,
            GROUP,
            self._worker.id,
            self._claim_idle_ms,
            [p["message_id"] for p in candidates],
        )
        if not claimed:
            return
        self.reclaimed += len(claimed)
        log.info(
            "reclaimed entries from an idle consumer",
            stream=stream,
            count=len(claimed),
            consumers=sorted({_text(p["consumer"]) for p in candidates}),
        )

        def poison(i: int) -> str | None:
            # XCLAIM just counted one more delivery on top of what XPENDING reported.
            times = deliveries.get(claimed[i][0], 0) + 1
            if times <= self._max_deliveries:
                return None
            return (
                f"the request was delivered {times - 1} times without completing (it may "
                "crash workers); it was moved to the dead-letter stream"
            )

        self._worker.accept(stream, claimed, poison=poison)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

"""Recovering a dead worker's entries, and keeping this worker's from being recovered too early.

Each pass renews what this worker has held past a third of ``claim_idle_ms`` (``XCLAIM JUSTID``)
and claims, as far as there is room, what has been pending elsewhere longer than
``claim_idle_ms``, handing it to the reader's intake with its delivery count (which
dead-letters an entry past ``max_deliveries``). Every ``HOUSEKEEPING_EVERY`` passes it trims each
stream with the writer's script (``consumer.trim``) and removes consumers of gone workers that
hold nothing. A Redis error ends a pass, never the loop. Why: ARCHITECTURE.md, "Recovery".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Protocol, cast

import structlog
from redis.exceptions import ResponseError

from consumer.context import WorkerContext
from consumer.trim import TRIM_SCRIPT
from protocol.keys import GROUP, Lane, text
from runtime.aio import cancelling
from runtime.broker import Broker
from runtime.faults import RETRYABLE, Fault, classify
from runtime.stats import read_snapshot

log = structlog.get_logger("inferq.worker")

HOUSEKEEPING_EVERY = 20
MIN_INTERVAL_S = 0.05
"""A pass runs every quarter of ``claim_idle_ms``, but not more often than this."""
_LANES = {lane.value for lane in Lane}


class Intake(Protocol):
    """Where reclaimed entries go: the worker's reader (see ``consumer.reader``)."""

    def room(self, model: str) -> int: ...

    def accept(
        self,
        stream: str,
        entries: list[Any],
        *,
        deliveries: Callable[[int], int] | None = None,
    ) -> None: ...


class Reclaimer:
    def __init__(self, context: WorkerContext, broker: Broker, intake: Intake) -> None:
        s = context.settings
        self._redis = broker.commands
        self._consumer = context.worker_id
        self._keys = context.keys
        self._slots = context.slots
        self._ledger = context.ledger
        self._intake = intake
        self._now_ms = context.clock.now_ms
        self._metrics = context.metrics
        self._max_deliveries = s.max_deliveries
        self._claim_idle_ms = s.claim_idle_ms
        self._interval_s = max(MIN_INTERVAL_S, s.claim_idle_ms / 1000 / 4)
        self._backoff = context.loops.backoff("reclaimer", critical=False)
        self._trim = broker.script(TRIM_SCRIPT)
        self.reclaimed = 0
        self.renewed = 0
        self._ticks = 0

    async def run(self) -> None:
        while not cancelling():
            await asyncio.sleep(self._interval_s)
            try:
                await self.tick()
            except RETRYABLE as e:
                await self._backoff.failed(e)
                continue
            self._backoff.succeeded()

    async def tick(self) -> None:
        self._ticks += 1
        if self._ticks % HOUSEKEEPING_EVERY == 0:
            for streams in self._slots.streams().values():
                for stream in streams:
                    await self.trim(stream)
                    await self.prune(stream)
        await self.renew()
        quiet = await self._quiet_streams()
        for name, streams in self._slots.streams().items():
            for stream in streams:
                room = self._intake.room(name)
                if room <= 0:
                    break
                if stream not in quiet:
                    await self.reclaim(stream, room)

    async def _quiet_streams(self) -> set[str]:
        """Streams the published backlog snapshot (``runtime.stats``) shows with nothing
        pending. Nothing there can have been idle ``claim_idle_ms`` yet if the snapshot is
        younger than that, so they need no XPENDING: at idle the reclaimer then costs one GET a
        pass instead of one command per stream. Without a fresh snapshot, every stream is
        looked at."""
        snapshot = await read_snapshot(self._redis, self._keys)
        if snapshot is None or not snapshot.fresh(self._now_ms(), self._claim_idle_ms // 2):
            return set()
        return {
            self._keys.stream(row.model, Lane(row.lane), row.partition)
            for row in snapshot.lanes
            if row.pending == 0 and row.lane in _LANES
        }

    async def renew(self) -> None:
        stale = self._ledger.idle_since(time.monotonic() - self._claim_idle_ms / 3000)
        for stream, ids in stale.items():
            await self._redis.xclaim(
                stream, GROUP, self._consumer, 0, cast(list[Any], ids), justid=True
            )
            self.renewed += len(ids)
            self._ledger.renewed(stream, ids)

    async def reclaim(self, stream: str, room: int) -> None:
        try:
            pending: list[dict[str, Any]] = await self._redis.xpending_range(
                stream, GROUP, min="-", max="+", count=room, idle=self._claim_idle_ms
            )
        except ResponseError as e:
            if classify(e) is Fault.MISSING:
                return  # no stream or group (yet, or any more): nothing pending there
            raise
        candidates = [p for p in pending if (stream, p["message_id"]) not in self._ledger]
        # Entries a worker died holding after they had been reclaimed once may include what
        # kills workers: take those one per pass, so a poison among them takes no other request
        # with it to the next crash (and on towards --max-deliveries).
        again = [p for p in candidates if int(p["times_delivered"]) >= 2]
        candidates = [p for p in candidates if int(p["times_delivered"]) < 2] + again[:1]
        if not candidates:
            return
        deliveries = {p["message_id"]: int(p["times_delivered"]) for p in candidates}
        claimed = await self._redis.xclaim(
            stream,
            GROUP,
            self._consumer,
            self._claim_idle_ms,
            [p["message_id"] for p in candidates],
        )
        if not claimed:
            return
        self.reclaimed += len(claimed)
        parsed = self._keys.parse_stream(stream)
        model = parsed[0] if parsed else ""
        self._metrics.observe_reclaimed(model, len(claimed))
        limit = self._max_deliveries
        retried = sum(1 for entry in claimed if deliveries.get(entry[0], 0) + 1 <= limit)
        if retried:
            self._metrics.observe_retry(model, retried)
        log.info(
            "reclaimed entries from an idle consumer",
            stream=stream,
            count=len(claimed),
            consumers=sorted({text(p["consumer"]) for p in candidates}),
        )

        def times(i: int) -> int:
            # XCLAIM just counted one more delivery on top of what XPENDING reported.
            return deliveries.get(claimed[i][0], 0) + 1

        self._intake.accept(stream, claimed, deliveries=times)

    async def trim(self, stream: str) -> None:
        """The writer's trim (``consumer.trim``): below the oldest entry pending, never past the
        last delivered; nothing when there is no stream or group."""
        await self._trim(keys=[stream], args=[GROUP])

    async def prune(self, stream: str) -> None:
        try:
            consumers = await self._redis.xinfo_consumers(stream, GROUP)
        except ResponseError:
            return
        live = await self._redis.zrangebyscore(self._keys.workers, self._now_ms(), "+inf")
        alive = {text(w) for w in cast(list[bytes], live)} | {self._consumer}
        for c in consumers:
            name = text(c["name"])
            if name in alive or c["pending"] or c["idle"] < 10 * self._claim_idle_ms:
                continue
            await self._redis.xgroup_delconsumer(stream, GROUP, name)
            log.info("removed a gone worker's consumer", stream=stream, consumer=name)

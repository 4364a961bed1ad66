"""The worker's reader: one ``XREADGROUP`` over every stream of every served model, and the
intake that turns what it reads (or what the reclaimer claims) into queued deliveries.

Reads are aimed at batching: the reader asks each model's streams for just enough entries to fill
its next batch, keeps reading while the model runs (the next batch forms meanwhile), stops
reading a model whose next batch is full, and wakes from a blocking read with ``CLIENT UNBLOCK``
when a model that was full wants more.

A Redis error never ends the reader. A vanished stream or consumer group (Redis evicted the
stream, or restarted empty; Redis answers ``UNBLOCKED the stream key no longer exists`` or
``NOGROUP``) is created again and reading carries on; anything else is retried with backoff,
after which the reader pages through its own pending list again in case a read's reply was lost.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, cast

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ResponseError

from consumer.batcher import Queued
from consumer.ledger import Ledger
from consumer.metrics import WorkerMetrics
from consumer.model import batch_group, rows_of
from consumer.outgoing import Outcomes, Outgoing
from consumer.slots import Delivery, ModelSlot, ModelSlots
from consumer.stats import WorkerStats
from protocol import ProtocolError
from protocol.deadline import local_deadline
from protocol.keys import GROUP, LANES_BY_PRIORITY, Keys, text
from protocol.messages import FIELD, InferRequest
from runtime.aio import cancelling
from runtime.connections import RedisClock
from runtime.faults import RETRYABLE, Fault, classify
from runtime.loops import Loops

log = structlog.get_logger("inferq.worker")


class Reader:
    def __init__(
        self,
        *,
        consumer: str,
        redis: aioredis.Redis,
        blocking: aioredis.Redis,
        keys: Keys,
        slots: ModelSlots,
        ledger: Ledger,
        outcomes: Outcomes,
        put: Callable[[list[Outgoing]], None],
        clock: RedisClock,
        metrics: WorkerMetrics,
        stats: WorkerStats,
        loops: Loops,
        block_ms: int,
        max_deliveries: int,
    ) -> None:
        self._consumer = consumer
        self._redis = redis
        self._blocking = blocking
        self._keys = keys
        self._slots = slots
        self._ledger = ledger
        self._outcomes = outcomes
        self._put = put
        self._clock = clock
        self._metrics = metrics
        self._stats = stats
        self._loops = loops
        self._backoff = loops.backoff("reader")
        self._block_ms = block_ms
        self._max_deliveries = max_deliveries
        self._wake = asyncio.Event()
        self._blocking_on: frozenset[str] | None = None
        self._client_id: int | None = None
        self._missing = False
        self.draining = False
        """Set on shutdown: take nothing more."""

    # -- groups ------------------------------------------------------------------------------

    async def ensure_groups(self) -> None:
        """Create every served stream and its consumer group where missing."""
        for slot in self._slots.values():
            for stream in slot.streams:
                try:
                    # From id 0: requests queued before any worker existed are served too.
                    await self._redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
                except ResponseError as e:
                    if "BUSYGROUP" not in str(e):
                        raise

    # -- reading -----------------------------------------------------------------------------

    def room(self, model: str) -> int:
        """How many more entries this worker should take on for the model right now."""
        slot = self._slots.get(model)
        return 0 if slot is None or self.draining else slot.wanted_count()

    def wake(self) -> None:
        """A model's wants changed: make sure the reader is not blocked on the old ones."""
        self._wake.set()
        if self._blocking_on is None or self._client_id is None:
            return
        streams, _, _ = self._wanted()
        if not set(streams) <= self._blocking_on:
            self._blocking_on = None
            self._loops.spawn_once("unblock", self._unblock(self._client_id))

    async def _unblock(self, client_id: int) -> None:
        try:
            await self._redis.client_unblock(client_id)
        except RETRYABLE as e:
            log.debug("could not unblock the reader", error=str(e))

    async def run(self) -> None:
        while not cancelling():
            streams, count, block = self._wanted()
            if not streams:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                reply = await self._read(streams, count, block)
            except RETRYABLE as e:
                await self._read_failed(e)
                continue
            finally:
                self._blocking_on = None
            self._backoff.succeeded()
            self._deliver(reply or [], streams, count)

    async def _read(self, streams: dict[str, str], count: int, block: bool) -> Any:
        if self._missing:
            await self.ensure_groups()
            self._missing = False
        if self._client_id is None:
            self._client_id = int(await self._blocking.client_id())
        if block:
            self._blocking_on = frozenset(streams)
            for slot in self._slots.values():
                if slot.streams[0] in streams:
                    slot.drained = True
        return await self._blocking.xreadgroup(
            GROUP,
            self._consumer,
            cast(Any, streams),
            count=count,
            block=self._block_ms if block else None,
        )

    async def _read_failed(self, error: BaseException) -> None:
        # Redis may have delivered entries whose reply never reached us: they sit in this
        # consumer's pending list. Read that list again (skipping what we hold).
        for slot in self._slots.values():
            slot.reread_pending()
        if classify(error) is Fault.MISSING:
            if not self._missing:
                log.warning(
                    "a request stream or the consumer group is gone (evicted, deleted, or Redis "
                    "restarted empty); creating it again",
                    error=str(error),
                )
                self._stats.recreated += 1
            self._missing = True
            if self._backoff.healthy:
                self._backoff.record(error)
                return  # the first failure of a run: recreate at once, then back off
        else:
            self._client_id = None
        await self._backoff.failed(error)

    def _wanted(self) -> tuple[dict[str, str], int, bool]:
        """Streams to read (with ids), entries per stream, and whether to block."""
        streams: dict[str, str] = {}
        count = 0
        prompt = False
        for slot in self._slots.values():
            wanted = {s: slot.wanted_count(lane) for s, lane in slot.lane_of.items()}
            included = [s for s, n in wanted.items() if n > 0]
            if not included:
                slot.drained = False  # not read: what is queued in Redis is unknown
                continue
            streams.update({s: slot.read_ids[s] for s in included})
            count = max(count, *(wanted[s] for s in included))
            prompt = prompt or slot.needs_prompt_read() or slot.reading_backlog()
        return streams, count, not prompt

    def _deliver(self, reply: list[Any], asked: dict[str, str], count: int) -> None:
        got: dict[str, int] = {}
        last_ids: dict[str, str] = {}
        for raw_stream, entries in reply:
            stream = text(raw_stream)
            got[stream] = len(entries)
            if entries and asked.get(stream, ">") != ">":
                last_ids[stream] = text(entries[-1][0])
            self.accept(stream, entries)
        for slot in self._slots.values():
            if slot.streams[0] not in asked:
                continue
            for stream in slot.streams:
                if stream in asked and asked[stream] != ">":
                    # Reading our own pending list: page through it, then switch to new entries.
                    done = got.get(stream, 0) < count
                    slot.read_ids[stream] = ">" if done else last_ids.get(stream, ">")
            slot.drained = all(s in asked and got.get(s, 0) < count for s in slot.streams)
            if slot.drained:
                slot.changed.set()

    # -- intake ------------------------------------------------------------------------------

    def accept(
        self,
        stream: str,
        entries: list[Any],
        *,
        deliveries: Callable[[int], int] | None = None,
    ) -> None:
        """Queue entries read from (or claimed on) a stream for their model's next batches.

        ``deliveries(i)``, when given (reclaimed entries), is how often entry ``i`` has been
        delivered. Past ``max_deliveries`` it is not run again: it is dead-lettered and its
        caller answered with the reason. An entry delivered more than once runs in a batch of its
        own, so if it is what crashes workers it takes no other request down with it.
        """
        slot = self._slots.slot_of(stream, self._keys)
        if slot is None:
            return
        now, now_ms = time.monotonic(), self._clock.now_ms()
        out: list[Outgoing] = []
        for i, (entry_id, fields) in enumerate(entries):
            if not self._ledger.take(stream, entry_id):
                continue  # re-read from our pending list while we still hold it
            if fields is None:
                # Deleted while pending (a pending-list read reports it): nothing to run.
                out.append(self._outcomes.nothing(stream, entry_id))
                continue
            request = self._decode(slot, stream, entry_id, fields, out)
            if request is None:
                continue
            delivery = Delivery(stream, entry_id, request, now_ms, now)
            times = deliveries(i) if deliveries is not None else 1
            if times > self._max_deliveries:
                out.append(self._poisoned(slot, delivery, times, fields.get(FIELD, b"")))
                continue
            self._queue(slot, delivery, times)
        slot.changed.set()
        if out:
            self._put(out)

    def _decode(
        self,
        slot: ModelSlot,
        stream: str,
        entry_id: bytes,
        fields: dict[bytes, bytes],
        out: list[Outgoing],
    ) -> InferRequest | None:
        """The entry's request, or None after routing an undecodable one to dead letters."""
        payload = fields.get(FIELD)
        try:
            if payload is None:
                raise ProtocolError(f"stream entry has no '{FIELD.decode()}' field")
            return InferRequest.decode(payload)
        except ProtocolError as e:
            log.error(
                "undecodable request moved to dead letters",
                stream=stream,
                entry=entry_id,
                error=str(e),
            )
            self._stats.dead_lettered += 1
            self._metrics.observe_dead_letter(slot.model.name, "undecodable")
            out.append(self._outcomes.undecodable(stream, entry_id, str(e), payload or b""))
            return None

    def _poisoned(self, slot: ModelSlot, d: Delivery, times: int, raw: bytes) -> Outgoing:
        reason = (
            f"the request was delivered {times - 1} times without completing (it may crash "
            "workers); it was moved to the dead-letter stream"
        )
        r = d.request
        log.error(
            "request moved to dead letters",
            stream=d.stream,
            entry=d.entry_id,
            request_id=r.id,
            model=r.model,
            reason=reason,
            traceparent=r.traceparent,
        )
        self._stats.dead_lettered += 1
        self._metrics.observe_dead_letter(slot.model.name, "poison")
        return self._outcomes.poisoned(d, reason, raw)

    def _queue(self, slot: ModelSlot, d: Delivery, times: int) -> None:
        lane = slot.lane_of[d.stream]
        r = d.request
        self._metrics.observe_dequeued(
            slot.model.name, LANES_BY_PRIORITY[lane].value, (d.read_ms - r.enqueued_ms) / 1000
        )
        slot.idle.clear()
        slot.queue.push(
            Queued(
                d,
                lane=lane,
                rows=rows_of(r),
                group=batch_group(r) if times == 1 else ("suspect", d.stream, d.entry_id),
                arrived=d.read_at,
                deadline=local_deadline(r.deadline_ms, d.read_ms, d.read_at),
            )
        )

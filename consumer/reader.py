"""The worker's reader: ``XREADGROUP`` for just enough entries to fill each model's next batch
(one read per ``ReadGroup``), and the intake that queues what it reads, or what the reclaimer
claims, as deliveries.

A Redis error never ends it: a vanished stream or consumer group is created again; anything else
is retried with backoff, after which the reader pages through its own pending list again in case
a read's reply was lost. Why reads are shaped so: ARCHITECTURE.md, "Reading for batches".
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ResponseError

from consumer.batcher import Queued
from consumer.context import WorkerContext
from consumer.model import batch_group, rows_of
from consumer.outgoing import Outgoing
from consumer.slots import Delivery, ModelSlot
from protocol import ProtocolError
from protocol.deadline import local_deadline
from protocol.keys import GROUP, LANES_BY_PRIORITY, text
from protocol.messages import FIELD, InferRequest
from runtime.aio import cancelling
from runtime.backoff import Backoff
from runtime.faults import RETRYABLE, Fault, classify
from runtime.readconn import BlockingReads, recover

log = structlog.get_logger("inferq.worker")


@dataclass(eq=False)
class ReadGroup:
    """Request streams that one ``XREADGROUP`` may read together (``Broker.colocated``), and its
    blocking connection.

    On one Redis that is every stream of every served model: one loop and one blocking
    connection, however many models. On a Redis Cluster a command may only name keys of one
    slot, so there is one group per slot (a model partition's three lanes share a hash tag),
    each with its own loop and a connection to the master that owns the slot. Redis cannot block
    on keys of several slots in one command, so a node that holds several of a worker's
    partitions gets one blocking connection per partition from it; connections grow with
    partitions served, never with requests.
    """

    name: str
    streams: frozenset[str]
    reads: BlockingReads
    backoff: Backoff
    blocking_on: frozenset[str] | None = None
    missing: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    read_done: asyncio.Event = field(default_factory=asyncio.Event)
    """Clear while a read is in flight (``Reader.finish`` waits for it)."""

    def __post_init__(self) -> None:
        self.read_done.set()


class Reader:
    def __init__(
        self, context: WorkerContext, redis: aioredis.Redis, groups: list[ReadGroup]
    ) -> None:
        self._ctx = context
        self._redis = redis
        self.groups = groups
        self._slots = context.slots
        self._consumer = context.worker_id
        self._block_ms = context.settings.block_ms
        self.draining = False
        """Set on shutdown: take nothing more."""
        self._finishing = False

    # -- groups ------------------------------------------------------------------------------

    async def ensure_groups(self, streams: list[str] | None = None) -> None:
        """Create every served stream (or just ``streams``) and its consumer group where
        missing."""
        wanted = streams or [s for slot in self._slots.values() for s in slot.streams]
        for stream in wanted:
            try:
                # From id 0: requests queued before any worker existed are served too.
                await self._redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    def extend(self, group: ReadGroup, streams: list[str]) -> None:
        """A model loaded while running: ``group`` reads its ``streams`` too from its next read
        on (a read blocked without them is woken by ``wake``)."""
        group.streams = group.streams | frozenset(streams)
        self.wake()

    async def release(self, streams: Collection[str], timeout_s: float) -> None:
        """A model being unloaded (its slot asks for nothing more): once no read in flight
        names ``streams`` (a blocked one is woken, and what it returns is queued as usual), the
        groups stop covering them. Up to ``timeout_s``."""
        gone = frozenset(streams)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            busy = [
                g
                for g in self.groups
                if not g.read_done.is_set()
                and g.streams & gone
                and (g.blocking_on is None or g.blocking_on & gone)
            ]
            if not busy:
                break
            for group in busy:
                if group.blocking_on is not None and group.blocking_on & gone:
                    await self._unblock(group)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(busy[0].read_done.wait(), 0.05)
        for group in self.groups:
            group.streams = group.streams - gone

    # -- reading -----------------------------------------------------------------------------

    def room(self, model: str) -> int:
        """How many more entries this worker should take on for the model right now."""
        slot = self._slots.get(model)
        return 0 if slot is None or self.draining else slot.wanted_count()

    def wake(self) -> None:
        """A model's wants changed: make sure no group's read is blocked on the old ones."""
        for group in self.groups:
            group.wake.set()
            if group.blocking_on is None:
                continue
            streams, _, _ = self._wanted(group)
            if not set(streams) <= group.blocking_on:
                group.blocking_on = None
                self._ctx.loops.spawn_once("unblock", self._unblock(group))

    async def _unblock(self, group: ReadGroup) -> None:
        try:
            await group.reads.unblock()
        except RETRYABLE as e:
            log.debug("could not unblock the reader", error=str(e))

    async def run(self) -> None:
        """Read every group, each in its own loop (one on one Redis)."""
        await asyncio.gather(*(self.run_group(group) for group in self.groups))

    async def run_group(self, group: ReadGroup) -> None:
        """One group's read loop (``run`` starts those of the groups known at start; a group
        added for a model loaded later gets its loop from the worker)."""
        while not cancelling():
            streams, count, block = self._wanted(group)
            if not streams:
                group.wake.clear()
                await group.wake.wait()
                continue
            group.read_done.clear()
            try:
                try:
                    reply = await self._read(group, streams, count, block)
                except RETRYABLE as e:
                    await self._read_failed(group, e)
                    continue
                finally:
                    group.blocking_on = None
                group.backoff.succeeded()
                self._deliver(group, reply or [], streams, count)
            finally:
                group.read_done.set()

    async def finish(self, timeout_s: float) -> None:
        """Stop reading without dropping a read in flight. Redis serves a blocked XREADGROUP
        the moment an entry arrives, so entries may already be this consumer's when the worker
        decides to stop: cancelling the read would leave them for another worker's
        ``claim_idle_ms`` and their callers to their deadlines. So a blocked read is woken
        (``CLIENT UNBLOCK``) and what it returns is queued like any read; then no read starts
        again (the reader waits to be cancelled)."""
        self._finishing = True
        self.draining = True
        for group in self.groups:
            group.wake.set()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            busy = [g for g in self.groups if not g.read_done.is_set()]
            if not busy:
                return
            for group in busy:
                if group.blocking_on is not None:
                    await self._unblock(group)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(busy[0].read_done.wait(), 0.05)

    async def _read(
        self, group: ReadGroup, streams: dict[str, str], count: int, block: bool
    ) -> Any:
        if group.missing:
            await self.ensure_groups()
            group.missing = False
        if block:
            group.blocking_on = frozenset(streams)
            for slot in self._slots.values():
                if any(s in streams for s in slot.streams):
                    slot.read_blocking(group.name)
        return await group.reads.xreadgroup(
            GROUP, self._consumer, streams, count=count, block_ms=self._block_ms if block else None
        )

    async def _read_failed(self, group: ReadGroup, error: BaseException) -> None:
        # Redis may have delivered entries whose reply never reached us: they sit in this
        # consumer's pending list. Read that list again (skipping what we hold).
        for slot in self._slots.values():
            slot.reread_pending(group.streams)
        fault = classify(error)
        if fault is Fault.MISSING:
            if not group.missing:
                log.warning(
                    "a request stream or the consumer group is gone (evicted, deleted, or Redis "
                    "restarted empty); creating it again",
                    error=str(error),
                )
                self._ctx.stats.recreated += 1
            group.missing = True
            if group.backoff.healthy:
                group.backoff.record(error)
                return  # the first failure of a run: recreate at once, then back off
            await group.backoff.failed(error)
            return
        await recover(group.reads, error, group.backoff)

    def _wanted(self, group: ReadGroup) -> tuple[dict[str, str], int, bool]:
        """The group's streams to read (with ids), entries per stream, and whether to block."""
        streams: dict[str, str] = {}
        if self._finishing:
            return streams, 0, False
        count = 0
        prompt = False
        for slot in self._slots.values():
            mine = [s for s in slot.streams if s in group.streams]
            if not mine:
                continue
            wanted = {s: slot.wanted_count(slot.lane_of[s]) for s in mine}
            included = [s for s, n in wanted.items() if n > 0]
            if not included:
                slot.read_skipped(group.name)
                continue
            streams.update({s: slot.read_id(s) for s in included})
            count = max(count, *(wanted[s] for s in included))
            prompt = prompt or slot.needs_prompt_read() or slot.reading_backlog()
        return streams, count, not prompt

    def _deliver(
        self, group: ReadGroup, reply: list[Any], asked: dict[str, str], count: int
    ) -> None:
        got: dict[str, int] = {}
        last_ids: dict[str, str] = {}
        for raw_stream, entries in reply:
            stream = text(raw_stream)
            got[stream] = len(entries)
            if entries and asked.get(stream, ">") != ">":
                last_ids[stream] = text(entries[-1][0])
            self.accept(stream, entries)
        for slot in self._slots.values():
            mine = [s for s in slot.streams if s in group.streams]
            if not any(s in asked for s in mine):
                continue
            for stream in mine:
                if stream in asked and asked[stream] != ">":
                    # Reading our own pending list: page through it, then switch to new entries.
                    done = got.get(stream, 0) < count
                    slot.paged(stream, None if done else last_ids.get(stream))
            drained = all(s in asked and got.get(s, 0) < count for s in mine)
            slot.read_returned(group.name, drained=drained)

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
        ctx = self._ctx
        slot = self._slots.slot_of(stream, ctx.keys)
        if slot is None:
            return
        now, now_ms = time.monotonic(), ctx.clock.now_ms()
        ledger, max_deliveries = ctx.ledger, ctx.settings.max_deliveries
        out: list[Outgoing] = []
        lane = slot.lane_of[stream]
        queue_waits: list[float] = []
        for i, (entry_id, fields) in enumerate(entries):
            if not ledger.take(stream, entry_id):
                continue  # re-read from our pending list while we still hold it
            if fields is None:
                # Deleted while pending (a pending-list read reports it): nothing to run.
                out.append(ctx.outcomes.nothing(stream, entry_id))
                continue
            request = self._decode(slot, stream, entry_id, fields, out)
            if request is None:
                continue
            delivery = Delivery(stream, entry_id, request, now_ms, now)
            times = deliveries(i) if deliveries is not None else 1
            if times > max_deliveries:
                out.append(self._poisoned(slot, delivery, times, fields.get(FIELD, b"")))
                continue
            queue_waits.append((now_ms - request.enqueued_ms) / 1000)
            self._queue(slot, delivery, lane, times)
        if queue_waits:
            ctx.metrics.observe_dequeued_many(
                slot.model.name, LANES_BY_PRIORITY[lane].value, queue_waits
            )
        slot.notify()
        if out:
            ctx.put(out)

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
            self._ctx.stats.dead_lettered += 1
            self._ctx.metrics.observe_dead_letter(slot.model.name, "undecodable")
            out.append(self._ctx.outcomes.undecodable(stream, entry_id, str(e), payload or b""))
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
        self._ctx.stats.dead_lettered += 1
        self._ctx.metrics.observe_dead_letter(slot.model.name, "poison")
        return self._ctx.outcomes.poisoned(d, reason, raw)

    def _queue(self, slot: ModelSlot, d: Delivery, lane: int, times: int) -> None:
        r = d.request
        slot.enqueue(
            Queued(
                d,
                lane=lane,
                rows=rows_of(r),
                group=batch_group(r) if times == 1 else ("suspect", d.stream, d.entry_id),
                arrived=d.read_at,
                deadline=local_deadline(r.deadline_ms, d.read_ms, d.read_at),
            )
        )

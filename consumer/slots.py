"""The models a worker serves: each with its batch queue, batch policy and read position.

``ModelSlots`` is the worker's registry of served models; the reader, the dispatchers and the
reclaimer look models up there. A ``ModelSlot``'s state is shared by the reader, its dispatcher,
model control and the worker, so, like the ledger's held entries, it changes only through the
slot's methods, one per transition, never by a part writing its fields.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from consumer.batcher import BatchPolicy, BatchQueue, Queued
from consumer.inline import InlineCalls
from consumer.model import ServedModel, Waited
from consumer.repository import ModelConfig
from protocol.keys import LANES_BY_PRIORITY, Keys, Lane
from protocol.messages import InferRequest

BACKGROUND_BATCH_DIVISOR = 8
"""While synchronous traffic is about, a background (job) batch is at most this fraction of
``max_batch``."""
FOREGROUND_QUIET_S = 1.0
"""With no synchronous request queued for this long, background batches are full size: nothing
is there to wait behind them, and a batch's lines then run ``max_batch`` rows a call."""


@dataclass(slots=True)
class Delivery:
    """A request read from a stream, not yet answered."""

    stream: str
    entry_id: bytes
    request: InferRequest
    read_ms: int
    """When it was read, on the Redis clock."""
    read_at: float
    """When it was read, monotonic."""

    @property
    def entry(self) -> tuple[str, bytes]:
        return self.stream, self.entry_id

    def waited(self, started: float) -> Waited:
        """Its time before a model call that began at ``started`` (monotonic): queued (enqueue
        to read, across processes on the Redis clock), then waiting for its batch."""
        queued_ms = max(0.0, float(self.read_ms - self.request.enqueued_ms))
        return queued_ms, max(0.0, (started - self.read_at) * 1000)


class ModelSlot:
    """A served model with its batch queue and policy, and what the reader knows of its streams.

    Its state changes only through the methods below, each one transition: the reader queues
    deliveries and records what its reads found, the dispatcher waits for news, takes batches
    and learns how long calls take, model control installs new versions, and the worker drains
    and closes it.
    """

    def __init__(self, model: ServedModel, keys: Keys) -> None:
        self.model = model
        self.streams = keys.all_streams(model.name, model.config.partitions)
        """Every partition's lanes, each partition highest lane first."""
        lanes = len(LANES_BY_PRIORITY)
        self.lane_of = {s: i % lanes for i, s in enumerate(self.streams)}
        self._background = LANES_BY_PRIORITY.index(Lane.LOW)
        self._queue: BatchQueue[Delivery] = BatchQueue(
            lanes=len(LANES_BY_PRIORITY), background_from=self._background
        )
        self.policy = BatchPolicy(model.max_batch, model.flush_s)
        self._read_ids = dict.fromkeys(self.streams, "0")
        """'0' first: drain entries this consumer already holds from an earlier life."""
        self._drained_in: dict[str, bool] = {}
        """Per read group reading some of these streams (``consumer.reader.ReadGroup``):
        whether its last read found them drained. One group on one Redis; one per partition on
        a cluster."""
        self._busy = False
        self._changed = asyncio.Event()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"model-{model.name}")
        self.service_s = 0.0
        """Moving average of recent model-call durations."""
        self._inline = InlineCalls()
        """Which batches are quick enough to run on the event loop instead of ``executor``."""
        self._idle = asyncio.Event()
        """Set while nothing is queued or running: what a drain waits for."""
        self._idle.set()
        self.used_at = time.monotonic()
        """When a request for it was last queued (monotonic; its load until then): what
        unloading the least recently used model goes by."""
        self._foreground_at = -FOREGROUND_QUIET_S
        """When (monotonic) a delivery of a synchronous lane was last queued."""
        self._closing = False

    # -- what the reader asks and records ------------------------------------------------------

    def wanted_count(self, lane: int | None = None) -> int:
        """Entries to ask for: enough to fill the next batch. Per lane, only what is queued in
        that lane and above counts, so a worker full of background jobs still reads the
        synchronous lanes."""
        if self._closing:
            return 0
        q = self._queue
        rows = q.rows if lane is None else q.rows_through(lane)
        return max(0, self.model.max_batch - rows)

    def read_id(self, stream: str) -> str:
        """Where the next read of ``stream`` starts: '>' (new entries), or a position in this
        consumer's pending list."""
        return self._read_ids[stream]

    def reading_backlog(self) -> bool:
        """Still paging through entries delivered to this consumer earlier (its pending list)."""
        return any(i != ">" for i in self._read_ids.values())

    def needs_prompt_read(self) -> bool:
        """Idle with a partial batch and more possibly queued: read without blocking."""
        return not self._busy and len(self._queue) > 0 and not self.drained

    @property
    def drained(self) -> bool:
        """Nothing more queued in Redis, as far as the last read of every group knows."""
        return bool(self._drained_in) and all(self._drained_in.values())

    def enqueue(self, queued: Queued[Delivery]) -> None:
        """Queue a delivery for a batch (read, claimed, or a job put back)."""
        self._idle.clear()
        self.used_at = time.monotonic()
        if queued.lane < self._background:
            self._foreground_at = self.used_at
        self._queue.push(queued)

    def read_blocking(self, group: str) -> None:
        """``group`` starts a blocking read of these streams: it returns as soon as an entry
        arrives, so until then nothing more is queued."""
        self._drained_in[group] = True

    def read_skipped(self, group: str) -> None:
        """``group`` reads without these streams (their next batch is full): what is queued
        there is unknown."""
        self._drained_in[group] = False

    def read_returned(self, group: str, *, drained: bool) -> None:
        """``group``'s read returned; ``drained``: it found fewer entries than it asked for on
        every one of these streams. A drained read wakes the dispatcher, so a partial batch
        does not wait out its window for entries that are not there."""
        self._drained_in[group] = drained
        if drained:
            self._changed.set()

    def paged(self, stream: str, last_id: str | None) -> None:
        """A read of this consumer's pending list on ``stream`` returned entries up to
        ``last_id``: the next read pages on from there; None: the list is read through, so read
        new entries from now on."""
        self._read_ids[stream] = ">" if last_id is None else last_id

    def reread_pending(self, streams: Collection[str] | None = None) -> None:
        """Read this consumer's pending list again from the start (on ``streams``, by default
        all): after a lost read reply (entries delivered whose reply never arrived) or a stream
        recreated empty."""
        for stream in self.streams:
            if streams is None or stream in streams:
                self._read_ids[stream] = "0"

    def notify(self) -> None:
        """Wake the dispatcher: what its next decision depends on changed (entries queued, new
        batching, the worker draining)."""
        self._changed.set()

    # -- what the dispatcher asks and records ----------------------------------------------------

    def between_batches(self, now: float, *, draining: bool) -> float | None:
        """Between two batches (nothing runs): how long before the next one runs, as the batch
        policy says (``BatchPolicy.wait_s``). With nothing queued the slot is idle, which is
        what a drain waits for."""
        q = self._queue
        if len(q):
            self._idle.clear()
        else:
            self._idle.set()
        return self.policy.wait_s(
            q, now, drained=self.drained or draining, service_s=self.service_s
        )

    async def wait_for_news(self, timeout_s: float | None) -> None:
        """Until ``notify`` (or a drained read), at most ``timeout_s`` (None: no limit)."""
        changed = self._changed
        changed.clear()
        if timeout_s is None:
            await changed.wait()
            return
        # The window's end is news as well: one loop timer that sets the event. No task per
        # wait (unlike wait_for), and no Timeout object cancelling this task when it fires.
        timer = asyncio.get_running_loop().call_later(timeout_s, changed.set)
        try:
            await changed.wait()
        finally:
            timer.cancel()

    def drop_expired(self, now: float) -> list[Delivery]:
        """Take out what is queued past its deadline (monotonic ``now``)."""
        return [q.item for q in self._queue.drop_expired(now)]

    def batch_started(self) -> None:
        """A batch is being taken and run: the reader reads for the next one meanwhile."""
        self._busy = True

    def take_batch(self) -> list[Queued[Delivery]]:
        """The next batch off the queue (see ``batch_limit``)."""
        return self._queue.take(self.batch_limit())

    def batch_limit(self) -> int:
        """Rows for the next batch. Background (job) batches are kept small while synchronous
        requests have come within ``FOREGROUND_QUIET_S``: the event loop encodes and writes a
        batch's results before it can start the next one, so a synchronous request arriving
        meanwhile waits for at most one small job batch. With none about, they are full size
        (a batch's lines ran 8 rows a call otherwise: ``bench/batches.py``); the first
        synchronous request after the quiet waits for at most one full job batch."""
        if self._queue.head_lane() == self._background and (
            time.monotonic() - self._foreground_at < FOREGROUND_QUIET_S
        ):
            return max(1, self.model.max_batch // BACKGROUND_BATCH_DIVISOR)
        return self.model.max_batch

    def runs_inline(self, version: str, rows: int) -> bool:
        """Whether a batch of ``rows`` of ``version`` is quick enough for the event loop (and
        its backend allows it: a Python model never runs there)."""
        return self.model.may_run_inline(version) and self._inline.suits(version, rows)

    def call_took(self, version: str, rows: int, seconds: float, *, inline: bool) -> None:
        """A model call of ``rows`` rows took ``seconds``: what inlining and the policy's
        deadline margin (``service_s``) learn from."""
        self._inline.observe(version, seconds, rows, inline=inline)
        s = self.service_s
        self.service_s = 0.8 * s + 0.2 * seconds if s else seconds

    def batch_ended(self) -> None:
        self._busy = False

    # -- model control and the worker ----------------------------------------------------------

    def install(self, config: ModelConfig) -> None:
        """Serve the config's versions (already loaded or staged) with its batching."""
        self.model.install(config)
        self.policy = BatchPolicy(self.model.max_batch, self.model.flush_s)
        self._changed.set()

    def queued_versions(self) -> set[str]:
        """Versions that requests queued here (not yet running) were routed to."""
        return {q.item.request.version for q in self._queue}

    @property
    def idle(self) -> bool:
        """Nothing queued or running (as of the dispatcher's last look)."""
        return self._idle.is_set() and not self._busy

    def stop_reading(self) -> None:
        """Being unloaded: ask the reader for nothing more of it (what is queued still runs)."""
        self._closing = True
        self._changed.set()

    async def wait_idle(self) -> None:
        """Until nothing is queued or running (a drain, with ``notify`` to wake the
        dispatcher)."""
        await self._idle.wait()

    def close(self) -> None:
        """After the dispatcher stopped: end the model's thread and unload every version."""
        self.executor.shutdown(wait=True)
        self.model.unload()


class ModelSlots:
    """The worker's served models by name."""

    def __init__(self) -> None:
        self._slots: dict[str, ModelSlot] = {}

    def add(self, slot: ModelSlot) -> None:
        self._slots[slot.model.name] = slot

    def remove(self, name: str) -> ModelSlot:
        return self._slots.pop(name)

    def __getitem__(self, name: str) -> ModelSlot:
        return self._slots[name]

    def __contains__(self, name: object) -> bool:
        return name in self._slots

    def __iter__(self) -> Iterator[str]:
        return iter(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    def get(self, name: str) -> ModelSlot | None:
        return self._slots.get(name)

    def values(self) -> list[ModelSlot]:
        return list(self._slots.values())

    def items(self) -> list[tuple[str, ModelSlot]]:
        return list(self._slots.items())

    def model(self, name: str) -> ServedModel | None:
        slot = self._slots.get(name)
        return None if slot is None else slot.model

    def models(self) -> list[ServedModel]:
        return [slot.model for slot in self._slots.values()]

    def streams(self) -> dict[str, list[str]]:
        """Each served model's request streams, highest lane first."""
        return {name: slot.streams for name, slot in self._slots.items()}

    def slot_of(self, stream: str, keys: Keys) -> ModelSlot | None:
        parsed = keys.parse_stream(stream)
        return None if parsed is None else self._slots.get(parsed[0])

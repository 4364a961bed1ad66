"""The models a worker serves: each with its batch queue, batch policy and read position.

``ModelSlots`` is the worker's registry of served models. The reader, the dispatchers and the
reclaimer look models up here; model control changes what a model serves only through
``install`` (new versions and the batching that comes with them), never by reaching into a slot.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from consumer.batcher import BatchPolicy, BatchQueue
from consumer.inline import InlineCalls
from consumer.model import ServedModel
from consumer.repository import ModelConfig
from protocol.keys import LANES_BY_PRIORITY, Keys, Lane
from protocol.messages import InferRequest

BACKGROUND_BATCH_DIVISOR = 8


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


class ModelSlot:
    """A served model with its queue, policy and the reader's knowledge of its streams."""

    def __init__(self, model: ServedModel, keys: Keys) -> None:
        self.model = model
        self.streams = keys.all_streams(model.name, model.config.partitions)
        """Every partition's lanes, each partition highest lane first."""
        lanes = len(LANES_BY_PRIORITY)
        self.lane_of = {s: i % lanes for i, s in enumerate(self.streams)}
        self.queue: BatchQueue[Delivery] = BatchQueue(
            lanes=len(LANES_BY_PRIORITY), background_from=LANES_BY_PRIORITY.index(Lane.LOW)
        )
        self.policy = BatchPolicy(model.max_batch, model.flush_s)
        self.read_ids = dict.fromkeys(self.streams, "0")
        """'0' first: drain entries this consumer already holds from an earlier life."""
        self.drained_in: dict[str, bool] = {}
        """Per read group reading some of these streams (``consumer.reader.ReadGroup``):
        whether its last read found them drained. One group on one Redis; one per partition on
        a cluster."""
        self.busy = False
        self.changed = asyncio.Event()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"model-{model.name}")
        self.service_s = 0.0
        """Moving average of recent model-call durations."""
        self.inline = InlineCalls()
        """Which batches are quick enough to run on the event loop instead of ``executor``."""
        self.idle = asyncio.Event()
        """Set while nothing is queued or running: what a drain waits for."""
        self.idle.set()

    def wanted_count(self, lane: int | None = None) -> int:
        """Entries to ask for: enough to fill the next batch. Per lane, only what is queued in
        that lane and above counts, so a worker full of background jobs still reads the
        synchronous lanes."""
        rows = self.queue.rows if lane is None else self.queue.rows_through(lane)
        return max(0, self.model.max_batch - rows)

    def batch_limit(self) -> int:
        """Rows for the next batch. Background (job) batches are kept small: the event loop
        encodes and writes a batch's results before it can start the next one, so a synchronous
        request arriving meanwhile waits for at most one small job batch."""
        if self.queue.head_lane() == LANES_BY_PRIORITY.index(Lane.LOW):
            return max(1, self.model.max_batch // BACKGROUND_BATCH_DIVISOR)
        return self.model.max_batch

    @property
    def drained(self) -> bool:
        """Nothing more queued in Redis, as far as the last read of every group knows."""
        return bool(self.drained_in) and all(self.drained_in.values())

    def reading_backlog(self) -> bool:
        """Still paging through entries delivered to this consumer earlier (its pending list)."""
        return any(i != ">" for i in self.read_ids.values())

    def needs_prompt_read(self) -> bool:
        """Idle with a partial batch and more possibly queued: read without blocking."""
        return not self.busy and len(self.queue) > 0 and not self.drained

    def reread_pending(self, streams: Collection[str] | None = None) -> None:
        """Read this consumer's pending list again from the start (on ``streams``, by default
        all): after a lost read reply (entries delivered whose reply never arrived) or a stream
        recreated empty."""
        for stream in self.streams:
            if streams is None or stream in streams:
                self.read_ids[stream] = "0"


class ModelSlots:
    """The worker's served models by name."""

    def __init__(self) -> None:
        self._slots: dict[str, ModelSlot] = {}

    def add(self, slot: ModelSlot) -> None:
        self._slots[slot.model.name] = slot

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

    def install(self, name: str, config: ModelConfig) -> None:
        """Serve the config's versions (already loaded or staged) with its batching."""
        slot = self._slots[name]
        slot.model.install(config)
        slot.policy = BatchPolicy(slot.model.max_batch, slot.model.flush_s)
        slot.changed.set()

    def queued_versions(self, name: str) -> set[str]:
        """Versions that requests queued here (not yet running) were routed to."""
        slot = self._slots.get(name)
        return set() if slot is None else {q.item.request.version for q in slot.queue}

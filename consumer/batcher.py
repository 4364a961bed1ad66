"""Batch formation: which queued requests run together, and when.

Pure logic with the clock passed in, so it is tested without sleeping. The worker feeds requests
in as it reads them and asks ``BatchPolicy.wait_s`` what to do; it knows nothing about Redis.

The flush window is an upper bound, not a fixed wait. A batch runs at once when it is full, or
when the model is free and nothing more is queued in Redis (waiting would only idle the model;
the next batch accumulates in the stream while this one runs). Otherwise, while more is known to
be queued, the worker keeps reading, but no request waits longer than the window after it was
read, nor past the point where its deadline could still be met.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class Queued(Generic[T]):
    """A request waiting for a batch, with what the policy needs to know about it."""

    item: T
    lane: int
    """0 is the highest-priority lane; lower numbers run first."""
    rows: int
    group: Hashable
    """Requests batch together only within a group (same model version and non-batch dims)."""
    arrived: float
    """When the worker read it (monotonic seconds)."""
    deadline: float
    """When its caller stops waiting (monotonic seconds)."""


@dataclass
class BatchQueue(Generic[T]):
    """Requests read but not yet run, in priority order and, within a lane, first come first."""

    lanes: int = 3
    background_from: int | None = None
    """Lanes from this index on are background work: their requests never join a batch whose
    head comes from a higher lane, so a synchronous request does not pay for a bulk job's rows."""
    _lanes: list[deque[Queued[T]]] = field(init=False)
    rows: int = field(init=False, default=0)
    _lane_rows: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self._lanes = [deque() for _ in range(self.lanes)]
        self._lane_rows = [0] * self.lanes

    def rows_through(self, lane: int) -> int:
        """Rows queued in this lane and every higher-priority one."""
        return sum(self._lane_rows[: lane + 1])

    def __len__(self) -> int:
        return sum(len(q) for q in self._lanes)

    def __iter__(self) -> Iterator[Queued[T]]:
        for q in self._lanes:
            yield from q

    def push(self, queued: Queued[T]) -> None:
        self._lanes[queued.lane].append(queued)
        self.rows += queued.rows
        self._lane_rows[queued.lane] += queued.rows

    def head_lane(self) -> int | None:
        """The lane the next batch comes from (the highest non-empty one)."""
        return next((i for i, lane in enumerate(self._lanes) if lane), None)

    def oldest_arrival(self) -> float | None:
        return min((q.arrived for q in self), default=None)

    def earliest_deadline(self) -> float | None:
        return min((q.deadline for q in self), default=None)

    def take(self, max_rows: int) -> list[Queued[T]]:
        """The next batch: the head request's group, highest lanes first, up to ``max_rows`` rows.

        A single request larger than ``max_rows`` still runs, alone.
        """
        head = next(iter(self), None)
        if head is None:
            return []
        batch: list[Queued[T]] = []
        rows = 0
        background = self.background_from
        for index, lane in enumerate(self._lanes):
            if background is not None and head.lane < background <= index:
                break
            kept: deque[Queued[T]] = deque()
            while lane:
                q = lane.popleft()
                if q.group == head.group and (not batch or rows + q.rows <= max_rows):
                    batch.append(q)
                    rows += q.rows
                    self._lane_rows[index] -= q.rows
                else:
                    kept.append(q)
            lane.extend(kept)
        self.rows -= rows
        return batch

    def drop_expired(self, now: float) -> list[Queued[T]]:
        expired: list[Queued[T]] = []
        for i, lane in enumerate(self._lanes):
            live = deque(q for q in lane if q.deadline > now)
            if len(live) != len(lane):
                gone = [q for q in lane if q.deadline <= now]
                expired.extend(gone)
                self._lane_rows[i] -= sum(q.rows for q in gone)
                self._lanes[i] = live
        self.rows -= sum(q.rows for q in expired)
        return expired


@dataclass(frozen=True)
class BatchPolicy:
    max_batch: int
    """Most rows one model call takes."""
    flush_s: float
    """Longest a request waits for others to join its batch."""

    def wait_s(
        self, queue: BatchQueue[T], now: float, *, drained: bool, service_s: float
    ) -> float | None:
        """How long to wait before running the next batch: 0 runs it now, None waits for news
        (an empty queue), a positive number waits at most that long for more requests.

        ``drained``: the last read found nothing more queued for this model.
        ``service_s``: the expected duration of the next model call, so a request is not held
        in the window past the moment its deadline can still be met.
        """
        if not len(queue):
            return None
        if queue.rows >= self.max_batch or drained:
            return 0.0
        oldest = queue.oldest_arrival()
        deadline = queue.earliest_deadline()
        assert oldest is not None and deadline is not None
        until = min(oldest + self.flush_s, deadline - service_s)
        return max(0.0, until - now)

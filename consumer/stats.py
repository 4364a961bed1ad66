"""In-process counters of one worker, for tests and log lines (Prometheus has its own)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

EXECUTED_KEPT = 100_000


@dataclass
class WorkerStats:
    """Counters for tests and logs; recent batch sizes and executed ids are kept bounded."""

    batches: int = 0
    inline_batches: int = 0
    """Batches run on the event loop instead of the model's thread (``consumer.inline``)."""
    requests: int = 0
    expired: int = 0
    failed: int = 0
    dead_lettered: int = 0
    skipped_jobs: int = 0
    """Jobs read but not run: cancelled, expired or already finished."""
    cancelled: int = 0
    """Requests dropped unrun because their callers had gone (``protocol.cancellation``)."""
    recreated: int = 0
    """Times a request stream or the consumer group had vanished and was created again."""
    batch_sizes: deque[int] = field(default_factory=lambda: deque(maxlen=10_000))
    executed: deque[str] = field(default_factory=lambda: deque(maxlen=EXECUTED_KEPT))
    """Ids of recently executed requests, newest last."""

"""What the parts of one worker share: built once by the worker, handed to each part.

The reader, the dispatchers, the reclaimer, model control and the advertiser all need the same
things: the worker's settings and name, the key builder and the Redis clock, the served models,
the ledger of held entries, how an outcome is built and where it goes (the writer's ``put``),
the metrics and counters, and the loops that hand out backoffs and own helper tasks. Each part
takes this one object instead of a dozen parameters; what differs between parts (their Redis
clients, the face of another part they call) stays a parameter of their own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from consumer.ledger import Ledger
from consumer.metrics import WorkerMetrics
from consumer.outgoing import Outcomes, Outgoing
from consumer.settings import WorkerSettings
from consumer.slots import ModelSlots
from consumer.stats import WorkerStats
from protocol.keys import Keys
from runtime.connections import RedisClock
from runtime.loops import Loops
from runtime.tracing import Tracer


@dataclass(frozen=True, slots=True)
class WorkerContext:
    settings: WorkerSettings
    keys: Keys
    clock: RedisClock
    slots: ModelSlots
    ledger: Ledger
    outcomes: Outcomes
    put: Callable[[list[Outgoing]], None]
    """Hand finished entries to the writer (``ResultWriter.put``)."""
    metrics: WorkerMetrics
    stats: WorkerStats
    loops: Loops
    tracer: Tracer | None = None
    """Only when tracing is on (parts test for None, not ``enabled``)."""

    @property
    def worker_id(self) -> str:
        """This worker's consumer name in every group."""
        return self.settings.worker_id

"""A worker part built alone, for tests: the context it takes (``consumer.context``), with the
pieces a test wants to watch passed in and everything else fresh."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from consumer.context import WorkerContext
from consumer.ledger import Ledger
from consumer.metrics import WorkerMetrics
from consumer.outgoing import Outcomes, Outgoing
from consumer.settings import WorkerSettings
from consumer.slots import ModelSlots
from consumer.stats import WorkerStats
from protocol.keys import Keys
from runtime.connections import RedisClock
from runtime.loops import Loops


def worker_context(
    namespace: str = "inferq",
    *,
    slots: Any = None,
    ledger: Ledger | None = None,
    put: Callable[[list[Outgoing]], None] | None = None,
    loops: Loops | None = None,
    **settings: Any,
) -> WorkerContext:
    """``settings`` are ``WorkerSettings`` fields (the worker is called "me" unless named);
    ``slots`` may be a stand-in with only the methods the part under test calls."""
    s = WorkerSettings(namespace=namespace, **{"worker_id": "me", **settings})
    keys, clock = Keys(namespace), RedisClock()
    return WorkerContext(
        settings=s,
        keys=keys,
        clock=clock,
        slots=ModelSlots() if slots is None else slots,
        ledger=Ledger() if ledger is None else ledger,
        outcomes=Outcomes(keys, clock.now_ms, s.worker_id),
        put=put or (lambda _: None),
        metrics=WorkerMetrics(),
        stats=WorkerStats(),
        loops=loops or Loops(structlog.get_logger()),
    )

"""Admission control: refuse at once what cannot meet its deadline, instead of queueing it.

The estimated queue wait for a request is the number of batches queued ahead of it (the
requests ahead of it, in its lane and the lanes above, filling batches of ``max_batch`` on each
live worker) times the recent duration of one batch. Counting in batches matters: for an
accelerator a batch of 64 costs little more than a batch of 1, so dividing a batch's time by the
few requests it happened to hold at light load would turn away a burst the model can absorb.
When the wait exceeds the request's deadline the gateway answers 429 with ``Retry-After`` at
once: the caller can back off or go elsewhere, and the workers do not spend time on a request
nobody will wait for. A per-model backlog cap bounds the queue whatever the estimate says.

Pure logic; the gateway feeds it observations and asks for a verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Verdict:
    admitted: bool
    wait_s: float
    """The estimated queue wait."""
    reason: str = ""
    retry_after_s: float = 0.0
    kind: str = ""
    """Why, as a metric label: ``backlog_full`` or ``wait_exceeds_deadline``."""


class ServiceTime:
    """Exponentially weighted duration of one model call (one batch), from worker timings."""

    def __init__(self, weight: float = 0.1) -> None:
        self._weight = weight
        self.batch_s: float | None = None

    def observe(self, batch_seconds: float, batch_size: int) -> None:
        if batch_size <= 0 or batch_seconds < 0:
            return
        if self.batch_s is None:
            self.batch_s = batch_seconds
        else:
            self.batch_s += self._weight * (batch_seconds - self.batch_s)


def decide(
    *,
    backlog: int,
    batch_s: float | None,
    max_batch: int,
    workers: int,
    deadline_s: float,
    max_backlog: int,
) -> Verdict:
    """Admit or refuse one request."""
    if backlog >= max_backlog:
        return Verdict(
            False,
            math.inf,
            f"{backlog} requests are already queued, at the limit of {max_backlog}",
            retry_after_s=1.0,
            kind="backlog_full",
        )
    if batch_s is None or workers <= 0:
        return Verdict(True, 0.0)  # nothing measured yet: let the first requests through
    wait_s = math.ceil(backlog / (max(1, max_batch) * workers)) * batch_s
    if wait_s <= deadline_s:
        return Verdict(True, wait_s)
    return Verdict(
        False,
        wait_s,
        f"the queue ahead would take about {wait_s * 1000:.0f} ms, longer than the request's "
        f"deadline of {deadline_s * 1000:.0f} ms",
        retry_after_s=max(1.0, wait_s - deadline_s),
        kind="wait_exceeds_deadline",
    )

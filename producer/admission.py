"""Admission control: refuse at once what cannot meet its deadline, instead of queueing it.

The estimated queue wait for a request is the work queued ahead of it (entries in its lane and
the lanes above, as the consumer group's lag reports it) times the recent service time per
request, divided by the live workers serving the model. When that exceeds the request's deadline
the gateway answers 429 with ``Retry-After`` straight away: the caller can back off or go
elsewhere, and the workers do not spend time on a request nobody will wait for. A per-model
backlog cap bounds the queue whatever the estimate says.

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
    """Exponentially weighted per-request service time of one model, from worker timings."""

    def __init__(self, weight: float = 0.1) -> None:
        self._weight = weight
        self.per_request_s: float | None = None

    def observe(self, batch_seconds: float, batch_size: int) -> None:
        if batch_size <= 0 or batch_seconds < 0:
            return
        sample = batch_seconds / batch_size
        if self.per_request_s is None:
            self.per_request_s = sample
        else:
            self.per_request_s += self._weight * (sample - self.per_request_s)


def decide(
    *, backlog: int, per_request_s: float | None, workers: int, deadline_s: float, max_backlog: int
) -> Verdict:
    """Admit or refuse one request."""
    if backlog >= max_backlog:
        return Verdict(
            False,
            math.inf,
            f"{backlog} requests are already queued, at the limit of {max_backlog}",
            retry_after_s=1.0,
        )
    if per_request_s is None or workers <= 0:
        return Verdict(True, 0.0)  # nothing measured yet: let the first requests through
    wait_s = backlog * per_request_s / workers
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

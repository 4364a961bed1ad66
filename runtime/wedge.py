"""A process wedged on its own Redis connections ends itself, so that its supervisor restarts it.

A Redis stall can leave a process unable to use Redis after Redis is back (issue #21): redis-py
8.1.0 strands a pooled connection when a pipeline's ``SCRIPT EXISTS`` times out (inferq's own
scripts no longer go that way: ``runtime.broker.Script``), and a leak of the same kind anywhere
else would do the same. Nothing inside the process would notice: its loops retry for ever, the
process stays up, and no supervisor restarts it.

``WedgeWatch`` is one more loop of a gateway's or worker's ``Loops``. Every ``interval_s`` it
sends ``PING`` through the pool, as a critical loop (readiness is 503 while the pool cannot
serve it, for instance "No connection available."). The process is *stuck* while that ``PING``
or any critical loop fails with a connection fault (refused, reset, timed out, no connection
available): since the oldest such run of failures began. A stuck process whose Redis answers a
connection opened outside the pool at every check, for ``bound_s`` on end, is *wedged*: the
watch raises ``Wedged``, which ``Loops`` takes for a crash, so readiness fails for good and the
owner exits ``EXIT_LOOP_FAILED``. While Redis itself does not answer a new connection the
process is not wedged however long that lasts: a restart would not bring Redis back, and the
process recovers by itself once Redis does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

from runtime.aio import cancelling
from runtime.backoff import Backoff
from runtime.broker import Broker
from runtime.faults import RETRYABLE, Fault

NAME = "redis-pool"
"""The watch's loop (and its readiness line, its ``inferq_loop_healthy`` label)."""
INTERVAL_S = 1.0


class Wedged(RuntimeError):
    """The process has been unable to use Redis for too long while Redis answers others."""


def stuck_since(backoffs: Iterable[Backoff]) -> float | None:
    """When the oldest run of connection failures among critical ``backoffs`` began; None
    when none is failing that way."""
    starts = [
        b.failing_since
        for b in backoffs
        if b.critical and b.fault is Fault.CONNECTION and b.failing_since is not None
    ]
    return min(starts, default=None)


class WedgeWatch:
    def __init__(
        self,
        broker: Broker,
        pool: Backoff,
        backoffs: Callable[[], Iterable[Backoff]],
        *,
        bound_s: float,
        interval_s: float = INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._broker = broker
        self._pool = pool
        """The watch's own health: its PING through the pool (``Loops.backoff(NAME)``)."""
        self._backoffs = backoffs
        """Every loop's backoff, the pool's among them (``Loops.backoffs``)."""
        self.bound_s = bound_s
        self._interval_s = interval_s
        self._clock = clock
        self.answering_since: float | None = None
        """Since when Redis has answered a new connection at every check while stuck."""

    async def run(self) -> None:
        # Not ``while True``: redis-py can turn a cancellation that arrives mid-PING into a
        # ConnectionError, which ``check`` records; the loop would then never end, and a
        # gateway's shutdown waited for it for good (a CI run's cluster teardown).
        while not cancelling():
            await asyncio.sleep(self._interval_s)
            await self.check()

    async def check(self) -> None:
        """One look: the pool's PING, then, while stuck, a new connection's. Raises
        ``Wedged`` once stuck with Redis answering for ``bound_s``."""
        try:
            await self._broker.commands.ping()
        except RETRYABLE as e:
            self._pool.record(e)
        else:
            self._pool.succeeded()
        since = stuck_since(self._backoffs())
        if since is None:
            self.answering_since = None
            return
        if not await self._broker.answers_afresh():
            self.answering_since = None  # Redis itself is down or stalled: wait for it
            return
        now = self._clock()
        if self.answering_since is None:
            self.answering_since = now
        wedged_s = now - max(since, self.answering_since)
        if wedged_s >= self.bound_s:
            raise Wedged(
                f"Redis answers a new connection, but this process has not been able to use "
                f"its own for {wedged_s:.0f} s (--redis-wedge-s {self.bound_s:g}): "
                f"{'; '.join(self._problems())}"
            )

    def _problems(self) -> list[str]:
        return [f"{b.name}: {b.problem}" for b in self._backoffs() if b.problem is not None]

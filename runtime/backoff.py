"""Exponential backoff with a cap, and the health of the loop that uses it.

Every background loop that talks to Redis owns one ``Backoff``: after a success it calls
``succeeded()``; after a Redis error it calls ``await failed(error)``, which records the error,
logs it (the first of a run of failures, when it changes, then at most every ``LOG_EVERY_S``),
and sleeps before the next attempt: ``first_s``, doubling, at most ``cap_s``. Retrying at least
every second brings service back fast, and costs Redis next to nothing.

Whether the loop is healthy, and why not, is what readiness and the loop gauges read (see
``runtime.loops``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from runtime.faults import Fault, classify, describe

FIRST_S = 0.05
CAP_S = 1.0
LOG_EVERY_S = 30.0
"""While a loop keeps failing the same way, say so again this often (not on every retry)."""


class Backoff:
    def __init__(
        self,
        name: str,
        log: Any,
        *,
        first_s: float = FIRST_S,
        cap_s: float = CAP_S,
        critical: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.critical = critical
        """Whether readiness fails while this loop fails (the request path depends on it)."""
        self._log = log
        self._first_s = first_s
        self._cap_s = cap_s
        self._clock = clock
        self.delay_s = first_s
        self.failures = 0
        """Consecutive failures; 0 while healthy."""
        self.problem: str | None = None
        """What went wrong last, for a person; None while healthy."""
        self.fault: Fault | None = None
        self.failing_since: float | None = None
        """When the current run of failures began (the injected clock); None while healthy."""
        self._logged_at = 0.0

    @property
    def healthy(self) -> bool:
        return self.problem is None

    def succeeded(self) -> None:
        if self.problem is not None:
            self._log.info(
                f"{self.name}: Redis answers again", loop=self.name, failures=self.failures
            )
        self.delay_s = self._first_s
        self.failures = 0
        self.problem = None
        self.fault = None
        self.failing_since = None

    def record(self, error: BaseException) -> None:
        """Note a failure without waiting (a loop whose own interval is the retry)."""
        problem = describe(error)
        now = self._clock()
        if problem != self.problem or now - self._logged_at >= LOG_EVERY_S:
            self._log.warning(
                f"{self.name}: {problem}; retrying",
                loop=self.name,
                failures=self.failures + 1,
                backoff_s=round(self.delay_s, 3),
            )
            self._logged_at = now
        if self.failing_since is None:
            self.failing_since = now
        self.failures += 1
        self.problem = problem
        self.fault = classify(error)

    async def failed(self, error: BaseException) -> None:
        """Note a failure, then sleep before the next attempt (longer each time, up to the cap)."""
        self.record(error)
        delay, self.delay_s = self.delay_s, min(self.delay_s * 2, self._cap_s)
        await asyncio.sleep(delay)

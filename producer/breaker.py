"""A circuit breaker per model: fail fast while a model keeps failing, then probe.

Closed: requests pass; outcomes are counted over a sliding window of recent requests. When at
least ``min_requests`` of the window are known and the failure ratio reaches ``threshold`` the
breaker opens: requests fail at once with 503 (a cached result is still served) for
``cooldown_s``. Then it is half-open: one probe request passes; its success closes the breaker,
its failure opens it for another cool-down. Pure logic with the clock passed in.
"""

from __future__ import annotations

from collections import deque
from enum import StrEnum


class State(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Breaker:
    def __init__(
        self,
        *,
        window: int = 50,
        min_requests: int = 20,
        threshold: float = 0.5,
        cooldown_s: float = 10.0,
    ) -> None:
        self._outcomes: deque[bool] = deque(maxlen=window)
        self._min_requests = min_requests
        self._threshold = threshold
        self._cooldown_s = cooldown_s
        self.state = State.CLOSED
        self._opened_at = 0.0
        self._probing = False
        self._probe_at = 0.0

    def allow(self, now: float) -> bool:
        """Whether a request may go to the model now."""
        if self.state is State.OPEN:
            if now - self._opened_at < self._cooldown_s:
                return False
            self.state = State.HALF_OPEN
            self._probing = False
        if self.state is State.HALF_OPEN:
            # One probe at a time; a probe that never reported back (it timed out) is replaced
            # after a cool-down rather than blocking the model forever.
            if self._probing and now - self._probe_at < self._cooldown_s:
                return False
            self._probing = True
            self._probe_at = now
        return True

    def retry_after_s(self, now: float) -> float:
        return max(0.0, self._cooldown_s - (now - self._opened_at))

    def record(self, ok: bool, now: float) -> None:
        if self.state is State.HALF_OPEN:
            self._probing = False
            if ok:
                self.state = State.CLOSED
                self._outcomes.clear()
            else:
                self._open(now)
            return
        self._outcomes.append(ok)
        failures = self._outcomes.count(False)
        if (
            len(self._outcomes) >= self._min_requests
            and failures / len(self._outcomes) >= self._threshold
        ):
            self._open(now)

    def failure_ratio(self) -> float:
        return self._outcomes.count(False) / len(self._outcomes) if self._outcomes else 0.0

    def _open(self, now: float) -> None:
        self.state = State.OPEN
        self._opened_at = now
        self._outcomes.clear()

"""How many workers ``inferq up --workers MIN:MAX`` wants: a pure policy over the backlog.

The signal is what ``runtime.lag.collect`` reads for every model of the namespace, summed: the
backlog (entries queued and not yet read, plus entries read and not yet acknowledged) and the
age of the oldest pending entry. ``ScalingPolicy.observe`` takes one reading and the time (the
caller's clock, so tests advance a number instead of sleeping) and says whether the wanted count
changes, and why:

- **Up at once.** The backlog asks for ``ceil(backlog / backlog_per_worker)`` workers; more than
  are wanted now starts them all in one step (``backlog``). From zero, any backlog asks for one
  (``cold start``). An oldest entry older than ``oldest_wait_s`` adds one worker (``oldest
  wait``), at most one per ``scale_up_cooldown_s``: a worker takes seconds to start, and until
  it reads, the wait only grows; without the cooldown each reading would add another.
- **Down slowly.** A wanted count above what the backlog asks for is kept until the readings have
  asked for less for ``scale_down_after_s`` without a break; it then falls to the most any of
  those readings asked for (``idle`` when that is none at all). This is the HPA's
  stabilisation window: a burst that comes back within the window finds its workers still
  there, and a backlog that hovers around a target does not start and stop workers in turn.
- **One start at a time** (``max_starting``): a worker's start is a burst of CPU (Python, the
  imports, the model load), and on a small host several at once slow down the first, which the
  first request after idleness is waiting for. While ``wanted - live`` workers are still
  starting (``live``: workers with a current heartbeat that serve the models), no more are
  added; the next follows as soon as one is up.
- Never below MIN, never above MAX. No reading (Redis did not answer) changes nothing and
  restarts the window: the policy scales down only on evidence of idleness.

Counts are of workers *wanted* (started, starting or draining out), not of those that answer
yet, so a cold start in progress is not asked for twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum


class WorkerRangeError(ValueError):
    """``--workers`` is neither ``N`` nor ``MIN:MAX`` with 0 <= MIN <= MAX and MAX >= 1."""


@dataclass(frozen=True, slots=True)
class WorkerRange:
    """``--workers``: a fixed count (``min == max``) or the bounds of autoscaling."""

    min: int
    max: int

    @property
    def fixed(self) -> bool:
        return self.min == self.max

    @property
    def initial(self) -> int:
        """Workers started with the stack: MIN, but at least one, so the models are advertised
        (the gateways learn them from a worker) and the stack comes up ready; with MIN = 0 the
        policy lets it go after ``scale_down_after_s`` of idleness."""
        return max(self.min, 1)

    def __str__(self) -> str:
        return str(self.max) if self.fixed else f"{self.min}:{self.max}"


def parse_worker_range(raw: str) -> WorkerRange:
    """``"4"`` (four, fixed, as before autoscaling) or ``"0:4"`` (zero to four)."""
    text = raw.strip()
    low, sep, high = text.partition(":")
    try:
        bounds = WorkerRange(int(low), int(high)) if sep else WorkerRange(int(text), int(text))
    except ValueError:
        raise WorkerRangeError(raw) from None
    if bounds.min < 0 or bounds.max < 1 or bounds.min > bounds.max:
        raise WorkerRangeError(raw)
    return bounds


@dataclass(frozen=True, slots=True)
class ScalingTargets:
    backlog_per_worker: int = 64
    """Entries (queued plus pending) one worker is meant to hold: one digits batch."""
    oldest_wait_s: float = 2.0
    """A pending entry older than this asks for one more worker."""
    scale_down_after_s: float = 30.0
    """How long the readings must ask for fewer workers before any is stopped."""
    scale_up_cooldown_s: float = 5.0
    """Least time between two scale-ups for ``oldest wait`` (a worker's start-up time)."""
    max_starting: int = 1
    """Workers that may be starting (wanted, not live yet) at once."""


@dataclass(frozen=True, slots=True)
class Reading:
    """The backlog of every model, summed; ``oldest_wait_s`` None when nothing is pending."""

    backlog: int
    oldest_wait_s: float | None = None
    live: int | None = None
    """Workers serving the models now (heartbeat current); None when not known."""


class Reason(StrEnum):
    """Why the wanted count changed: the label of ``inferq_up_scaling_events_total``."""

    COLD_START = "cold start"
    BACKLOG = "backlog"
    OLDEST_WAIT = "oldest wait"
    BELOW_TARGET = "below target"
    IDLE = "idle"


@dataclass(frozen=True, slots=True)
class Scaling:
    """One change of the wanted count, with the reading behind it."""

    before: int
    wanted: int
    reason: Reason
    reading: Reading

    @property
    def up(self) -> bool:
        return self.wanted > self.before


class ScalingPolicy:
    """The wanted count of workers within ``bounds``, from one ``Reading`` after another."""

    def __init__(self, bounds: WorkerRange, targets: ScalingTargets, *, now: float) -> None:
        self.bounds = bounds
        self.targets = targets
        self.wanted = bounds.initial
        self._last_up = now
        self._low_since: float | None = now if self.wanted > bounds.min else None
        """Since when every reading has asked for fewer workers than are wanted."""
        self._low_peak = 0
        """The most workers any reading asked for since ``_low_since``."""

    def asks_for(self, reading: Reading) -> int:
        """Workers the backlog alone asks for (before the bounds)."""
        if reading.backlog <= 0:
            return 0
        return math.ceil(reading.backlog / self.targets.backlog_per_worker)

    def observe(self, reading: Reading | None, now: float) -> Scaling | None:
        """The change one reading makes, or None."""
        if reading is None:
            self._low_since = None
            return None
        t, b = self.targets, self.bounds
        need = min(b.max, self.asks_for(reading))
        waited = reading.oldest_wait_s is not None and reading.oldest_wait_s > t.oldest_wait_s
        room = self._room(reading)
        if need > self.wanted:
            self._low_since = None
            if room <= 0:
                return None
            reason = Reason.COLD_START if self.wanted == 0 else Reason.BACKLOG
            return self._set(min(max(need, b.min), self.wanted + room), reason, reading, now)
        if waited:
            self._low_since = None
            cooled = now - self._last_up >= t.scale_up_cooldown_s
            if self.wanted < b.max and cooled and room > 0:
                return self._set(self.wanted + 1, Reason.OLDEST_WAIT, reading, now)
            return None
        if need >= self.wanted or self.wanted <= b.min:
            self._low_since = None
            return None
        if self._low_since is None:
            self._low_since, self._low_peak = now, need
            return None
        self._low_peak = max(self._low_peak, need)
        if now - self._low_since < t.scale_down_after_s:
            return None
        target = max(b.min, self._low_peak)
        reason = Reason.IDLE if self._low_peak == 0 else Reason.BELOW_TARGET
        return self._set(target, reason, reading, now)

    def _room(self, reading: Reading) -> int:
        """Workers that may be added now: ``max_starting`` less those still starting (no
        limit when the reading does not say how many are live)."""
        if reading.live is None:
            return self.bounds.max
        return self.targets.max_starting - max(0, self.wanted - reading.live)

    def _set(self, wanted: int, reason: Reason, reading: Reading, now: float) -> Scaling:
        change = Scaling(self.wanted, wanted, reason, reading)
        self.wanted = wanted
        self._low_since = None
        if change.up:
            self._last_up = now
        return change

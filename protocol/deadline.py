"""Deadlines and the clock they are measured on.

A deadline crosses hosts, so it needs one clock that every host can read: inferq uses the Redis
server's clock. Each process estimates the offset between its own wall clock and Redis's with
``TIME`` (taking the sample with the shortest round trip, NTP style) and refreshes it
periodically; deadlines in messages are absolute milliseconds on the Redis clock. Clock skew
between gateway and worker hosts therefore does not matter; what remains is the estimate's error,
bounded by half the round trip of the best sample (well under a millisecond on a LAN).

The gateway stays authoritative for its caller: it answers 504 when its own monotonic timer for
the request runs out, whatever any worker thinks. Workers use the deadline only to skip work
nobody waits for any more.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ClockOffset:
    """Redis clock minus local wall clock, from one ``TIME`` round trip."""

    offset_ms: float
    uncertainty_ms: float
    """Half the round trip: the most the estimate can be off by."""

    @classmethod
    def from_sample(
        cls, local_before_ms: float, redis_ms: float, local_after_ms: float
    ) -> ClockOffset:
        rtt = max(0.0, local_after_ms - local_before_ms)
        midpoint = local_before_ms + rtt / 2
        return cls(offset_ms=redis_ms - midpoint, uncertainty_ms=rtt / 2)

    def better_of(self, other: ClockOffset) -> ClockOffset:
        return self if self.uncertainty_ms <= other.uncertainty_ms else other

    def to_redis_ms(self, local_ms: float) -> int:
        return int(local_ms + self.offset_ms)


ZERO = ClockOffset(0.0, 0.0)


def redis_time_ms(seconds: int | bytes | str, microseconds: int | bytes | str) -> float:
    """Milliseconds from the two parts of a ``TIME`` reply."""
    return int(seconds) * 1000 + int(microseconds) / 1000


def deadline_after(now_ms: int, timeout_ms: float) -> int:
    return now_ms + max(0, int(timeout_ms))


def remaining_ms(deadline_ms: int, now_ms: int) -> int:
    """Milliseconds left before the deadline; zero or negative once it has passed."""
    return deadline_ms - now_ms


def has_expired(deadline_ms: int, now_ms: int) -> bool:
    return now_ms >= deadline_ms


def local_deadline(deadline_ms: int, now_ms: int, now: float) -> float:
    """The deadline on this process's monotonic clock: ``now`` (monotonic seconds) plus what is
    left of ``deadline_ms`` at ``now_ms`` (both on the Redis clock)."""
    return now + remaining_ms(deadline_ms, now_ms) / 1000

"""Open-loop arrival schedules: rate specs, piecewise-linear rates, seeded Poisson arrivals.

Pure code, no clock and no I/O: :func:`poisson_arrivals` yields intended send times as offsets in
seconds from the start of the schedule, and the open loop (:mod:`loadgen.open`) turns them into
wall-clock times.

Rate specs (``--rate``) are a comma-separated list of segments, times with a unit (``ms``, ``s``,
``m``; bare numbers are seconds):

* ``R`` — ``R`` requests/s from here on (only as the last segment);
* ``R:T`` — ``R`` requests/s for ``T``;
* ``A:B:T`` — a linear ramp from ``A`` to ``B`` requests/s over ``T``.

After the last segment the rate holds at that segment's final rate, so ``100:1000:10s`` ramps
from 100 to 1,000 requests/s over the first 10 s of measurement and then stays at 1,000 for as
long as the run lasts; a run shorter than the ramp stops part-way up it.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["RateSchedule", "Segment", "parse_duration", "poisson_arrivals"]

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|s|m|h)?\s*$")
_UNITS = {None: 1.0, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """``"10s"``, ``"500ms"``, ``"2m"``, ``"1h"`` or a bare number of seconds, as seconds."""
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a duration (examples: 10, 10s, 500ms, 2m)")
    return float(match.group(1)) * _UNITS[match.group(2)]


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a rate in requests per second") from None
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"rate {text!r} must be a non-negative number of requests per second")
    return value


@dataclass(frozen=True, slots=True)
class Segment:
    """``duration_s`` seconds of a rate going linearly from ``start_rps`` to ``end_rps``."""

    start_rps: float
    end_rps: float
    duration_s: float

    @property
    def area(self) -> float:
        """Expected arrivals over the whole segment."""
        return (self.start_rps + self.end_rps) / 2 * self.duration_s

    def time_for(self, area: float) -> float:
        """Seconds into the segment at which ``area`` arrivals are expected (inf if never)."""
        if area <= 0:
            return 0.0
        r0 = self.start_rps
        slope = (self.end_rps - r0) / self.duration_s if self.duration_s > 0 else 0.0
        if slope == 0:
            return area / r0 if r0 > 0 else math.inf
        # Solve r0*t + slope*t^2/2 = area, in the cancellation-free form of the quadratic root.
        disc = r0 * r0 + 2 * slope * area
        if disc < 0:
            return math.inf
        return 2 * area / (r0 + math.sqrt(disc))


@dataclass(frozen=True)
class RateSchedule:
    """A piecewise-linear arrival rate; after the last segment the rate holds at its end."""

    segments: tuple[Segment, ...]

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError("a rate schedule needs at least one segment")
        for s in self.segments:
            rates = (s.start_rps, s.end_rps, s.duration_s)
            if not all(v >= 0 and math.isfinite(v) for v in rates):
                raise ValueError(f"rates and durations must be finite and non-negative: {s}")

    @classmethod
    def constant(cls, rps: float) -> RateSchedule:
        return cls((Segment(rps, rps, 0.0),))

    @classmethod
    def parse(cls, text: str) -> RateSchedule:
        """Parse a ``--rate`` spec (see the module docstring)."""
        segments: list[Segment] = []
        parts = [p.strip() for p in text.split(",")]
        for i, part in enumerate(parts):
            fields = part.split(":")
            if len(fields) == 1:
                if i != len(parts) - 1:
                    raise ValueError(
                        f"rate {part!r} without a duration must be the last segment of {text!r}"
                    )
                r = _rate(fields[0])
                segments.append(Segment(r, r, 0.0))
            elif len(fields) == 2:
                r = _rate(fields[0])
                segments.append(Segment(r, r, _segment_duration(fields[1], text)))
            elif len(fields) == 3:
                segments.append(
                    Segment(_rate(fields[0]), _rate(fields[1]), _segment_duration(fields[2], text))
                )
            else:
                raise ValueError(f"{part!r}: expected RATE, RATE:DURATION or FROM:TO:DURATION")
        schedule = cls(tuple(segments))
        if schedule.final_rps == 0:
            raise ValueError(f"rate schedule {text!r} ends at 0 requests/s")
        return schedule

    @property
    def length_s(self) -> float:
        """Total length of the segments (the schedule holds its final rate afterwards)."""
        return sum(s.duration_s for s in self.segments)

    @property
    def initial_rps(self) -> float:
        return self.segments[0].start_rps

    @property
    def final_rps(self) -> float:
        return self.segments[-1].end_rps

    def rate_at(self, t: float) -> float:
        """Requests/s at ``t`` seconds."""
        start = 0.0
        for s in self.segments:
            if t < start + s.duration_s:
                return s.start_rps + (s.end_rps - s.start_rps) * (t - start) / s.duration_s
            start += s.duration_s
        return self.final_rps

    def expected(self, t: float) -> float:
        """Expected arrivals in [0, t)."""
        total = 0.0
        start = 0.0
        for s in self.segments:
            if s.duration_s > 0 and t <= start + s.duration_s:
                tau = t - start
                rate = s.start_rps + (s.end_rps - s.start_rps) * tau / s.duration_s
                return total + (s.start_rps + rate) / 2 * tau
            total += s.area
            start += s.duration_s
        return total + self.final_rps * (t - start)

    def time_at(self, area: float) -> float:
        """The inverse of :meth:`expected`: when ``area`` arrivals are expected (inf if never)."""
        start = 0.0
        for s in self.segments:
            if area <= s.area:
                return start + s.time_for(area)
            area -= s.area
            start += s.duration_s
        final = self.final_rps
        return start + area / final if final > 0 else math.inf

    def shifted(self, warmup_s: float) -> RateSchedule:
        """This schedule preceded by ``warmup_s`` seconds at its initial rate."""
        if warmup_s <= 0:
            return self
        r = self.initial_rps
        return RateSchedule((Segment(r, r, warmup_s), *self.segments))

    def describe(self) -> str:
        parts = []
        for s in self.segments:
            if s.duration_s == 0:
                parts.append(f"{s.end_rps:g}/s")
            elif s.start_rps == s.end_rps:
                parts.append(f"{s.start_rps:g}/s for {s.duration_s:g}s")
            else:
                parts.append(f"{s.start_rps:g}->{s.end_rps:g}/s over {s.duration_s:g}s")
        if self.segments[-1].duration_s > 0:
            parts.append(f"then {self.final_rps:g}/s")
        return ", ".join(parts)


def _segment_duration(text: str, spec: str) -> float:
    value = parse_duration(text)
    if value <= 0:
        raise ValueError(f"segment duration {text!r} in {spec!r} must be positive")
    return value


def poisson_arrivals(schedule: RateSchedule, rng: random.Random) -> Iterator[float]:
    """Intended send times (seconds from the schedule's start) of a Poisson process whose
    rate follows ``schedule``: unit-rate exponential gaps mapped through the inverse of the
    expected-arrivals function (time rescaling), so ramps are exact, not stepped."""
    area = 0.0
    expovariate = rng.expovariate
    time_at = schedule.time_at
    while True:
        area += expovariate(1.0)
        t = time_at(area)
        if t == math.inf:
            return
        yield t

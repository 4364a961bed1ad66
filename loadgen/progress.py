"""The live progress line: current rate, errors and P99, redrawn about once a second.

:func:`format_progress` is pure (a :class:`Snapshot` in, one line out); :class:`Progress` owns
the task that samples a :class:`~loadgen.recorder.Recorder` and redraws the line on a stream.
On a terminal the line is redrawn in place (carriage return, erase to end of line); elsewhere
(``--progress`` into a file or pipe) each redraw is a new line.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from loadgen.recorder import Recorder

__all__ = ["Progress", "Snapshot", "format_progress", "take_snapshot"]

REDRAW_S = 1.0


@dataclass(frozen=True, slots=True)
class Snapshot:
    phase: str  # "connecting", "warm-up", "measuring", "draining", "done"
    elapsed_s: float  # in the current phase
    phase_s: float | None  # planned length of the current phase
    rate_rps: float  # completions per second since the previous snapshot
    requests: int  # measured so far
    errors: int
    p99_ms: float | None  # over the last complete second of measurement
    in_flight: int
    backlog: int
    connections: int
    target_rps: float | None = None


def take_snapshot(rec: Recorder, now: float, rate_rps: float) -> Snapshot:
    """What ``rec`` shows at ``now`` (a ``time.perf_counter()`` value)."""
    stats = rec.stats
    p99: float | None = None
    if rec.started_at is None:
        phase, elapsed, length = "connecting", 0.0, None
    elif rec.finished:
        phase, elapsed, length = "done", 0.0, None
    else:
        assert rec.measure_start is not None and rec.measure_end is not None
        if now < rec.measure_start:
            phase = "warm-up"
            elapsed, length = now - rec.started_at, rec.measure_start - rec.started_at
        elif now < rec.measure_end:
            phase = "measuring"
            elapsed, length = now - rec.measure_start, rec.measure_end - rec.measure_start
        else:
            phase, elapsed, length = "draining", now - rec.measure_end, None
    if rec.measure_start is not None and now >= rec.measure_start:
        row = rec.timeline.last_complete(now)
        p99 = None if row is None else row.p99_ms
    return Snapshot(
        phase=phase,
        elapsed_s=elapsed,
        phase_s=length,
        rate_rps=rate_rps,
        requests=stats.total,
        errors=stats.error_count,
        p99_ms=p99,
        in_flight=rec.in_flight,
        backlog=rec.backlog,
        connections=rec.connections,
        target_rps=rec.target_rps,
    )


def format_progress(s: Snapshot) -> str:
    """One line, e.g. ``measuring   3.0/10.0s  1,234 req/s  done 3,702  errors 0  p99 12.3 ms``."""
    when = f"{s.elapsed_s:5.1f}s" if s.phase_s is None else f"{s.elapsed_s:5.1f}/{s.phase_s:.1f}s"
    share = f" ({s.errors / s.requests:.1%})" if s.requests and s.errors else ""
    p99 = "-" if s.p99_ms is None else f"{s.p99_ms:.1f} ms"
    parts = [
        f"{s.phase:<10} {when}",
        f"{s.rate_rps:,.0f} req/s",
        f"done {s.requests:,}",
        f"errors {s.errors:,}{share}",
        f"p99 {p99}",
        f"in-flight {s.in_flight:,}",
    ]
    if s.target_rps is not None:
        parts.insert(2, f"(target {s.target_rps:,.0f})")
        parts.append(f"backlog {s.backlog:,}")
        parts.append(f"conns {s.connections:,}")
    return "  ".join(parts)


class Progress:
    """Redraws the progress line of ``recorder`` on ``stream`` every ``interval_s``.

    Use as ``async with Progress(rec, sys.stderr, tty=...)`` around the run: it starts its task
    on entry, and on exit cancels it and ends the line (on a terminal) so a summary can follow.
    """

    def __init__(
        self,
        recorder: Recorder,
        stream: TextIO,
        *,
        tty: bool,
        interval_s: float = REDRAW_S,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.recorder = recorder
        self.stream = stream
        self.tty = tty
        self.interval_s = interval_s
        self.clock = clock
        self._task: asyncio.Task[None] | None = None
        self._last_count = 0
        self._last_time: float | None = None
        self.lines = 0

    def _completed(self) -> int:
        return self.recorder.stats.total + self.recorder.warmup_done

    def draw(self) -> None:
        now = self.clock()
        count = self._completed()
        rate = 0.0
        if self._last_time is not None and now > self._last_time:
            rate = (count - self._last_count) / (now - self._last_time)
        self._last_count, self._last_time = count, now
        line = format_progress(take_snapshot(self.recorder, now, rate))
        if self.tty:
            self.stream.write(f"\r{line}\x1b[K")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self.lines += 1

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.draw()

    async def __aenter__(self) -> Progress:
        self._last_time = self.clock()
        self._last_count = self._completed()
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.tty and self.lines:
            self.stream.write("\n")
            self.stream.flush()

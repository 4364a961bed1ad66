"""Closed-loop load: C workers, each on its own keep-alive connection, sending back-to-back.

Throughput is whatever the server sustains at concurrency C (Little's law: rps = C / latency).
Closed loops under-report tail latency under overload ("coordinated omission": a stalled server
also stalls the senders, so the requests that *would* have queued are never sent); the open loop
(:mod:`loadgen.open`) measures from intended send times instead.
"""

from __future__ import annotations

import asyncio
import time

from loadgen.http import HTTPConnection
from loadgen.loop import LoadOptions, Window, attempt
from loadgen.recorder import Recorder
from loadgen.result import LoadResult

__all__ = ["run_closed_loop"]


async def run_closed_loop(
    options: LoadOptions,
    concurrency: int,
    *,
    recorder: Recorder | None = None,
    stop: asyncio.Event | None = None,
) -> LoadResult:
    """Drive ``options.url`` with ``concurrency`` back-to-back workers; return what was measured.

    Worker *i* starts at unit of work *i* and goes on from there.  A request's latency and
    status are recorded when it *starts* inside the window; requests in flight when the window
    closes are awaited (each is bounded by ``timeout_s``) and recorded.  Reaching
    ``max_requests`` ends a phase (the window then ends there); so does setting ``stop``: no new
    request starts, in-flight ones finish.  Outcomes go into ``recorder`` (a fresh one when not
    given), which a progress display may read while the loop runs.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    cap = options.cap
    duration_s = options.duration_s
    target, op = options.prepare()
    rec = Recorder() if recorder is None else recorder
    perf_counter = time.perf_counter
    process_time = time.process_time
    stopping = stop.is_set if stop is not None else (lambda: False)
    conns = [options.connection(target) for _ in range(concurrency)]

    issued = 0
    warm_issued = 0
    cpu_start: float | None = None
    window = Window(0.0, 0.0)  # set once connections are open

    def end_window(t: float) -> None:
        """Measurement ends at ``t`` (``max_requests`` reached, or ``stop``)."""
        if t < window.end:
            window.end = max(t, window.start)

    async def worker(conn: HTTPConnection, first: int) -> None:
        nonlocal issued, warm_issued, cpu_start
        k = first
        while True:
            t = perf_counter()
            if stopping() or (t >= window.start and issued >= cap):
                end_window(t)
                return
            if t >= window.start:
                if t >= window.end:
                    return
                issued += 1
                if cpu_start is None:
                    cpu_start = process_time()
                measuring = True
            else:
                if warm_issued >= cap:  # warm-up request budget spent: start measuring now
                    window.start, window.end = t, t + duration_s
                    rec.set_window(t, duration_s)
                    continue
                warm_issued += 1
                measuring = False
            outcome = await attempt(op, conn, k, options.timeout_s, rec, window, measuring)
            k += 1
            if outcome is not None and measuring:
                status, end = outcome
                rec.record(status, end - t, end)

    try:
        await asyncio.gather(*(c.connect() for c in conns), return_exceptions=True)
        rec.connections = rec.peak_connections = sum(c.connected for c in conns)
        t0 = perf_counter()
        window.start = t0 + options.warmup_s
        window.end = window.start + duration_s
        rec.begin(t0, options.warmup_s, duration_s)
        await asyncio.gather(*(worker(c, k) for k, c in enumerate(conns)))
        cpu_end = process_time()
    finally:
        await asyncio.gather(*(c.aclose() for c in conns))
        rec.finished = True

    return LoadResult.from_recorder(
        rec,
        mode="closed",
        url=options.url,
        concurrency=concurrency,
        duration_s=window.length_s,
        completed=window.done,
        completed_ok=window.ok,
        warmup_requests=warm_issued,
        client_cpu_s=0.0 if cpu_start is None else cpu_end - cpu_start,
    )

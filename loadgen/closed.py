"""Closed-loop load: C workers, each on its own keep-alive connection, sending back-to-back.

Throughput is whatever the server sustains at concurrency C (Little's law: rps = C / latency).
Closed loops under-report tail latency under overload ("coordinated omission": a stalled server
also stalls the senders, so the requests that *would* have queued are never sent); the open loop
(:mod:`loadgen.open`) measures from intended send times instead.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from loadgen.http import ConnectError, HTTPClientError, HTTPConnection, PreparedRequest
from loadgen.recorder import Recorder
from loadgen.result import LoadResult
from loadgen.workload import OperationFactory, encode_workload, send_operation

__all__ = ["CONNECT_BACKOFF_S", "DEFAULT_MAX_REQUESTS", "run_closed_loop"]

#: Upper bound on measured requests when ``max_requests`` is not given (a safety cap).
DEFAULT_MAX_REQUESTS = 100_000_000
#: Pause after a failed connect, so a dead server does not turn the loop into a busy spin
#: that steals CPU from the server it shares cores with.
CONNECT_BACKOFF_S = 0.01


async def run_closed_loop(
    url: str,
    *,
    concurrency: int,
    duration_s: float,
    requests: Sequence[PreparedRequest] | PreparedRequest | None = None,
    method: str = "POST",
    body: bytes = b"",
    headers: Mapping[str, str] | None = None,
    warmup_s: float = 1.0,
    max_requests: int | None = None,
    timeout_s: float = 30.0,
    connect_timeout_s: float = 5.0,
    operation: OperationFactory | None = None,
    connection: Callable[[], Any] | None = None,
    recorder: Recorder | None = None,
    stop: asyncio.Event | None = None,
) -> LoadResult:
    """Drive ``url`` with ``concurrency`` back-to-back workers; return what was measured.

    The workload is either ``requests`` (one or more :class:`PreparedRequest`, paths relative to
    the URL's server; worker *i* starts at request *i* and cycles through them) or a single
    ``method`` request to the URL's path with ``body`` and ``headers``.  ``operation`` changes
    what one unit of work is (default: send the request; see :mod:`loadgen.workload`), and
    ``connection`` makes the loop's connections for another transport (with an operation that
    uses them: :mod:`loadgen.grpc_client`; default: HTTP keep-alive connections to the URL).

    Timeline: connections are opened first (not timed), then ``warmup_s`` of unrecorded
    requests, then the measurement window of ``duration_s``.  A request's latency and status
    are recorded when it *starts* inside the window; requests in flight when the window closes
    are awaited (each is bounded by ``timeout_s``) and recorded.  Throughput counts the
    completions that fall inside the window (whenever their request started) over its length,
    so it is not diluted by the final drain.  Warm-up and measurement are each also bounded by
    ``max_requests`` (default :data:`DEFAULT_MAX_REQUESTS`); reaching it ends that phase (the
    window then ends there).  Setting ``stop`` ends the window early: no new request starts,
    in-flight ones finish.
    Outcomes go into ``recorder`` (a fresh one when not given), which a progress display may
    read while the loop runs.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    if not duration_s > 0:
        raise ValueError("duration_s must be positive")
    if warmup_s < 0:
        raise ValueError("warmup_s must not be negative")
    if not timeout_s > 0:
        raise ValueError("timeout_s must be positive")
    cap = DEFAULT_MAX_REQUESTS if max_requests is None else max_requests
    if cap < 1:
        raise ValueError("max_requests must be at least 1")

    target, reqs = encode_workload(url, requests, method=method, body=body, headers=headers)
    op = (operation or send_operation)(target, reqs)
    rec = Recorder() if recorder is None else recorder
    record = rec.record
    record_error = rec.record_error
    perf_counter = time.perf_counter
    process_time = time.process_time
    stopping = stop.is_set if stop is not None else (lambda: False)

    conns = [
        connection()
        if connection is not None
        else HTTPConnection(
            target.host,
            target.port,
            host_header=target.host_header,
            timeout=timeout_s,
            connect_timeout=connect_timeout_s,
        )
        for _ in range(concurrency)
    ]

    issued = 0
    warm_issued = 0
    done_in_window = 0
    ok_in_window = 0
    cpu_start: float | None = None
    measure_start = 0.0
    stop_at = 0.0
    window_s = duration_s  # shorter when max_requests or stop ends the window early

    def completed(end: float, ok: bool) -> None:
        # Throughput counts every completion inside the window, whenever its request started:
        # unbiased even when latency is a sizeable part of the window.
        nonlocal done_in_window, ok_in_window
        if measure_start <= end < stop_at:
            done_in_window += 1
            ok_in_window += ok

    async def worker(conn: HTTPConnection, first: int) -> None:
        nonlocal issued, warm_issued, cpu_start, measure_start, stop_at, window_s
        k = first
        while True:
            t = perf_counter()
            if stopping() or (t >= measure_start and issued >= cap):
                if t < stop_at:  # the window ends here
                    stop_at = max(t, measure_start)
                    window_s = stop_at - measure_start
                return
            if t >= measure_start:
                if t >= stop_at:
                    return
                issued += 1
                if cpu_start is None:
                    cpu_start = process_time()
                measuring = True
            else:
                if warm_issued >= cap:  # warm-up request budget spent: start measuring now
                    measure_start = t
                    stop_at = t + duration_s
                    rec.set_window(measure_start, duration_s)
                    continue
                warm_issued += 1
                measuring = False
            rec.in_flight += 1
            try:
                status = await op(conn, k, timeout_s)
            except (HTTPClientError, OSError) as exc:
                rec.in_flight -= 1
                end = perf_counter()
                completed(end, False)
                if measuring:
                    record_error(exc, end)
                else:
                    rec.warmup_done += 1
                if isinstance(exc, ConnectError):
                    await asyncio.sleep(CONNECT_BACKOFF_S)
                k += 1
                continue
            rec.in_flight -= 1
            k += 1
            end = perf_counter()
            completed(end, 200 <= status < 300)
            if measuring:
                record(status, end - t, end)
            else:
                rec.warmup_done += 1

    try:
        await asyncio.gather(*(c.connect() for c in conns), return_exceptions=True)
        rec.connections = rec.peak_connections = sum(c.connected for c in conns)
        t0 = perf_counter()
        measure_start = t0 + warmup_s
        stop_at = measure_start + duration_s
        rec.begin(t0, warmup_s, duration_s)
        await asyncio.gather(*(worker(c, k) for k, c in enumerate(conns)))
        cpu_end = process_time()
    finally:
        await asyncio.gather(*(c.aclose() for c in conns))
        rec.finished = True

    return LoadResult.from_recorder(
        rec,
        mode="closed",
        url=url,
        concurrency=concurrency,
        duration_s=window_s,
        completed=done_in_window,
        completed_ok=ok_in_window,
        warmup_requests=warm_issued,
        client_cpu_s=0.0 if cpu_start is None else cpu_end - cpu_start,
    )

"""Closed-loop load: C workers, each on its own keep-alive connection, sending back-to-back.

Throughput is whatever the server sustains at concurrency C (Little's law: rps = C / latency);
closed loops under-report tail latency under overload ("coordinated omission"), which the
open-loop (Poisson arrival) mode, to be added beside this module, does not.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence

from loadgen.http import ConnectError, HTTPClientError, HTTPConnection, PreparedRequest
from loadgen.result import LoadResult
from loadgen.stats import RequestStats
from loadgen.workload import encode_workload

__all__ = ["DEFAULT_MAX_REQUESTS", "run_closed_loop"]

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
) -> LoadResult:
    """Drive ``url`` with ``concurrency`` back-to-back workers; return what was measured.

    The workload is either ``requests`` (one or more :class:`PreparedRequest`, paths relative to
    the URL's server; worker *i* starts at request *i* and cycles through them) or a single
    ``method`` request to the URL's path with ``body`` and ``headers``.

    Timeline: connections are opened first (not timed), then ``warmup_s`` of unrecorded
    requests, then the measurement window of ``duration_s``.  A request is recorded when it
    *starts* inside the window; requests in flight when the window closes are awaited (each is
    bounded by ``timeout_s``) and recorded.  Warm-up and measurement are each also bounded by
    ``max_requests`` (default :data:`DEFAULT_MAX_REQUESTS`); reaching it ends that phase early.
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
    n_reqs = len(reqs)
    stats = RequestStats()
    record = stats.record
    record_error = stats.record_error
    perf_counter = time.perf_counter
    process_time = time.process_time

    conns = [
        HTTPConnection(
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
    last_end = 0.0
    cpu_start: float | None = None
    measure_start = 0.0
    stop_at = 0.0

    async def worker(conn: HTTPConnection, first: int) -> None:
        nonlocal issued, warm_issued, last_end, cpu_start, measure_start, stop_at
        i = first % n_reqs
        send = conn.send
        while True:
            t = perf_counter()
            if t >= measure_start:
                if t >= stop_at or issued >= cap:
                    return
                issued += 1
                if cpu_start is None:
                    cpu_start = process_time()
                measuring = True
            else:
                if warm_issued >= cap:  # warm-up request budget spent: start measuring now
                    measure_start = t
                    stop_at = t + duration_s
                    continue
                warm_issued += 1
                measuring = False
            raw, head = reqs[i]
            i += 1
            if i == n_reqs:
                i = 0
            try:
                resp = await send(raw, head=head, timeout=timeout_s)
            except (HTTPClientError, OSError) as exc:
                if measuring:
                    record_error(exc)
                    end = perf_counter()
                    if end > last_end:
                        last_end = end
                if isinstance(exc, ConnectError):
                    await asyncio.sleep(CONNECT_BACKOFF_S)
                continue
            end = perf_counter()
            if measuring:
                record(resp.status, end - t)
                if end > last_end:
                    last_end = end

    try:
        await asyncio.gather(*(c.connect() for c in conns), return_exceptions=True)
        t0 = perf_counter()
        measure_start = t0 + warmup_s
        stop_at = measure_start + duration_s
        await asyncio.gather(*(worker(c, k) for k, c in enumerate(conns)))
        t_done = perf_counter()
        cpu_end = process_time()
    finally:
        await asyncio.gather(*(c.aclose() for c in conns))

    if last_end > measure_start:
        duration = last_end - measure_start
    else:  # nothing completed in the window
        duration = max(min(t_done, stop_at) - measure_start, 0.0)
    return LoadResult.from_stats(
        stats,
        mode="closed",
        url=url,
        concurrency=concurrency,
        duration_s=duration,
        warmup_requests=warm_issued,
        client_cpu_s=0.0 if cpu_start is None else cpu_end - cpu_start,
    )

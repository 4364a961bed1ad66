"""Open-loop load: Poisson arrivals at a given rate (or rate schedule), whatever the server does.

Each arrival has an *intended* send time drawn from the schedule (:mod:`loadgen.schedule`). It is
handed to an idle connection if there is one; otherwise a new connection is opened, up to
``max_connections``; beyond that it waits in a client-side backlog for the first connection to
free up.  Its latency is measured from the intended time (or from the actual write, if that was
earlier), so time spent waiting because the server (or this client) fell behind is counted:
a stall shows up as the queueing it causes, not as requests that were never sent
("coordinated omission").  The recorder also keeps, per request, how late the write was
(:attr:`Recorder.send_lag`) and the latency from the actual write (:attr:`Recorder.service`,
what a closed loop would have reported), so the two can be told apart.

Every request must complete within ``timeout_s`` of its intended time: the time left is its
HTTP timeout, and one whose time ran out while it waited for a connection is never sent and is
counted as ``TimeoutBeforeSend``.  So the run ends at most ``timeout_s`` after the last
arrival, and a server that cannot keep up produces errors, not an endless drain.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from loadgen.closed import CONNECT_BACKOFF_S, DEFAULT_MAX_REQUESTS
from loadgen.http import ConnectError, HTTPClientError, HTTPConnection, PreparedRequest
from loadgen.recorder import Recorder
from loadgen.result import LoadResult
from loadgen.schedule import RateSchedule, poisson_arrivals
from loadgen.workload import OperationFactory, encode_workload, send_operation

__all__ = ["DEFAULT_MAX_CONNECTIONS", "TIMEOUT_BEFORE_SEND", "run_open_loop"]

#: Default bound on connections an open loop opens.
DEFAULT_MAX_CONNECTIONS = 512
#: Error kind of a request whose deadline passed while it waited for a free connection.
TIMEOUT_BEFORE_SEND = "TimeoutBeforeSend"
#: An arrival due within this long is sent now rather than slept for: event-loop timers have
#: about 1 ms resolution, and latency is measured from the earlier of intended and actual send.
SEND_SLACK_S = 0.0005
#: Longest single sleep of the scheduler, so ``stop`` is noticed at low rates.
MAX_SLEEP_S = 0.1

_Item = tuple[float, int, bool]  # (intended perf_counter time, unit of work k, measured)


async def run_open_loop(
    url: str,
    *,
    rate: RateSchedule | float,
    duration_s: float,
    requests: Sequence[PreparedRequest] | PreparedRequest | None = None,
    method: str = "POST",
    body: bytes = b"",
    headers: Mapping[str, str] | None = None,
    warmup_s: float = 1.0,
    max_requests: int | None = None,
    timeout_s: float = 30.0,
    connect_timeout_s: float = 5.0,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    connections: int | None = None,
    seed: int = 0,
    operation: OperationFactory | None = None,
    connection: Callable[[], Any] | None = None,
    recorder: Recorder | None = None,
    stop: asyncio.Event | None = None,
) -> LoadResult:
    """Send Poisson arrivals following ``rate`` (requests/s, or a schedule) to ``url``.

    The workload arguments are those of :func:`loadgen.closed.run_closed_loop`; arrival *k*
    performs unit of work *k*.  Timeline: ``connections`` connections (default: enough for
    10 ms of the initial rate, at least 4) are opened first, untimed; then ``warmup_s`` seconds
    of unrecorded arrivals at the schedule's initial rate; then ``duration_s`` seconds of
    measured arrivals following the schedule from its start.  Arrivals are seeded by ``seed``.
    At most ``max_requests`` (default :data:`DEFAULT_MAX_REQUESTS`) arrivals are measured.
    """
    schedule = rate if isinstance(rate, RateSchedule) else RateSchedule.constant(float(rate))
    if schedule.final_rps <= 0 and schedule.length_s == 0:
        raise ValueError("rate must be positive")
    if not duration_s > 0:
        raise ValueError("duration_s must be positive")
    if warmup_s < 0:
        raise ValueError("warmup_s must not be negative")
    if not timeout_s > 0:
        raise ValueError("timeout_s must be positive")
    if max_connections < 1:
        raise ValueError("max_connections must be at least 1")
    cap = DEFAULT_MAX_REQUESTS if max_requests is None else max_requests
    if cap < 1:
        raise ValueError("max_requests must be at least 1")
    if connections is None:
        connections = max(4, math.ceil(schedule.initial_rps * 0.01))
    connections = max(1, min(connections, max_connections))

    target, reqs = encode_workload(url, requests, method=method, body=body, headers=headers)
    op = (operation or send_operation)(target, reqs)
    rec = Recorder() if recorder is None else recorder
    rec.target_rps = schedule.expected(duration_s) / duration_s
    perf_counter = time.perf_counter
    loop = asyncio.get_running_loop()
    stopping = stop.is_set if stop is not None else (lambda: False)

    backlog: deque[_Item] = deque()
    idle: list[asyncio.Future[_Item | None]] = []
    workers: set[asyncio.Task[None]] = set()
    conns: list[HTTPConnection] = []
    closing = False
    measure_start = math.inf
    window_end = math.inf
    done_in_window = 0
    ok_in_window = 0

    def completed(end: float, ok: bool) -> None:
        # Throughput: completions inside the arrival window, whatever their arrival time.
        nonlocal done_in_window, ok_in_window
        if measure_start <= end < window_end:
            done_in_window += 1
            ok_in_window += ok

    def new_connection() -> HTTPConnection:
        conn = (
            connection()
            if connection is not None
            else HTTPConnection(
                target.host,
                target.port,
                host_header=target.host_header,
                timeout=timeout_s,
                connect_timeout=connect_timeout_s,
            )
        )
        conns.append(conn)
        rec.opened_connection()
        return conn

    async def worker(conn: HTTPConnection) -> None:
        while True:
            item: _Item
            if backlog:
                item = backlog.popleft()
                rec.backlog = len(backlog)
            elif closing:
                return
            else:
                fut: asyncio.Future[_Item | None] = loop.create_future()
                idle.append(fut)
                got = await fut
                if got is None:
                    return
                item = got
            intended, k, measuring = item
            sent = perf_counter()
            start = intended if intended < sent else sent
            remaining = start + timeout_s - sent
            if remaining <= 0:
                completed(sent, False)
                if measuring:
                    rec.record_error(TIMEOUT_BEFORE_SEND, sent)
                else:
                    rec.warmup_done += 1
                continue
            rec.in_flight += 1
            try:
                status = await op(conn, k, remaining)
            except (HTTPClientError, OSError) as exc:
                rec.in_flight -= 1
                end = perf_counter()
                completed(end, False)
                if measuring:
                    rec.record_error(exc, end)
                else:
                    rec.warmup_done += 1
                if isinstance(exc, ConnectError):
                    await asyncio.sleep(CONNECT_BACKOFF_S)
                continue
            rec.in_flight -= 1
            end = perf_counter()
            completed(end, 200 <= status < 300)
            if measuring:
                rec.record(status, end - start, end)
                rec.send_lag.record(sent - intended)
                if 200 <= status < 300:
                    rec.service.record(end - sent)
            else:
                rec.warmup_done += 1

    def spawn(conn: HTTPConnection) -> None:
        task = asyncio.create_task(worker(conn))
        workers.add(task)
        task.add_done_callback(workers.discard)

    def dispatch(item: _Item) -> None:
        while idle:
            fut = idle.pop()
            if not fut.done():
                fut.set_result(item)
                return
        backlog.append(item)
        rec.backlog = len(backlog)
        if len(conns) < max_connections:
            spawn(new_connection())

    initial = [new_connection() for _ in range(connections)]
    cpu_start = time.process_time()
    try:
        await asyncio.gather(*(c.connect() for c in initial), return_exceptions=True)
        for c in initial:
            spawn(c)
        t0 = perf_counter()
        rec.begin(t0, warmup_s, duration_s)
        measure_start = t0 + warmup_s
        end_offset = warmup_s + duration_s
        window_end = t0 + end_offset
        measured = 0
        k = 0
        arrivals = poisson_arrivals(schedule.shifted(warmup_s), random.Random(seed))
        for offset in arrivals:
            if offset >= end_offset:
                break
            if stopping():
                window_end = min(perf_counter(), window_end)
                break
            measuring = offset >= warmup_s
            if measuring:
                if measured >= cap:  # the window ends with the last measured arrival
                    window_end = max(measure_start, min(perf_counter(), window_end))
                    break
                measured += 1
            intended = t0 + offset
            delay = intended - perf_counter()
            while delay > SEND_SLACK_S and not stopping():
                await asyncio.sleep(min(delay, MAX_SLEEP_S))
                delay = intended - perf_counter()
            if stopping():
                measured -= measuring
                window_end = max(measure_start, min(perf_counter(), window_end))
                break
            dispatch((intended, k, measuring))
            k += 1
        closing = True
        for fut in idle:
            if not fut.done():
                fut.set_result(None)
        idle.clear()
        if workers:
            await asyncio.gather(*list(workers))
        cpu_s = time.process_time() - cpu_start
    finally:
        closing = True
        for task in list(workers):
            task.cancel()
        await asyncio.gather(*list(workers), return_exceptions=True)
        await asyncio.gather(*(c.aclose() for c in conns))
        rec.finished = True

    window = max(window_end - measure_start, 0.0)
    return LoadResult.from_recorder(
        rec,
        mode="open",
        url=url,
        concurrency=rec.peak_connections,
        duration_s=window,
        completed=done_in_window,
        completed_ok=ok_in_window,
        warmup_requests=k - measured,
        client_cpu_s=cpu_s,
        target_rps=rec.target_rps,
        offered_rps=measured / window if window > 0 else None,
        schedule=schedule.describe(),
    )

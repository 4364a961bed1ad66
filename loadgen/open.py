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

from loadgen.http import HTTPConnection
from loadgen.loop import LoadOptions, Window, attempt
from loadgen.recorder import Recorder
from loadgen.result import LoadResult
from loadgen.schedule import RateSchedule, poisson_arrivals

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
    options: LoadOptions,
    rate: RateSchedule | float,
    *,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    connections: int | None = None,
    seed: int = 0,
    recorder: Recorder | None = None,
    stop: asyncio.Event | None = None,
) -> LoadResult:
    """Send Poisson arrivals following ``rate`` (requests/s, or a schedule) to ``options.url``.

    Arrival *k* performs unit of work *k*.  Timeline: ``connections`` connections (default:
    enough for 10 ms of the initial rate, at least 4) are opened first, untimed; then
    ``warmup_s`` seconds of unrecorded arrivals at the schedule's initial rate; then
    ``duration_s`` seconds of measured arrivals following the schedule from its start, at most
    ``max_requests`` of them.  Arrivals are seeded by ``seed``; ``stop`` ends them early.
    """
    schedule = rate if isinstance(rate, RateSchedule) else RateSchedule.constant(float(rate))
    if schedule.final_rps <= 0 and schedule.length_s == 0:
        raise ValueError("rate must be positive")
    if max_connections < 1:
        raise ValueError("max_connections must be at least 1")
    duration_s, warmup_s, timeout_s = options.duration_s, options.warmup_s, options.timeout_s
    cap = options.cap
    if connections is None:
        connections = max(4, math.ceil(schedule.initial_rps * 0.01))
    connections = max(1, min(connections, max_connections))

    target, op = options.prepare()
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
    window = Window(math.inf, math.inf)  # set once connections are open

    def new_connection() -> HTTPConnection:
        conn = options.connection(target)
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
                window.completed(sent, False)
                if measuring:
                    rec.record_error(TIMEOUT_BEFORE_SEND, sent)
                else:
                    rec.warmup_done += 1
                continue
            outcome = await attempt(op, conn, k, remaining, rec, window, measuring)
            if outcome is not None and measuring:
                status, end = outcome
                rec.record(status, end - start, end)
                rec.send_lag.record(sent - intended)
                if 200 <= status < 300:
                    rec.service.record(end - sent)

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
        end_offset = warmup_s + duration_s
        window.start, window.end = t0 + warmup_s, t0 + end_offset
        measured = 0
        k = 0
        arrivals = poisson_arrivals(schedule.shifted(warmup_s), random.Random(seed))
        for offset in arrivals:
            if offset >= end_offset:
                break
            if stopping():
                window.end = min(perf_counter(), window.end)
                break
            measuring = offset >= warmup_s
            if measuring:
                if measured >= cap:  # the window ends with the last measured arrival
                    window.end = max(window.start, min(perf_counter(), window.end))
                    break
                measured += 1
            intended = t0 + offset
            delay = intended - perf_counter()
            while delay > SEND_SLACK_S and not stopping():
                await asyncio.sleep(min(delay, MAX_SLEEP_S))
                delay = intended - perf_counter()
            if stopping():
                measured -= measuring
                window.end = max(window.start, min(perf_counter(), window.end))
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

    length_s = window.length_s
    return LoadResult.from_recorder(
        rec,
        mode="open",
        url=options.url,
        concurrency=rec.peak_connections,
        duration_s=length_s,
        completed=window.done,
        completed_ok=window.ok,
        warmup_requests=k - measured,
        client_cpu_s=cpu_s,
        target_rps=rec.target_rps,
        offered_rps=measured / length_s if length_s > 0 else None,
        schedule=schedule.describe(),
    )

"""What every load loop shares: its options, its measurement window, and one attempt at a unit of
work recorded the same way (:mod:`loadgen.closed`, :mod:`loadgen.open`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loadgen.http import ConnectError, HTTPClientError, HTTPConnection, PreparedRequest, Target
from loadgen.recorder import Recorder
from loadgen.workload import Operation, OperationFactory, encode_workload, send_operation

__all__ = [
    "CONNECT_BACKOFF_S",
    "DEFAULT_MAX_REQUESTS",
    "LoadOptions",
    "Window",
    "attempt",
]

#: Upper bound on measured requests when ``max_requests`` is not given (a safety cap).
DEFAULT_MAX_REQUESTS = 100_000_000
#: Pause after a failed connect, so a dead server does not turn a loop into a busy spin
#: that steals CPU from the server it shares cores with.
CONNECT_BACKOFF_S = 0.01


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """The target, the workload, the phases and the limits of a load run, whatever its loop.

    * the workload is either ``requests`` (one or more :class:`PreparedRequest`, paths relative
      to ``url``'s server; cycled) or one ``method`` request to ``url``'s own path with
      ``body`` and ``headers``; ``operation`` changes what one unit of work is (default: send
      the request; jobs mode submits and polls, see :mod:`loadgen.workload`);
    * phases: connections are opened first (untimed), then ``warmup_s`` of unrecorded work, then
      ``duration_s`` of measurement; ``max_requests`` (default :data:`DEFAULT_MAX_REQUESTS`)
      bounds the measured requests (the closed loop's warm-up too);
    * ``timeout_s`` bounds each unit of work, ``connect_timeout_s`` each connect;
    * ``transport`` makes the run's connections for another protocol, with an ``operation``
      that uses them (gRPC: :mod:`loadgen.grpc_client`); by default they are HTTP keep-alive
      connections to ``url``.
    """

    url: str
    duration_s: float
    requests: Sequence[PreparedRequest] | PreparedRequest | None = None
    method: str = "POST"
    body: bytes = b""
    headers: Mapping[str, str] | None = None
    warmup_s: float = 1.0
    max_requests: int | None = None
    timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    operation: OperationFactory | None = None
    transport: Callable[[], Any] | None = None

    def __post_init__(self) -> None:
        if not self.duration_s > 0:
            raise ValueError("duration_s must be positive")
        if self.warmup_s < 0:
            raise ValueError("warmup_s must not be negative")
        if not self.timeout_s > 0:
            raise ValueError("timeout_s must be positive")
        if self.cap < 1:
            raise ValueError("max_requests must be at least 1")

    @property
    def cap(self) -> int:
        """The measured-request bound in force."""
        return DEFAULT_MAX_REQUESTS if self.max_requests is None else self.max_requests

    def prepare(self) -> tuple[Target, Operation]:
        """Resolve the URL, encode the requests once, and build the run's operation."""
        target, reqs = encode_workload(
            self.url, self.requests, method=self.method, body=self.body, headers=self.headers
        )
        return target, (self.operation or send_operation)(target, reqs)

    def connection(self, target: Target) -> HTTPConnection:
        """A new (not yet connected) keep-alive connection to the target (or of ``transport``:
        it has the same ``connect``, ``connected`` and ``aclose``)."""
        if self.transport is not None:
            conn: HTTPConnection = self.transport()
            return conn
        return HTTPConnection(
            target.host,
            target.port,
            host_header=target.host_header,
            timeout=self.timeout_s,
            connect_timeout=self.connect_timeout_s,
        )


class Window:
    """The measurement window ``[start, end)``, counting the completions that fall inside it
    whatever their start: throughput is not diluted by the final drain (the wrk convention)."""

    __slots__ = ("done", "end", "ok", "start")

    def __init__(self, start: float, end: float) -> None:
        self.start = start
        self.end = end
        self.done = 0
        self.ok = 0

    def completed(self, at: float, ok: bool) -> None:
        if self.start <= at < self.end:
            self.done += 1
            self.ok += ok

    @property
    def length_s(self) -> float:
        return max(self.end - self.start, 0.0)


async def attempt(
    op: Operation,
    conn: HTTPConnection,
    k: int,
    budget_s: float,
    rec: Recorder,
    window: Window,
    measuring: bool,
) -> tuple[int, float] | None:
    """Perform unit of work ``k`` on ``conn``; return ``(status, end time)`` for the caller to
    record, or ``None`` when there was no response (then already recorded, and after a failed
    connect, backed off).  Warm-up work is only counted."""
    rec.in_flight += 1
    try:
        status = await op(conn, k, budget_s)
    except (HTTPClientError, OSError) as exc:
        rec.in_flight -= 1
        end = time.perf_counter()
        window.completed(end, False)
        if measuring:
            rec.record_error(exc, end)
        else:
            rec.warmup_done += 1
        if isinstance(exc, ConnectError):
            await asyncio.sleep(CONNECT_BACKOFF_S)
        return None
    rec.in_flight -= 1
    end = time.perf_counter()
    window.completed(end, 200 <= status < 300)
    if not measuring:
        rec.warmup_done += 1
    return status, end

"""One backoff helper for every loop: exponential delays up to a cap, health while failing,
and a log line per run of failures, not per retry."""

from __future__ import annotations

import asyncio

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError

from runtime.backoff import Backoff


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def warning(self, event: str, **_: object) -> None:
        self.lines.append(("warning", event))

    def info(self, event: str, **_: object) -> None:
        self.lines.append(("info", event))


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_delays_double_from_the_first_up_to_the_cap():
    b = Backoff("loop", Log(), first_s=0.001, cap_s=0.004)
    delays = []
    for _ in range(5):
        delays.append(b.delay_s)
        asyncio.run(b.failed(RedisConnectionError("refused")))
    assert delays == [0.001, 0.002, 0.004, 0.004, 0.004]


def test_a_success_makes_it_healthy_and_restarts_the_delays():
    b = Backoff("loop", Log(), first_s=0.001, cap_s=0.004)
    asyncio.run(b.failed(OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")))
    assert not b.healthy and b.failures == 1
    assert b.problem is not None and "out of memory" in b.problem
    b.succeeded()
    assert b.healthy and b.failures == 0 and b.delay_s == 0.001 and b.problem is None


def test_a_run_of_the_same_failure_is_logged_once_then_again_only_after_a_while():
    log, clock = Log(), Clock()
    b = Backoff("loop", log, clock=clock)
    for _ in range(10):
        b.record(RedisConnectionError("refused"))
    assert [level for level, _ in log.lines] == ["warning"]
    b.record(OutOfMemoryError("command not allowed"))  # a different trouble: said at once
    clock.now += 31
    b.record(OutOfMemoryError("command not allowed"))  # still failing, a while later
    b.succeeded()
    assert [level for level, _ in log.lines] == ["warning", "warning", "warning", "info"]
    assert "loop" in log.lines[0][1] and "unreachable" in log.lines[0][1]


def test_record_notes_a_failure_without_waiting():
    b = Backoff("loop", Log(), first_s=10.0)
    b.record(RedisConnectionError("refused"))
    assert not b.healthy and b.delay_s == 10.0

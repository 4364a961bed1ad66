"""The loops of a process: owned and cancelled together; a loop that fails is reported, and a
loop that ends with a bug is down and ends the process through ``on_fatal``."""

from __future__ import annotations

import asyncio

from redis.exceptions import ConnectionError as RedisConnectionError

from runtime.loops import Loops


class Log:
    def __init__(self) -> None:
        self.errors: list[str] = []

    def error(self, event: str, **_: object) -> None:
        self.errors.append(event)

    def warning(self, event: str, **_: object) -> None:
        pass

    def info(self, event: str, **_: object) -> None:
        pass


async def forever() -> None:
    await asyncio.Event().wait()


def test_a_loop_that_ends_with_a_bug_is_down_and_calls_on_fatal():
    fatal: list[str] = []
    log = Log()

    async def buggy() -> None:
        raise KeyError("oops")

    async def go() -> Loops:
        loops = Loops(log, on_fatal=fatal.append)
        loops.spawn("healthy", forever())
        loops.spawn("buggy", buggy())
        await asyncio.sleep(0.01)
        await loops.cancel()
        return loops

    loops = asyncio.run(go())
    assert fatal == ["loop 'buggy' ended: KeyError: 'oops'"]
    assert loops.problems() == ["buggy: down (KeyError: 'oops')"]
    assert "exiting" in log.errors[0] and "buggy" in log.errors[0]


def test_cancelling_loops_is_not_a_failure_even_when_a_loop_returns_instead_of_raising():
    fatal: list[str] = []

    async def returns_when_cancelled() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return  # as a loop does when redis-py turned the cancellation into an error

    async def go() -> Loops:
        loops = Loops(Log(), on_fatal=fatal.append)
        loops.spawn("a", forever())
        loops.spawn("b", returns_when_cancelled())
        await asyncio.sleep(0)
        await loops.cancel(["b"])
        await loops.cancel()
        return loops

    loops = asyncio.run(go())
    assert fatal == [] and loops.problems() == [] and loops.names() == []


def test_problems_name_failing_loops_and_readiness_can_ask_for_critical_ones_only():
    loops = Loops(Log())
    loops.backoff("replies").record(RedisConnectionError("refused"))
    loops.backoff("stream-gauges", critical=False).record(RedisConnectionError("refused"))
    loops.backoff("registry")
    assert loops.problems(critical_only=True) == ["replies: Redis is unreachable (refused)"]
    assert len(loops.problems()) == 2
    assert loops.health() == {"replies": False, "stream-gauges": False, "registry": True}
    assert loops.backoff("replies") is loops.backoff("replies")

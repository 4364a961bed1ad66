"""A process that cannot use its own Redis connections while Redis answers others exits after
``--redis-wedge-s`` (issue #21, defect 1); one whose Redis is down waits for it however long.

The watch runs on a fake broker and an injected clock; the integration test at the end wedges
a real pool (every connection taken) on a real Redis and sees the loop end with ``Wedged``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError

from inferq.redisserver import RedisServer
from runtime.backoff import Backoff
from runtime.broker import connect
from runtime.connections import RedisSettings
from runtime.loops import Loops
from runtime.wedge import Wedged, WedgeWatch, stuck_since
from tests.support import until

BOUND_S = 30.0


class Log:
    def warning(self, event: str, **_: object) -> None:
        pass

    def info(self, event: str, **_: object) -> None:
        pass

    def error(self, event: str, **_: object) -> None:
        pass


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


class Commands:
    def __init__(self) -> None:
        self.pool_error: Exception | None = None

    async def ping(self) -> bool:
        if self.pool_error is not None:
            raise self.pool_error
        return True


class FakeBroker:
    """The two questions the watch asks: PING through the pool, PING on a new connection."""

    def __init__(self) -> None:
        self.commands = Commands()
        self.afresh = True

    async def answers_afresh(self) -> bool:
        return self.afresh


class Setup:
    def __init__(self) -> None:
        self.clock = Clock()
        self.broker = FakeBroker()
        self.pool = Backoff("redis-pool", Log(), clock=self.clock)
        self.loop = Backoff("replies", Log(), clock=self.clock)
        self.quiet = Backoff("stats", Log(), critical=False, clock=self.clock)
        self.watch = WedgeWatch(
            self.broker,  # type: ignore[arg-type]
            self.pool,
            lambda: [self.pool, self.loop, self.quiet],
            bound_s=BOUND_S,
            clock=self.clock,
        )

    def check(self) -> None:
        asyncio.run(self.watch.check())

    def checks_for(self, seconds: float) -> None:
        """A check every second for ``seconds``."""
        for _ in range(int(seconds)):
            self.clock.now += 1.0
            self.check()


@pytest.fixture
def setup() -> Iterator[Setup]:
    yield Setup()


def no_connection() -> RedisConnectionError:
    return RedisConnectionError("No connection available.")


def test_an_exhausted_pool_while_redis_answers_is_wedged_after_the_bound(setup):
    setup.broker.commands.pool_error = no_connection()
    setup.check()
    assert setup.pool.problem is not None  # readiness says so from the first check
    setup.checks_for(BOUND_S - 1)
    with pytest.raises(Wedged, match="redis-pool: Redis is unreachable"):
        setup.checks_for(2)


def test_a_critical_loop_failing_to_connect_while_redis_answers_is_wedged(setup):
    setup.loop.record(RedisConnectionError("Timeout reading from socket"))
    setup.checks_for(BOUND_S - 1)
    with pytest.raises(Wedged, match="replies"):
        setup.checks_for(2)


def test_a_redis_that_is_down_is_waited_for_however_long(setup):
    setup.broker.afresh = False
    setup.broker.commands.pool_error = RedisConnectionError("Connection refused")
    setup.loop.record(RedisConnectionError("Connection refused"))
    setup.checks_for(10 * BOUND_S)  # no Wedged


def test_the_bound_counts_from_when_redis_answers_again(setup):
    """Down for a long while, then back: the loops recover within the bound, no exit."""
    setup.broker.afresh = False
    setup.loop.record(RedisConnectionError("Connection refused"))
    setup.checks_for(5 * BOUND_S)
    setup.broker.afresh = True
    setup.checks_for(BOUND_S - 2)
    setup.loop.succeeded()
    setup.checks_for(5 * BOUND_S)
    assert setup.watch.answering_since is None


def test_a_pool_that_serves_again_resets_the_watch(setup):
    setup.broker.commands.pool_error = no_connection()
    setup.checks_for(BOUND_S - 2)
    setup.broker.commands.pool_error = None
    setup.check()
    assert setup.pool.healthy and setup.watch.answering_since is None
    setup.broker.commands.pool_error = no_connection()
    setup.checks_for(BOUND_S - 2)  # a fresh run of failures: the bound starts again


class CancelledMidPing(Commands):
    """A PING that turns the cancellation arriving while it waits into a ConnectionError, as
    redis-py can."""

    def __init__(self) -> None:
        super().__init__()
        self.pinging = asyncio.Event()

    async def ping(self) -> bool:
        if self.pinging.is_set():
            raise RuntimeError("pinged again after its cancellation")  # ends the loop
        self.pinging.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise RedisConnectionError("Connection closed by server.") from None
        return True


def test_a_cancellation_that_redis_py_turns_into_a_connection_error_still_ends_the_watch(setup):
    commands = CancelledMidPing()
    setup.broker.commands = commands  # type: ignore[assignment]
    setup.watch._interval_s = 0

    async def scenario() -> None:
        task = asyncio.create_task(setup.watch.run())
        await asyncio.wait_for(commands.pinging.wait(), 5)
        task.cancel()
        # Under ``while True`` the watch recorded the error and pinged again, for good: a
        # gateway's shutdown, which awaits every loop, never ended.
        (ended,) = await asyncio.gather(task, return_exceptions=True)
        assert ended is None or isinstance(ended, asyncio.CancelledError), ended

    asyncio.run(scenario())
    assert setup.pool.problem is not None  # the error was recorded, then the loop ended


def test_refusals_that_are_not_connection_faults_never_count(setup):
    """Out of memory is Redis refusing writes: a restart would not help."""
    setup.loop.record(OutOfMemoryError("command not allowed when used memory > 'maxmemory'"))
    setup.quiet.record(RedisConnectionError("Connection refused"))  # not critical
    setup.checks_for(3 * BOUND_S)


def test_stuck_since_is_the_oldest_critical_connection_failure(setup):
    setup.loop.record(RedisConnectionError("reset"))
    setup.clock.now += 5
    setup.pool.record(no_connection())
    assert stuck_since([setup.pool, setup.loop, setup.quiet]) == setup.clock.now - 5
    setup.loop.succeeded()
    assert stuck_since([setup.pool, setup.loop]) == setup.clock.now


@pytest.mark.integration
def test_a_real_pool_held_by_stranded_connections_ends_the_loop_as_a_crash():
    """Every pooled connection taken and never given back (what the redis-py leak does): the
    watch's PING finds no connection, a new one answers, and after the bound the loop ends
    with ``Wedged``, which ``Loops`` reports through ``on_fatal``."""

    async def go(server: RedisServer) -> tuple[list[str], list[str]]:
        settings = RedisSettings(url=server.url, socket_timeout_s=0.2, pool_size=2)
        broker = await connect(settings, name="wedge-test")
        fatal: list[str] = []
        loops = Loops(Log(), on_fatal=fatal.append)
        pool = broker.commands.connection_pool
        stranded = [await pool.get_connection() for _ in range(settings.pool_size)]
        watch = WedgeWatch(
            broker, loops.backoff("redis-pool"), loops.backoffs, bound_s=0.5, interval_s=0.05
        )
        loops.spawn("redis-pool", watch.run())
        try:
            await until(lambda: fatal, 10, "the watch to end its loop")
            problems = loops.problems(critical_only=True)
        finally:
            await loops.cancel()
            for connection in stranded:
                await pool.release(connection)
            await broker.aclose()
        return fatal, problems

    with RedisServer() as server:
        fatal, problems = asyncio.run(go(server))
    assert len(fatal) == 1 and "Wedged" in fatal[0] and "No connection available" in fatal[0]
    assert any(p.startswith("redis-pool: down") for p in problems)  # readiness: 503 for good

"""How the batch runner collects its lines' ends: a few round trips of bounded size, oldest
first, with the event loop free between two (``BatchRunner._collect``). The clock is passed in
and Redis is a recorder, so nothing here sleeps."""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace
from typing import Any

from producer.batchrunner import COLLECT_AT_ONCE, FULL_COLLECT_S, BatchRunner, Driven
from producer.metrics import GatewayMetrics
from protocol.keys import Keys

KEYS = Keys("t")


class Recorder:
    """Redis as the collection sees it: a job whose key is in ``running`` is running, any other
    is gone (answered as lost, which needs no job record). Records each round trip's commands
    and how often the event loop ran other work before it."""

    def __init__(self) -> None:
        self.running: set[str] = set()
        self.round_trips: list[tuple[str, int, int]] = []
        """(command, how many, ``others_ran`` at the time)."""
        self.others_ran = 0

    def pipeline(self, transaction: bool = False) -> Pipeline:
        return Pipeline(self)


class Pipeline:
    def __init__(self, redis: Recorder) -> None:
        self.redis = redis
        self.ops: list[tuple[str, str]] = []

    def hget(self, key: str, field: str) -> None:
        self.ops.append(("hget", key))

    def hgetall(self, key: str) -> None:
        self.ops.append(("hgetall", key))

    def hsetnx(self, key: str, field: Any, value: bytes) -> None:
        self.ops.append(("hsetnx", key))

    async def execute(self) -> list[Any]:  # never yields: only _collect's own yields count
        r = self.redis
        r.round_trips.append((self.ops[0][0], len(self.ops), r.others_ran))
        replies = {
            "hget": lambda k: b"running" if k in r.running else None,
            "hgetall": lambda k: {},
        }
        return [replies.get(op, lambda k: 1)(key) for op, key in self.ops]


def runner(redis: Recorder) -> BatchRunner:
    broker = SimpleNamespace(commands=redis, script=lambda text: None)
    return BatchRunner(
        SimpleNamespace(keys=KEYS, clock=None),  # type: ignore[arg-type]
        SimpleNamespace(inference=SimpleNamespace(pipeline=SimpleNamespace(broker=broker))),  # type: ignore[arg-type]
        "g1",
        GatewayMetrics(),
        None,  # type: ignore[arg-type]
    )


def driven(lines: int) -> Driven:
    return Driven(in_flight={n: (f"j{n}", f"c{n}") for n in range(lines)})


def status_asks(redis: Recorder) -> list[int]:
    return [count for command, count, _ in redis.round_trips if command == "hget"]


async def collect(run: BatchRunner, d: Driven, now: float) -> None:
    """``_collect`` beside a task that counts how often the loop runs something else."""
    redis = run._redis

    async def other() -> None:
        while True:
            redis.others_ran += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(other())
    await asyncio.sleep(0)
    try:
        await run._collect(SimpleNamespace(id="b1"), d, now)  # type: ignore[arg-type]
    finally:
        task.cancel()


def test_a_collection_asks_a_bounded_group_a_round_trip_and_lets_requests_run_between():
    redis = Recorder()
    d = driven(3 * COLLECT_AT_ONCE + 10)
    redis.running = {KEYS.job(job) for job, _ in d.in_flight.values()}
    run = runner(redis)
    asyncio.run(collect(run, d, now=0.0))  # the first collection looks at every line
    assert status_asks(redis) == [COLLECT_AT_ONCE] * 3 + [10]
    seen = [others for command, _, others in redis.round_trips if command == "hget"]
    assert all(b > a for a, b in itertools.pairwise(seen)), seen  # the loop ran between two
    assert len(d.in_flight) == 3 * COLLECT_AT_ONCE + 10  # nothing ended, nothing answered


def test_the_look_stops_at_the_first_group_where_none_ended_until_a_full_sweep_is_due():
    redis = Recorder()
    d = driven(4 * COLLECT_AT_ONCE)
    run = runner(redis)
    redis.running = {KEYS.job(job) for job, _ in d.in_flight.values()}
    asyncio.run(collect(run, d, now=10.0))  # full: swept at 10.0
    # The oldest group and a part of the next ended, and one line far behind them.
    late = 3 * COLLECT_AT_ONCE + 5
    ended = [*range(COLLECT_AT_ONCE + 40), late]
    redis.running -= {KEYS.job(f"j{n}") for n in ended}
    redis.round_trips.clear()

    asyncio.run(collect(run, d, now=10.0 + FULL_COLLECT_S / 2))
    # Group 1 (all ended), group 2 (40 ended), group 3 (none): stop there.
    assert status_asks(redis) == [COLLECT_AT_ONCE] * 3
    assert late in d.in_flight
    assert not any(n in d.in_flight for n in ended if n != late)

    redis.round_trips.clear()
    asyncio.run(collect(run, d, now=10.0 + FULL_COLLECT_S))  # a full sweep is due
    assert late not in d.in_flight
    assert len(status_asks(redis)) == 3  # every group left, though the first had none ended

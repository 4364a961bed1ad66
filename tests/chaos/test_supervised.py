"""Supervised restarts under ``inferq up``: under load, SIGKILL a worker (while it holds
entries) and then a gateway; ``inferq up`` replaces both, and every request is answered.

The stack is the real command: two gateways on one port, two workers, the suite's Redis. The
client reopens a connection that a killed gateway reset and resends a request that got no byte
of an answer, once, as HTTP clients do; those resends are counted."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from protocol.keys import GROUP, Keys, Lane
from tests.chaos.accounting import Tally, held_by, pending
from tests.chaos.conftest import ChaosRepo
from tests.chaos.traffic import send
from tests.support import wait_until
from tests.upstack import UpProcess, up_processes

# serial: kills supervised processes under load.
pytestmark = [pytest.mark.timeout(240), pytest.mark.serial]

TOTAL = 2_000
CONCURRENCY = 32


@pytest.fixture
def up(redis_url: str, namespace: str, chaos_repo: ChaosRepo) -> Iterator[Callable[..., UpProcess]]:
    with up_processes(redis_url, namespace, chaos_repo.path, "--models", "chaos") as start:
        yield start


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _consumer_of(r: redis.Redis, stream: str, slot: int) -> str:
    """The consumer name of ``inferq up``'s worker ``slot`` (it ends in ``-{slot}``)."""
    names = [c["name"].decode() for c in r.xinfo_consumers(stream, GROUP)]
    (name,) = [n for n in names if n.endswith(f"-{slot}")]
    return name


def test_a_killed_worker_and_a_killed_gateway_under_load_are_replaced_and_all_answered(
    up, chaos_repo, redis_url, namespace, capsys
):
    u = up("--workers", "2", "--gateways", "2")
    u.wait_ready()
    stream = Keys(namespace).stream("chaos", Lane.NORMAL)
    r = redis.Redis.from_url(redis_url)
    u.wait_for(lambda: len(r.xinfo_consumers(stream, GROUP)) == 2, "both workers reading")
    worker0 = _consumer_of(r, stream, 0)
    tally = Tally()
    held: list[str] = []
    kills: dict[str, float] = {}

    def chaos(t: Tally) -> None:
        if "worker" not in kills and t.completed >= TOTAL // 4:
            pid = u.pid("worker 0")
            os.kill(pid, signal.SIGSTOP)  # frozen: what it holds now is what it dies with
            now_held = held_by(r, stream, worker0)
            if not now_held:
                os.kill(pid, signal.SIGCONT)
                return
            os.kill(pid, signal.SIGKILL)
            # Read again once it is gone (a blocked read it sent before the stop may have been
            # handed entries since); its replacement takes a second or more to start reading.
            wait_until(lambda: not _alive(pid), 10, "the worker gone")
            held.extend(held_by(r, stream, worker0))
            kills["worker"] = time.monotonic()
        elif "worker" in kills and "gateway" not in kills and t.completed >= TOTAL // 2:
            os.kill(u.pid("gateway 0"), signal.SIGKILL)
            kills["gateway"] = time.monotonic()

    resent = asyncio.run(send(u.url, "chaos", TOTAL, CONCURRENCY, tally, on_progress=chaos))
    u.wait_for(lambda: len(u.events("child restarted")) == 2, "both replaced")
    # All recover: the new processes serve, and nothing stays pending.
    after = Tally()
    asyncio.run(send(u.url, "chaos", 200, 8, after, first=TOTAL))
    wait_until(lambda: pending(r, stream) == 0, 30, "nothing pending")
    r.close()
    tally.count_executions(chaos_repo.runs("chaos"))
    held_ok = sum(1 for i in held if tally.outcomes[i].correct)
    restarts = {e["child"]: e["restarts"] for e in u.events("child restarted")}
    assert u.stop() == 0
    with capsys.disabled():
        print(
            "\n"
            + tally.line(
                "17 supervised restarts",
                held_by_killed_worker=len(held),
                held_answered_correctly=held_ok,
                client_resends=resent,
                restarts=sum(restarts.values()),
                after_recovery=f"{after.correct}/{after.sent}",
            )
        )
    assert restarts == {"worker 0": 1, "gateway 0": 1}
    assert "inferq up: stopped; 2 restart(s) (worker 0: 1, gateway 0: 1)" in u.lines
    assert tally.lost == 0 and tally.sent == TOTAL
    assert tally.correct + sum(tally.refused.values()) == TOTAL and not tally.other, tally.reasons
    # The replacement worker (same consumer name) ran what the killed one held.
    assert len(held) >= 1 and held_ok == len(held)
    # Only what the killed worker held, or what a killed gateway had queued when its client
    # resent it, can have run twice.
    assert tally.executed_twice <= len(held) + resent
    assert after.correct == after.sent == 200

"""``inferq up --workers MIN:MAX`` follows demand with real processes: at ``0:2`` an idle stack
runs no worker, the first request waits through a cold start and gets its answer, a burst
starts both workers, idleness stops both; scaling in under load drains. Every request has its
own id and input; each is counted once answered and once executed (the simulated model
records every row it runs), so a lost or doubled request fails the test."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis

from inferq.redisserver import free_port
from protocol.keys import Keys
from tests.chaos.accounting import is_correct, read_executions, request_body, request_id
from tests.support import write_simulated_model
from tests.upstack import UpProcess, up_processes

# serial: scales on windows of 0.2 s and 1 s.
pytestmark = [pytest.mark.timeout(240), pytest.mark.serial]

FAST = ("--scale-interval-s", "0.2", "--scale-down-after-s", "1", "--scale-up-cooldown-s", "1")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    # Batches of 2 rows that take 150 ms: a burst of a few dozen keeps one worker busy for
    # seconds, long enough for the second to start.
    write_simulated_model(
        tmp_path / "repo",
        "work",
        base_ms=150,
        per_row_ms=0,
        max_batch=2,
        executions_dir=tmp_path / "runs",
    )
    return tmp_path / "repo"


@pytest.fixture
def up(redis_url: str, namespace: str, repo: Path) -> Iterator[Callable[..., UpProcess]]:
    with up_processes(redis_url, namespace, repo, "--models", "work", *FAST) as start:
        yield start


def post(client: httpx.Client, i: int) -> tuple[int, bool]:
    r = client.post(
        "/v2/models/work/infer",
        content=request_body(i),
        headers={"content-type": "application/json"},
    )
    return r.status_code, r.status_code == 200 and is_correct(i, r.json())


def burst(url: str, ids: range, clients: int = 16) -> dict[str, tuple[int, bool]]:
    with httpx.Client(base_url=url, timeout=30) as c, ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(lambda i: post(c, i), ids))
    return {request_id(i): a for i, a in zip(ids, answers, strict=True)}


def scaled(u: UpProcess, direction: str, **match: object) -> list[dict[str, object]]:
    return u.events(f"scaling {direction}", **match)


def stopped(u: UpProcess, child: str) -> int:
    return len(u.events("child stopped", child=child))


def live_workers(redis_url: str, namespace: str) -> int:
    r = redis.Redis.from_url(redis_url)
    try:
        now_ms = int(time.time() * 1000)
        return int(r.zcount(Keys(namespace).workers, now_ms, "+inf"))
    finally:
        r.close()


def test_a_stack_at_0_2_scales_to_zero_serves_a_cold_request_and_a_burst_then_idles_to_zero(
    up, redis_url, namespace, tmp_path
):
    port = free_port()
    u = up("--workers", "0:2", "--scale-backlog-per-worker", "2", "--scale-metrics-port", str(port))
    u.wait_ready()
    # Idle: the worker started with the stack (to advertise the models) is stopped.
    u.wait_for(lambda: scaled(u, "down", workers_wanted=0, reason="idle"), "scaled to zero")
    u.wait_for(lambda: stopped(u, "worker 0") == 1, "worker 0 stopped")
    u.wait_for(lambda: live_workers(redis_url, namespace) == 0, "no live worker")

    # The first request at zero: queued (not 503), a cold start, the right answer.
    first = burst(u.url, range(0, 1), clients=1)
    assert first == {request_id(0): (200, True)}
    cold = scaled(u, "up", reason="cold start")
    assert len(cold) == 1 and cold[0]["workers_wanted"] == 1

    # A burst: both workers run it.
    answers = burst(u.url, range(1, 121))
    assert sorted(answers.values()) == [(200, True)] * 120
    assert scaled(u, "up", workers_wanted=2)
    assert u.events("child started", child="worker 1", scaled=True)

    # Idle again: both stop.
    u.wait_for(lambda: stopped(u, "worker 0") == 2, "worker 0 stopped again")
    u.wait_for(lambda: stopped(u, "worker 1") == 1, "worker 1 stopped")
    assert all(not e["killed"] for e in u.events("child stopped"))
    runs = read_executions(tmp_path / "runs")
    assert runs == {request_id(i): 1 for i in range(121)}  # none lost, none run twice

    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    assert 'inferq_up_scaling_events_total{direction="up",reason="cold start"} 1.0' in metrics
    assert "inferq_up_workers_wanted 0.0" in metrics
    assert "inferq_up_workers_running 0.0" in metrics
    assert u.stop() == 0


def test_scaling_in_under_load_drains_what_the_stopped_worker_holds(up, tmp_path):
    u = up("--workers", "1:2", "--scale-backlog-per-worker", "4")
    u.wait_ready()
    answers: dict[str, tuple[int, bool]] = {}
    done = threading.Event()

    def trickle() -> None:
        # About one request per 100 ms, which one worker keeps up with (13 a second).
        i = 1000
        with httpx.Client(base_url=u.url, timeout=30) as c:
            while not done.is_set() and i < 1300:  # bounded
                answers[request_id(i)] = post(c, i)
                i += 1
                done.wait(0.1)

    feeder = threading.Thread(target=trickle)
    feeder.start()
    try:
        answers.update(burst(u.url, range(0, 80)))
        u.wait_for(lambda: scaled(u, "up", workers_wanted=2), "scaled up")
        u.wait_for(lambda: u.events("child started", child="worker 1"), "worker 1 started")
        second = u.pid("worker 1")
        # The trickle goes on while the second worker is scaled in: it drains under load.
        u.wait_for(lambda: stopped(u, "worker 1") == 1, "worker 1 scaled in", timeout_s=90)
        sent_before = len(answers)
        u.wait_for(lambda: len(answers) >= sent_before + 10, "more requests after the scale-in")
    finally:
        done.set()
        feeder.join(60)
    assert scaled(u, "down", workers_wanted=1)
    assert not any(e["killed"] for e in u.events("child stopped"))
    bad = {k: v for k, v in answers.items() if v != (200, True)}
    assert bad == {}
    runs = read_executions(tmp_path / "runs")
    assert runs == dict.fromkeys(answers, 1)
    assert (tmp_path / "runs" / f"{second}.rows").read_text()  # the scaled-in worker had work
    assert u.stop() == 0

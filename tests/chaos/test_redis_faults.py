"""Chaos with Redis itself: out of memory under load with jobs in flight, an evicting Redis,
and a restart that loses every key. Each scenario counts, per request id (``accounting.py``),
the 200s that carry the correct answer, the 429/503/504 refusals by kind, requests never
answered, and how often the workers executed each id; then asserts bounds on them.
``pytest -s`` prints one figure line per scenario, with measured values only.

Each scenario runs its own ``redis-server`` (its config is changed, or it is restarted) and an
in-process gateway and workers (their per-id execution counts are read directly).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from inferq.redisserver import RedisServer
from tests.chaos.accounting import Tally
from tests.chaos.traffic import send
from tests.support import Stack, WorkerThread, wait_until, write_simulated_model

# serial: restarts Redis on the port it freed and bounds the recovery.
pytestmark = [pytest.mark.integration, pytest.mark.serial]

TIMEOUT_US = 5_000_000
"""Each request's deadline (the V2 ``timeout`` parameter) unless a scenario says otherwise."""


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("redis-chaos-models")
    write_simulated_model(folder, "chaos", base_ms=20, per_row_ms=0.1, max_batch=16)
    return folder


@pytest.fixture
def redis_and_stack(
    namespace: str, repo: Path
) -> Iterator[Callable[..., tuple[RedisServer, Stack]]]:
    """``make(workers, *redis_args)``: a private redis-server and a gateway and workers on it;
    at the end the stack stops first (draining into Redis), then Redis."""
    started: list[Any] = []
    servers: list[RedisServer] = []

    def make(workers: int, *redis_args: str) -> tuple[RedisServer, Stack]:
        server = RedisServer(extra_args=redis_args).start()
        servers.append(server)
        s = Stack(server.url, namespace, repo, started)
        for _ in range(workers):
            s.add_worker(("chaos",), claim_idle_ms=2000, heartbeat_s=0.5)
        s.start_gateway(heartbeat_s=0.5)
        s.wait_ready("chaos")
        return server, s

    yield make
    for thing in reversed(started):
        thing.stop()
    for server in servers:
        server.stop()


def executions(workers: list[WorkerThread]) -> Counter[str]:
    """How often each request id ran, over every worker (ids are unique per request)."""
    return Counter(rid for w in workers for rid in w.stats.executed)


def submit_jobs(s: Stack, n: int) -> dict[str, int]:
    """Job id -> its input value."""
    jobs = {}
    with s.client() as c:
        for i in range(n):
            doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [i] * 4}]}
            r = c.post("/v2/models/chaos/jobs", json=doc)
            assert r.status_code == 202, r.text
            jobs[r.json()["id"]] = i
    return jobs


def final_jobs(s: Stack, jobs: dict[str, int], timeout_s: float = 30) -> dict[str, str]:
    """Each job's end: 'correct', 'wrong', another final status, or an HTTP status (410)."""
    ends: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    with s.client() as c:
        while len(ends) < len(jobs) and time.monotonic() < deadline:
            for job_id, i in jobs.items():
                if job_id in ends:
                    continue
                r = c.get(f"/v2/jobs/{job_id}", params={"wait": 1})
                if r.status_code != 200:
                    if r.status_code != 503:  # Redis not back yet: ask again
                        ends[job_id] = str(r.status_code)
                    continue
                doc = r.json()
                if doc["status"] == "succeeded":
                    right = doc["result"]["outputs"][0]["data"] == [4.0 * i]
                    ends[job_id] = "correct" if right else "wrong"
                elif doc["status"] in ("failed", "expired", "cancelled"):
                    ends[job_id] = doc["status"]
    return ends


def test_redis_out_of_memory_under_load_with_jobs_in_flight_loses_nothing_accepted(
    redis_and_stack, capsys
):
    """maxmemory 1 with noeviction for two seconds mid-load: requests Redis refused get 503
    at once, everything accepted is answered correctly and runs once, every job succeeds, and
    readiness says 503 while it lasts."""
    server, s = redis_and_stack(2)
    jobs = submit_jobs(s, 150)
    count = Tally()
    events: dict[str, float] = {}
    ready_during: list[int] = []
    r = redis.Redis.from_url(server.url)

    def oom_once(c: Tally) -> None:
        if "oom" not in events and c.completed >= 200:
            r.config_set("maxmemory", 1)
            events["oom"] = time.monotonic()

    def lift() -> None:
        wait_until(lambda: "oom" in events, 60, "the out-of-memory spell")
        with httpx.Client(base_url=s.url, timeout=5) as c:
            wait_until(lambda: c.get("/v2/health/ready").status_code == 503, 5, "ready to fail")
            ready_during.append(503)
        time.sleep(2.0)  # the scenario: Redis refuses writes for two seconds
        r.config_set("maxmemory", 0)
        events["lifted"] = time.monotonic()

    lifter = threading.Thread(target=lift)
    lifter.start()
    asyncio.run(send(s.url, "chaos", 600, 16, count, on_progress=oom_once, timeout=TIMEOUT_US))
    lifter.join()
    after = Tally()
    asyncio.run(send(s.url, "chaos", 200, 16, after, first=10_000, timeout=TIMEOUT_US))
    ends = final_jobs(s, jobs)
    runs = executions(s.workers)
    count.count_executions(runs)
    refused = sum(
        w.worker.metrics.registry.get_sample_value(
            "inferq_worker_write_failures_total", {"model": "chaos", "reason": "oom"}
        )
        or 0
        for w in s.workers
    )
    r.close()
    with capsys.disabled():
        print(
            "\n"
            + count.line(
                "13 redis oom",
                jobs=len(jobs),
                jobs_correct=sum(1 for e in ends.values() if e == "correct"),
                jobs_executed_twice=sum(1 for j in jobs if runs[j] > 1),
                worker_writes_refused=int(refused),
                oom_s=f"{events['lifted'] - events['oom']:.1f}",
                after_sent=after.sent,
                after_correct_200=after.correct,
            )
        )
    statuses = count.statuses
    assert count.unanswered == 0 and count.wrong == 0
    assert set(statuses) <= {200, 503}, statuses  # refused at once, or answered: never a 504
    assert statuses[503] > 0 and ready_during == [503]  # the spell did refuse requests
    assert count.correct == statuses[200] >= 200
    assert max(runs.values()) == 1  # nothing ran twice
    assert after.correct == after.sent == 200  # and service is back
    assert list(ends.values()) == ["correct"] * len(jobs), Counter(ends.values())
    assert all(runs[j] == 1 for j in jobs)


def test_an_evicting_redis_under_memory_pressure_keeps_serving_and_recovers(
    redis_and_stack, namespace, capsys
):
    """allkeys-random with maxmemory reached evicts any key, inferq's included (request and
    reply streams, groups, advertisements). Nothing hangs, nothing wrong is answered, nothing
    runs twice, no worker exits; once the pressure ends every request succeeds again."""
    server, s = redis_and_stack(2, "--maxmemory-policy", "allkeys-random")
    r = redis.Redis.from_url(server.url)
    used = int(r.info("memory")["used_memory"])
    r.config_set("maxmemory", used + 2 * 1024 * 1024)
    stop = threading.Event()

    def fill() -> None:  # another tenant of the same Redis, writing without pause
        written = 0
        with redis.Redis.from_url(server.url) as other:
            while not stop.is_set():
                pipe = other.pipeline(transaction=False)
                for _ in range(50):
                    pipe.set(f"filler:{written}", b"x" * 2048)
                    written += 1
                pipe.execute()
                time.sleep(0.01)

    filler = threading.Thread(target=fill)
    filler.start()
    count = Tally()
    try:
        asyncio.run(send(s.url, "chaos", 600, 16, count, timeout=3_000_000))
    finally:
        stop.set()
        filler.join()
    evicted = int(r.info("stats")["evicted_keys"])
    for key in r.scan_iter(match="filler:*", count=1000):
        r.delete(key)
    r.config_set("maxmemory", 0)
    # The last evictions may have taken the workers' advertisements (they did in CI, and
    # readiness said ready from an older view): take them, so that every run checks it.
    for key in r.scan_iter(match=f"{namespace}:*:worker:*"):
        r.delete(key)
    after = Tally()
    # The service comes back by itself: workers re-advertise, streams and groups are made
    # again. Then every request is served.
    with httpx.Client(base_url=s.url, timeout=10) as c:
        wait_until(lambda: c.get("/v2/health/ready").status_code == 200, 20, "ready again")
        scrape = c.get("/metrics").text
    asyncio.run(send(s.url, "chaos", 100, 8, after, first=10_000, timeout=TIMEOUT_US))
    runs = executions(s.workers)
    count.count_executions(runs)
    alive = all(w.worker.started.is_set() and not w.worker.stopping for w in s.workers)
    recreated = sum(w.stats.recreated for w in s.workers)
    r.close()
    with capsys.disabled():
        print(
            "\n"
            + count.line(
                "14 evicting redis",
                evicted_keys=evicted,
                streams_recreated=recreated,
                after_sent=after.sent,
                after_correct_200=after.correct,
                workers_alive=alive,
                statuses=dict(sorted(count.statuses.items())),
            )
        )
        print("during:\n" + count.failure_lines())
        print("after readiness said ready:\n" + after.failure_lines())
    statuses = count.statuses
    assert evicted > 0  # the pressure did evict
    assert count.unanswered == 0 and count.wrong == 0
    assert set(statuses) <= {200, 503, 504}, statuses
    assert count.correct == statuses[200] > 0
    assert max(runs.values()) == 1
    assert alive
    assert after.correct == after.sent == 100, (after.statuses, after.reasons)
    assert 'inferq_redis_evicting{policy="allkeys-random"} 1.0' in scrape


def test_a_redis_restart_that_loses_every_key_fails_waiters_fast_and_serves_again(
    redis_and_stack, capsys
):
    """redis-server restarted empty (no persistence) mid-load: requests it lost fail with 503
    at once rather than at their 20 s deadlines, nothing hangs or runs twice, jobs it lost
    answer 410 Gone, and service resumes by itself."""
    server, s = redis_and_stack(1)  # one worker holds at most 32: the rest wait in Redis
    jobs = submit_jobs(s, 50)
    count = Tally()
    events: dict[str, float] = {}

    def restart_once(c: Tally) -> None:
        if "down" not in events and c.completed >= 200:
            events["down"] = time.monotonic()
            threading.Thread(target=restart).start()

    def restart() -> None:
        server.kill()
        time.sleep(1.0)  # Redis is down for a second
        server.start()  # same port, no data
        events["up"] = time.monotonic()

    asyncio.run(send(s.url, "chaos", 600, 64, count, timeout=20_000_000, on_progress=restart_once))
    wait_until(lambda: "up" in events, 30, "the restart")
    after = Tally()
    with httpx.Client(base_url=s.url, timeout=10) as c:
        wait_until(lambda: c.get("/v2/health/ready").status_code == 200, 20, "ready again")
    asyncio.run(send(s.url, "chaos", 200, 16, after, first=10_000, timeout=TIMEOUT_US))
    ends = final_jobs(s, jobs)
    runs = executions(s.workers)
    count.count_executions(runs)
    assert s.gateway is not None
    lost = s.gateway.gateway.replies.lost
    with capsys.disabled():
        print(
            "\n"
            + count.line(
                "15 redis restart, data lost",
                failed_as_lost=lost,
                jobs=len(jobs),
                jobs_correct=sum(1 for e in ends.values() if e == "correct"),
                jobs_gone_410=sum(1 for e in ends.values() if e == "410"),
                down_s=f"{events['up'] - events['down']:.1f}",
                after_sent=after.sent,
                after_correct_200=after.correct,
            )
        )
        print("during:\n" + count.failure_lines())
        print("after:\n" + after.failure_lines())
    statuses = count.statuses
    assert count.unanswered == 0 and count.wrong == 0
    assert set(statuses) <= {200, 503}, statuses  # lost ones fail at once: no 20 s 504s
    assert lost > 0  # some were waiting in Redis when it lost them: failed, not left to wait
    assert count.correct == statuses[200] >= 200
    assert max(runs.values()) == 1
    assert after.correct == after.sent == 200
    assert set(ends.values()) <= {"correct", "410"}, Counter(ends.values())
    assert len(ends) == len(jobs)

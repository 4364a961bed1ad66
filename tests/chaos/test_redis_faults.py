"""Chaos with Redis itself: out of memory under load with jobs in flight, an evicting Redis, and
a restart that loses every key. Each scenario counts, per request id, the 200s that carry the
correct answer, the 429/503/504 refusals by kind, requests never answered (hung), and how often
the workers executed each id; then asserts bounds on them. ``pytest -s`` prints one figure line
per scenario, with measured values only.

Each scenario runs its own ``redis-server`` (its config is changed, or it is restarted) and an
in-process gateway and workers (their per-id execution counts are read directly).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from inferq.redisserver import RedisServer
from loadgen.http import HTTPClientError, HTTPConnection
from tests.support import Stack, WorkerThread, wait_until, write_simulated_model

pytestmark = pytest.mark.integration


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


@dataclass
class Count:
    """Per request id: what the client got, and how often the workers ran it."""

    sent: int = 0
    status: dict[str, int] = field(default_factory=dict)
    correct: set[str] = field(default_factory=set)
    wrong: int = 0

    def record(self, rid: str, status: int, ok: bool) -> None:
        self.status[rid] = status
        if status == 200:
            if ok:
                self.correct.add(rid)
            else:
                self.wrong += 1

    def by_status(self) -> Counter[int]:
        return Counter(self.status.values())

    @property
    def hung(self) -> int:
        return self.sent - len(self.status)

    def line(self, name: str, executions: Counter[str], **extra: object) -> str:
        s = self.by_status()
        twice = sum(1 for n in executions.values() if n > 1)
        figures = " ".join(f"{k}={v}" for k, v in extra.items())
        return (
            f"chaos[{name}]: sent={self.sent} correct_200={len(self.correct)} "
            f"refused_429={s[429]} unavailable_503={s[503]} deadline_504={s[504]} "
            f"other={sum(n for code, n in s.items() if code not in (200, 429, 503, 504))} "
            f"wrong={self.wrong} hung={self.hung} executed_twice={twice} {figures}"
        ).strip()


def executions(workers: list[WorkerThread]) -> Counter[str]:
    """How often each request id ran, over every worker (ids are unique per request)."""
    return Counter(rid for w in workers for rid in w.stats.executed)


def body(i: int, timeout_us: int) -> bytes:
    return json.dumps(
        {
            "id": f"req-{i}",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [i] * 4}],
            "parameters": {"timeout": timeout_us},
        }
    ).encode()


async def load(
    url: str,
    n: int,
    concurrency: int,
    count: Count,
    *,
    timeout_us: int = 5_000_000,
    on_progress: Callable[[Count], None] | None = None,
    first: int = 0,
) -> None:
    """Send requests first..first+n-1, one try each; record every answer against its id."""
    host, port = url.removeprefix("http://").split(":")
    ids = iter(range(first, first + n))

    async def lane() -> None:
        async with HTTPConnection(host, int(port), timeout=30) as conn:
            for i in ids:
                count.sent += 1
                try:
                    r = await conn.request(
                        "POST",
                        "/v2/models/chaos/infer",
                        body(i, timeout_us),
                        {"content-type": "application/json"},
                    )
                except HTTPClientError:
                    continue  # no answer at all: counted as hung
                ok = r.status == 200 and r.json()["outputs"][0]["data"] == [4.0 * i]
                count.record(f"req-{i}", r.status, ok)
                if on_progress is not None:
                    on_progress(count)

    await asyncio.gather(*(lane() for _ in range(concurrency)))


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
    count = Count()
    events: dict[str, float] = {}
    ready_during: list[int] = []
    r = redis.Redis.from_url(server.url)

    def oom_once(c: Count) -> None:
        if "oom" not in events and len(c.status) >= 200:
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
    asyncio.run(load(s.url, 600, 16, count, on_progress=oom_once))
    lifter.join()
    after = Count()
    asyncio.run(load(s.url, 200, 16, after, first=10_000))
    ends = final_jobs(s, jobs)
    runs = executions(s.workers)
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
                runs,
                jobs=len(jobs),
                jobs_correct=sum(1 for e in ends.values() if e == "correct"),
                jobs_executed_twice=sum(1 for j in jobs if runs[j] > 1),
                worker_writes_refused=int(refused),
                oom_s=f"{events['lifted'] - events['oom']:.1f}",
                after_sent=after.sent,
                after_correct_200=len(after.correct),
            )
        )
    statuses = count.by_status()
    assert count.hung == 0 and count.wrong == 0
    assert set(statuses) <= {200, 503}, statuses  # refused at once, or answered: never a 504
    assert statuses[503] > 0 and ready_during == [503]  # the spell did refuse requests
    assert len(count.correct) == statuses[200] >= 200
    assert max(runs.values()) == 1  # nothing ran twice
    assert len(after.correct) == after.sent == 200  # and service is back
    assert list(ends.values()) == ["correct"] * len(jobs), Counter(ends.values())
    assert all(runs[j] == 1 for j in jobs)


def test_an_evicting_redis_under_memory_pressure_keeps_serving_and_recovers(
    redis_and_stack, capsys
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
    count = Count()
    try:
        asyncio.run(load(s.url, 600, 16, count, timeout_us=3_000_000))
    finally:
        stop.set()
        filler.join()
    evicted = int(r.info("stats")["evicted_keys"])
    for key in r.scan_iter(match="filler:*", count=1000):
        r.delete(key)
    r.config_set("maxmemory", 0)
    after = Count()
    # The service comes back by itself: workers re-advertise, streams and groups are made
    # again. Then every request is served.
    with httpx.Client(base_url=s.url, timeout=10) as c:
        wait_until(lambda: c.get("/v2/health/ready").status_code == 200, 20, "ready again")
        scrape = c.get("/metrics").text
    asyncio.run(load(s.url, 100, 8, after, first=10_000))
    runs = executions(s.workers)
    alive = all(w.worker.started.is_set() and not w.worker.stopping for w in s.workers)
    recreated = sum(w.stats.recreated for w in s.workers)
    r.close()
    with capsys.disabled():
        print(
            "\n"
            + count.line(
                "14 evicting redis",
                runs,
                evicted_keys=evicted,
                streams_recreated=recreated,
                after_sent=after.sent,
                after_correct_200=len(after.correct),
                workers_alive=alive,
                statuses=dict(sorted(count.by_status().items())),
            )
        )
    statuses = count.by_status()
    assert evicted > 0  # the pressure did evict
    assert count.hung == 0 and count.wrong == 0
    assert set(statuses) <= {200, 503, 504}, statuses
    assert len(count.correct) == statuses[200] > 0
    assert max(runs.values()) == 1
    assert alive
    assert len(after.correct) == after.sent == 100
    assert 'inferq_redis_evicting{policy="allkeys-random"} 1.0' in scrape


def test_a_redis_restart_that_loses_every_key_fails_waiters_fast_and_serves_again(
    redis_and_stack, capsys
):
    """redis-server restarted empty (no persistence) mid-load: requests it lost fail with 503
    at once rather than at their 20 s deadlines, nothing hangs or runs twice, jobs it lost
    answer 410 Gone, and service resumes by itself."""
    server, s = redis_and_stack(1)  # one worker holds at most 32: the rest wait in Redis
    jobs = submit_jobs(s, 50)
    count = Count()
    events: dict[str, float] = {}

    def restart_once(c: Count) -> None:
        if "down" not in events and len(c.status) >= 200:
            events["down"] = time.monotonic()
            threading.Thread(target=restart).start()

    def restart() -> None:
        server.kill()
        time.sleep(1.0)  # Redis is down for a second
        server.start()  # same port, no data
        events["up"] = time.monotonic()

    asyncio.run(load(s.url, 600, 64, count, timeout_us=20_000_000, on_progress=restart_once))
    wait_until(lambda: "up" in events, 30, "the restart")
    after = Count()
    with httpx.Client(base_url=s.url, timeout=10) as c:
        wait_until(lambda: c.get("/v2/health/ready").status_code == 200, 20, "ready again")
    asyncio.run(load(s.url, 200, 16, after, first=10_000))
    ends = final_jobs(s, jobs)
    runs = executions(s.workers)
    assert s.gateway is not None
    lost = s.gateway.gateway.replies.lost
    with capsys.disabled():
        print(
            "\n"
            + count.line(
                "15 redis restart, data lost",
                runs,
                failed_as_lost=lost,
                jobs=len(jobs),
                jobs_correct=sum(1 for e in ends.values() if e == "correct"),
                jobs_gone_410=sum(1 for e in ends.values() if e == "410"),
                down_s=f"{events['up'] - events['down']:.1f}",
                after_sent=after.sent,
                after_correct_200=len(after.correct),
            )
        )
    statuses = count.by_status()
    assert count.hung == 0 and count.wrong == 0
    assert set(statuses) <= {200, 503}, statuses  # lost ones fail at once: no 20 s 504s
    assert lost > 0  # some were waiting in Redis when it lost them: failed, not left to wait
    assert len(count.correct) == statuses[200] >= 200
    assert max(runs.values()) == 1
    assert len(after.correct) == after.sent == 200
    assert set(ends.values()) <= {"correct", "410"}, Counter(ends.values())
    assert len(ends) == len(jobs)

"""Redis misbehaving without going away: refusing writes (out of memory with ``noeviction``),
evicting keys, restarting without its data. Every background loop carries on with backoff,
readiness tells the truth, nothing is acknowledged that was not stored, and callers hear what
happened instead of waiting out their deadlines.

Each test runs on a private ``redis-server`` of its own, since it changes the server's config.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from inferq.redisserver import RedisServer
from protocol.keys import GROUP, Keys, Lane
from protocol.registry import ModelMetadata, WorkerInfo
from tests.support import GatewayThread, Stack, WorkerThread, sim_body, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def evicting_redis() -> Iterator[RedisServer]:
    server = RedisServer(extra_args=("--maxmemory-policy", "allkeys-lru")).start()
    yield server
    server.stop()


@pytest.fixture
def own_stack(
    own_redis: RedisServer, namespace: str, model_repo: Path
) -> Iterator[Callable[..., Stack]]:
    started: list[GatewayThread | WorkerThread] = []

    def make(redis_url: str | None = None) -> Stack:
        return Stack(redis_url or own_redis.url, namespace, model_repo, started)

    yield make
    for thing in reversed(started):
        thing.stop()


def out_of_memory(r: redis.Redis) -> None:
    """What a full Redis with ``maxmemory-policy noeviction`` does: refuse every write that
    could grow memory (SET, XADD, HSET, scripts that write), answer reads, XACK, PEXPIRE."""
    r.config_set("maxmemory", 1)


def memory_back(r: redis.Redis) -> None:
    r.config_set("maxmemory", 0)


def ttl_refreshes(r: redis.Redis, key: str, n: int, timeout_s: float = 10.0) -> None:
    """Wait until the key's TTL has been pushed up ``n`` times (a keepalive running)."""
    seen = 0
    last = r.pttl(key)

    def refreshed() -> bool:
        nonlocal seen, last
        now = r.pttl(key)
        if now > last:
            seen += 1
        last = now
        return seen >= n

    wait_until(refreshed, timeout_s, f"{n} refreshes of {key}'s TTL")


def job_status(c: httpx.Client, job_id: str) -> str:
    status: str = c.get(f"/v2/jobs/{job_id}").json()["status"]
    return status


# -- defect 1: every loop survives any Redis error ----------------------------------------------


def test_a_short_out_of_memory_spell_leaves_the_reply_keepalive_running(own_stack, own_redis):
    """OOM kills no loop: the gateway's reply-stream keepalive keeps running through the spell,
    so when the stream goes (its TTL, an eviction) it is recreated and /infer answers again."""
    s = own_stack()
    s.add_worker(("sim",))
    s.start_gateway(heartbeat_s=0.1)
    assert s.infer("sim", sim_body(1)).status_code == 200
    key = s.gateway.gateway.replies.key
    with redis.Redis.from_url(own_redis.url) as r:
        out_of_memory(r)
        try:
            assert s.infer("sim", sim_body(2, cache=False)).status_code == 503
            ttl_refreshes(r, key, 3)  # the keepalive ran on through the refusals
        finally:
            memory_back(r)
        r.delete(key)  # what its TTL does a minute later if nobody refreshes it
        wait_until(lambda: r.exists(key) == 1, 10, "the reply stream recreated")
    r2 = s.infer("sim", sim_body(3, cache=False, timeout=5_000_000))
    assert r2.status_code == 200, r2.text


def test_readiness_is_503_while_redis_refuses_writes_and_says_why(own_stack, own_redis):
    s = own_stack()
    s.add_worker(("sim",))
    s.start_gateway(heartbeat_s=0.1)
    with s.client() as c, redis.Redis.from_url(own_redis.url) as r:
        assert c.get("/v2/health/ready").status_code == 200
        out_of_memory(r)
        try:
            wait_until(
                lambda: c.get("/v2/health/ready").status_code == 503, 10, "readiness to fail"
            )
            body = c.get("/v2/health/ready").json()
            assert body["ready"] is False
            assert any("out of memory" in p for p in body["problems"]), body
        finally:
            memory_back(r)
        wait_until(lambda: c.get("/v2/health/ready").status_code == 200, 10, "ready again")


def test_a_503_from_an_out_of_memory_redis_says_what_redis_said_and_echoes_no_request(
    own_stack, own_redis
):
    s = own_stack()
    s.add_worker(("sim",))
    s.start_gateway()
    marker = 123456.0  # appears in the request body, so it would in an echoed command
    with s.client() as c, redis.Redis.from_url(own_redis.url) as r:
        out_of_memory(r)
        try:
            answers = [
                c.post("/v2/models/sim/jobs", json=sim_body(marker)),
                c.post("/v2/models/sim/infer", json=sim_body(marker, cache=False)),
            ]
        finally:
            memory_back(r)
    for answer in answers:
        error = answer.json()["error"]
        assert answer.status_code == 503, answer.text
        assert "out of memory" in error and "maxmemory" in error, error
        assert "unreachable" not in error and "Command #" not in error, error
        assert "123456" not in error and "\\x" not in error, error
        assert "retry-after" in answer.headers


def test_a_worker_loop_that_crashes_stops_the_worker_with_loop_crashed(
    redis_url, namespace, model_repo
):
    """Not a Redis error but a bug: the worker does not carry on half-alive; it stops, and
    ``run`` raises so that ``inferq worker`` exits non-zero (70) for its supervisor."""
    import asyncio

    from consumer.settings import WorkerSettings
    from consumer.worker import LoopCrashed, Worker
    from runtime.connections import RedisSettings

    async def bug() -> None:
        raise RuntimeError("a bug in a loop")

    async def go() -> None:
        worker = Worker(
            WorkerSettings(
                redis=RedisSettings(redis_url),
                namespace=namespace,
                model_repository=model_repo,
                models=("sim",),
                block_ms=200,
            )
        )
        task = asyncio.create_task(worker.run())
        await asyncio.wait_for(worker.started.wait(), 20)
        worker.loops.spawn("buggy", bug())
        with pytest.raises(LoopCrashed, match="a bug in a loop"):
            await asyncio.wait_for(task, 20)
        assert worker.failure is not None

    asyncio.run(go())


def test_a_gateway_loop_that_crashes_fails_readiness_for_good(own_stack):
    s = own_stack()
    s.add_worker(("sim",))
    gw = s.start_gateway()
    gateway = gw.gateway

    async def bug() -> None:
        raise RuntimeError("a bug in a loop")

    with s.client() as c:
        assert c.get("/v2/health/ready").status_code == 200
        gw.call(lambda: gateway.loops.spawn("buggy", bug()))
        wait_until(lambda: gateway.failure is not None, 10, "the gateway to see the crash")
        body = c.get("/v2/health/ready").json()
    assert (
        body["ready"] is False and "buggy: down (RuntimeError: a bug in a loop)" in body["problems"]
    )


# -- defect 2: nothing is acknowledged that was not stored --------------------------------------


@pytest.mark.serial  # fills Redis within one 3 s batch
def test_the_worker_acknowledges_no_entry_whose_result_was_refused(own_stack, own_redis):
    """A job finishes while Redis refuses writes: its entry stays pending (not acknowledged),
    the refusals are counted, and once Redis takes writes again the job ends succeeded."""
    s = own_stack()
    worker = s.add_worker(("hold",))  # a 3 s batch: time to make Redis refuse its result
    s.start_gateway()
    stream = Keys(s.namespace).stream("hold", Lane.LOW)
    metrics = worker.worker.metrics.registry
    with s.client() as c, redis.Redis.from_url(own_redis.url) as r:
        job_id = c.post("/v2/models/hold/jobs", json=sim_body(2)).json()["id"]
        wait_until(lambda: job_status(c, job_id) == "running", 10, "the job to start")
        out_of_memory(r)
        try:
            refused = lambda: metrics.get_sample_value(  # noqa: E731
                "inferq_worker_write_failures_total", {"model": "hold", "reason": "oom"}
            )
            # Either the fix counted the refusal, or the bug acknowledged the entry.
            wait_until(
                lambda: (refused() or 0) > 0 or r.xpending(stream, GROUP)["pending"] == 0,
                10,
                "the worker to try to write the result",
            )
            assert r.xpending(stream, GROUP)["pending"] == 1
            assert job_status(c, job_id) == "running"
        finally:
            memory_back(r)
        wait_until(lambda: job_status(c, job_id) == "succeeded", 10, "the job to succeed")
        wait_until(lambda: r.xpending(stream, GROUP)["pending"] == 0, 10, "the entry acked")
        assert c.get(f"/v2/jobs/{job_id}").json()["result"]["outputs"][0]["data"] == [8.0]


# -- defect 3: an evicting Redis is named, and a vanished stream is recreated -------------------


def test_an_evicting_maxmemory_policy_is_warned_about_in_metrics_and_in_lag(
    evicting_redis, namespace, model_repo, capsys
):
    from inferq import lag
    from inferq.cli import build_parser

    started: list[Any] = []
    try:
        s = Stack(evicting_redis.url, namespace, model_repo, started)
        worker = s.add_worker(("sim",))
        s.start_gateway()
        assert s.infer("sim", sim_body(1)).status_code == 200
        with s.client() as c:
            scrape = c.get("/metrics").text
        assert 'inferq_redis_evicting{policy="allkeys-lru"} 1.0' in scrape, scrape[-2000:]
        worker_metrics = worker.worker.metrics.registry
        assert worker_metrics.get_sample_value("inferq_redis_evicting", {"policy": "allkeys-lru"})
        out = io.StringIO()
        args = build_parser({}).parse_args(
            ["lag", "--redis", evicting_redis.url, "--namespace", namespace, "--sample-s", "0"]
        )
        assert lag.run(args, out) == lag.EXIT_OK
        assert "maxmemory-policy is allkeys-lru" in out.getvalue(), out.getvalue()
        assert "noeviction" in out.getvalue()
        args = build_parser({}).parse_args(
            ["lag", "--redis", evicting_redis.url, "--namespace", namespace, "--json"]
        )
        out = io.StringIO()
        lag.run(args, out)
        assert json.loads(out.getvalue())["redis"]["maxmemory_policy"] == "allkeys-lru"
    finally:
        for thing in reversed(started):
            thing.stop()


def test_a_policy_changed_to_evicting_at_run_time_is_noticed_at_the_next_refresh(
    own_stack, own_redis
):
    s = own_stack()
    s.add_worker(("sim",))
    s.start_gateway()
    with s.client() as c, redis.Redis.from_url(own_redis.url) as r:
        assert 'inferq_redis_evicting{policy="noeviction"} 0.0' in c.get("/metrics").text
        r.config_set("maxmemory-policy", "volatile-ttl")
        wait_until(
            lambda: 'inferq_redis_evicting{policy="volatile-ttl"} 1.0' in c.get("/metrics").text,
            10,
            "the gateway to notice",
        )


def test_a_request_stream_deleted_under_a_blocked_worker_is_recreated_and_served(
    own_stack, own_redis
):
    """Eviction (or an operator) deletes the stream the worker is blocked on: Redis answers
    'UNBLOCKED the stream key no longer exists'. The worker recreates stream and group and
    carries on; it does not exit."""
    s = own_stack()
    worker = s.add_worker(("sim",))
    s.start_gateway()
    keys = Keys(s.namespace)
    with redis.Redis.from_url(own_redis.url) as r:

        def reader_blocked() -> bool:
            return any(
                c["name"].startswith("inferq-worker-reader") and c["cmd"] == "xreadgroup"
                for c in r.client_list()
            )

        wait_until(reader_blocked, 10, "the worker's blocking read")
        r.delete(*keys.streams("sim"))
        answer = s.infer("sim", sim_body(4, timeout=5_000_000))
        assert answer.status_code == 200, answer.text
        assert r.exists(keys.stream("sim", Lane.NORMAL))
    assert worker.worker.started.is_set() and not worker.worker.stopping


# -- smaller items: Redis restarted without its data --------------------------------------------


def _ghost_worker(r: redis.Redis, keys: Keys) -> None:
    """A live-looking worker for 'sim' that never reads: requests queue and stay queued."""
    meta = ModelMetadata.decode(r.hget(keys.models, "sim"))
    ghost = WorkerInfo(id="ghost", host="h", pid=1, started_ms=0, models=(meta,))
    r.set(keys.worker("ghost"), ghost.encode())
    r.zadd(keys.workers, {"ghost": 10**15})


def test_waiting_requests_fail_at_once_when_redis_restarts_without_their_entries(
    own_stack, own_redis
):
    s = own_stack()
    first = s.add_worker(("sim",))
    s.start_gateway()
    s.wait_ready("sim")
    first.stop()
    keys = Keys(s.namespace)
    with redis.Redis.from_url(own_redis.url) as r:
        _ghost_worker(r, keys)
        s.wait_ready("sim")
        with ThreadPoolExecutor(5) as pool:
            waiting = [
                pool.submit(s.infer, "sim", sim_body(i, cache=False, timeout=20_000_000))
                for i in range(5)
            ]
            wait_until(lambda: r.xlen(keys.stream("sim", Lane.NORMAL)) == 5, 10, "5 queued")
            own_redis.stop()
            own_redis.start()  # same port, empty
            answers = [f.result() for f in waiting]
    # Not 504 after 20 s: the gateway saw that Redis lost them and said so.
    assert [a.status_code for a in answers] == [503] * 5, [a.text for a in answers]
    assert all("lost" in a.json()["error"] for a in answers), answers[0].text


def test_polling_a_job_whose_record_redis_lost_answers_410_gone(own_stack, own_redis):
    s = own_stack()
    first = s.add_worker(("sim",))
    s.start_gateway()
    s.wait_ready("sim")
    first.stop()
    with s.client() as c:
        job_id = c.post("/v2/models/sim/jobs", json=sim_body(1)).json()["id"]
        assert c.get(f"/v2/jobs/{job_id}").status_code == 200
        own_redis.stop()
        own_redis.start()  # same port, empty
        wait_until(lambda: c.get(f"/v2/jobs/{job_id}").status_code != 503, 10, "Redis back")
        gone = c.get(f"/v2/jobs/{job_id}")
        assert gone.status_code == 410, gone.text
        assert "lost" in gone.json()["error"]
        unknown = c.get("/v2/jobs/" + "A" * 22)
        assert unknown.status_code == 404

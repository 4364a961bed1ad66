"""Requests whose callers hung up before they ran are dropped, not run for nobody."""

from __future__ import annotations

import functools
import json
import socket
from dataclasses import replace

import redis
from starlette.testclient import TestClient

from producer.app import create_app
from producer.v2_request import parse_infer_request
from protocol.cancellation import CHECK_AFTER_MS
from protocol.keys import Keys, Lane
from tests.support import sim_body, wait_until

ABANDONED = 200
MAX_RUN_SHARE = 0.05
"""The target: at most 5 % of abandoned requests still run."""


def redis_ms(r: redis.Redis) -> int:
    seconds, micros = r.time()
    return seconds * 1000 + micros // 1000


def send_and_hold(port: int, i: int) -> socket.socket:
    """Send a complete /infer request and leave the connection open, unread."""
    body = json.dumps(sim_body(float(i))).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /v2/models/sim/infer HTTP/1.1\r\nhost: test\r\n"
        b"content-type: application/json\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def test_requests_whose_callers_hung_up_before_they_ran_are_dropped(stack, redis_url):
    s = stack(models=("sim",))
    worker = s.workers[0]
    gateway = s.gateway.gateway

    def waiting() -> float | None:
        return gateway.metrics.registry.get_sample_value("inferq_gateway_waiting_requests")

    assert s.infer("sim", sim_body(1)).status_code == 200  # the worker is warm and known
    ran_before = worker.stats.requests
    with worker.paused():
        sockets = [send_and_hold(s.gateway.settings.port, i) for i in range(ABANDONED)]
        wait_until(lambda: waiting() == ABANDONED, what="every request to be queued")
        for sock in sockets:
            sock.close()
        wait_until(
            lambda: waiting() == 0,
            timeout_s=5,
            what="the waiting gauge to fall when the callers hang up",
        )
        with redis.Redis.from_url(redis_url) as r:
            cancelled_set = Keys(s.namespace).cancelled("sim")
            wait_until(lambda: r.zcard(cancelled_set) == ABANDONED, what="every request marked")
            assert 0 < r.pttl(cancelled_set) <= 10_000 + 60_000  # deadline plus a minute
    wait_until(
        lambda: worker.stats.requests - ran_before + worker.stats.cancelled == ABANDONED,
        timeout_s=20,
        what="the worker to run or drop every abandoned request",
    )
    ran = worker.stats.requests - ran_before
    cancelled = worker.worker.metrics.registry.get_sample_value(
        "inferq_worker_cancelled_total", {"model": "sim"}
    )
    print(f"abandoned={ABANDONED} ran={ran} dropped={worker.stats.cancelled}")
    assert ran <= ABANDONED * MAX_RUN_SHARE, f"{ran} of {ABANDONED} abandoned requests ran"
    assert cancelled == worker.stats.cancelled == ABANDONED - ran
    # The worker is not stuck: a new request is answered.
    r = s.infer("sim", sim_body(7))
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [28.0]


def test_cancelling_the_task_that_waits_abandons_the_request_as_a_cancelled_grpc_call_does(
    stack, redis_url
):
    s = stack(models=("sim",))
    worker = s.workers[0]
    app = create_app(replace(s.gateway.settings, gateway_id="canceller"))
    body = json.dumps(sim_body(3)).encode()
    with TestClient(app) as client, redis.Redis.from_url(redis_url) as r:
        service = app.state.gateway.service
        wait_until(lambda: service.registry.live_workers == 1, what="the worker to be known")
        ran_before = worker.stats.requests
        with worker.paused():
            decode = functools.partial(parse_infer_request, body, None)
            call = client.portal.start_task_soon(service.infer, "sim", None, decode)
            wait_until(lambda: app.state.gateway.replies.waiting == 1, what="the request queued")
            call.cancel()
            wait_until(lambda: app.state.gateway.replies.waiting == 0, what="the waiter gone")
            wait_until(lambda: r.zcard(Keys(s.namespace).cancelled("sim")) == 1, what="the mark")
            old_enough = redis_ms(r) + CHECK_AFTER_MS  # workers look up requests that waited
            wait_until(lambda: redis_ms(r) >= old_enough, what="the request to have waited")
        wait_until(lambda: worker.stats.cancelled == 1, what="the worker to drop it")
    assert worker.stats.requests == ran_before


def test_requests_answered_at_once_cost_no_cancellation_lookup(stack, redis_url):
    s = stack(models=("sim",))

    def lookups(r: redis.Redis) -> int:
        return int(r.info("commandstats").get("cmdstat_zmscore", {}).get("calls", 0))

    with redis.Redis.from_url(redis_url) as r:
        before = lookups(r)
        with s.client() as c:
            for i in range(20):  # one at a time: each its own batch, read as soon as queued
                assert c.post("/v2/models/sim/infer", json=sim_body(i)).status_code == 200
        assert lookups(r) - before <= 2  # a stalled machine may age one past CHECK_AFTER_MS


def test_requests_run_when_redis_answers_the_cancellation_lookup_with_an_error(stack, redis_url):
    # An error reply to the ZMSCORE (here WRONGTYPE: the set's key holds a string) is "Redis
    # cannot say": the requests run, as they would have anyway.
    s = stack(models=("sim",))
    worker = s.workers[0]
    assert s.infer("sim", sim_body(1)).status_code == 200
    ran_before = worker.stats.requests
    with redis.Redis.from_url(redis_url) as r:
        r.set(Keys(s.namespace).cancelled("sim"), b"not a sorted set")
        stream = Keys(s.namespace).stream("sim", Lane.NORMAL)
        added = r.xinfo_stream(stream)["entries-added"]
        sockets: list[socket.socket] = []
        try:
            with worker.paused():
                sockets += [send_and_hold(s.gateway.settings.port, i) for i in range(5)]
                # Entries added, not XLEN: the first request's entry is trimmed once acknowledged.
                wait_until(
                    lambda: r.xinfo_stream(stream)["entries-added"] - added >= 5,
                    what="the requests to be queued",
                )
                # Old enough to be looked up once the worker runs them.
                start = redis_ms(r)
                wait_until(lambda: redis_ms(r) - start > CHECK_AFTER_MS, what="the check age")
            wait_until(
                lambda: worker.stats.requests - ran_before == 5,
                timeout_s=20,
                what="every request to run despite the error reply",
            )
        finally:
            for sock in sockets:
                sock.close()
    assert worker.stats.cancelled == 0

"""Redis goes away and comes back empty: clear 503s meanwhile, then everything recovers alone."""

from __future__ import annotations

import json

import pytest
import redis

from inferq.redisserver import RedisServer
from tests.support import Stack, sim_body, wait_until


@pytest.fixture
def own_redis():
    server = RedisServer().start()
    yield server
    server.stop()


def test_the_gateway_answers_503_while_redis_is_down_and_everything_recovers(
    own_redis, namespace, model_repo
):
    started: list = []
    try:
        s = Stack(own_redis.url, namespace, model_repo, started)
        worker = s.add_worker(("sim",))
        s.start_gateway()
        assert s.infer("sim", sim_body(1)).status_code == 200

        own_redis.stop()
        r = s.infer("sim", sim_body(2, cache=False))
        assert r.status_code == 503
        assert "Redis" in r.json()["error"] and "retry-after" in r.headers
        with s.client() as c:
            assert c.get("/v2/health/ready").status_code == 503
            assert c.get("/v2/health/live").status_code == 200

        own_redis.start()  # same port, empty: no streams, no groups, no registry
        with s.client() as c:
            wait_until(
                lambda: c.get("/v2/health/ready").status_code == 200,
                timeout_s=20,
                what="readiness after Redis came back",
            )
        # The worker recreated its consumer groups; the gateway its reply stream.
        wait_until(
            lambda: s.infer("sim", sim_body(3)).status_code == 200,
            timeout_s=20,
            what="inference after Redis came back",
        )
        assert worker.worker.started.is_set()
    finally:
        for thing in reversed(started):
            thing.stop()


def test_a_redis_that_refuses_writes_gets_503_with_retry_after_and_its_reason(
    own_redis, namespace, model_repo
):
    started: list = []
    try:
        s = Stack(own_redis.url, namespace, model_repo, started)
        s.add_worker(("sim",))
        s.start_gateway()
        assert s.infer("sim", sim_body(1)).status_code == 200
        with redis.Redis.from_url(own_redis.url) as r:
            r.config_set("maxmemory-policy", "noeviction")
            r.config_set("maxmemory", 1)
            try:
                infer = s.infer("sim", sim_body(2, cache=False))
                with s.client() as c:
                    job = c.post(
                        "/v2/models/sim/jobs",
                        content=json.dumps(sim_body(3)),
                        headers={"content-type": "application/json"},
                    )
            finally:
                r.config_set("maxmemory", 0)
        for response in (infer, job):
            assert response.status_code == 503, response.text
            assert int(response.headers["retry-after"]) >= 1
            error = response.json()["error"]
            assert "maxmemory" in error and "unreachable" not in error, error
    finally:
        for thing in reversed(started):
            thing.stop()

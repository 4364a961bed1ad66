"""Redis goes away and comes back empty: clear 503s meanwhile, then everything recovers alone."""

from __future__ import annotations

import pytest

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

"""``--workers-on-demand``: a gateway whose workers a scaler starts on the backlog (``inferq up
--workers 0:N``, KEDA at ``minReplicaCount: 0``) takes requests for a known model that no live
worker serves: it stays ready, queues them, and answers once a worker runs them, or 504 at
their deadline. Without it the same request gets 503 at once (``test_bad_input``)."""

from __future__ import annotations

import threading

import httpx
import redis

from protocol.keys import Keys, Lane
from tests.support import sim_body, wait_until


def unread(redis_url: str, namespace: str) -> int:
    with redis.Redis.from_url(redis_url) as r:
        return int(r.xlen(Keys(namespace).stream("sim", Lane.NORMAL)))


def zero_workers(stack):
    s = stack(workers=1, models=("sim",), workers_on_demand=True)
    s.wait_ready("sim")
    s.workers[0].stop()  # it withdraws: the model stays known, no worker serves it
    with s.client() as c:
        wait_until(
            lambda: c.get("/v2/models/sim/ready").status_code == 503,
            what="the gateway to see no live worker",
        )
    return s


def test_a_model_with_no_live_worker_is_queued_and_answered_once_a_worker_starts(
    stack, redis_url, namespace
):
    s = zero_workers(stack)
    with s.client() as c:
        assert c.get("/v2/health/ready").json() == {"ready": True}  # servable on demand
    before = unread(redis_url, namespace)
    answers: list[httpx.Response] = []
    caller = threading.Thread(target=lambda: answers.append(s.infer("sim", sim_body(3))))
    caller.start()
    wait_until(lambda: unread(redis_url, namespace) > before, what="the request to be queued")
    assert answers == []  # waiting, not refused
    s.add_worker(("sim",))  # what the scaler does on the backlog
    caller.join(30)
    (r,) = answers
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [12.0]


def test_a_request_whose_deadline_passes_before_a_worker_starts_gets_504(stack):
    s = zero_workers(stack)
    r = s.infer("sim", sim_body(1, timeout=300_000))  # 300 ms, in microseconds
    assert r.status_code == 504
    assert "deadline" in r.json()["error"]

"""An ``XADD`` whose reply never came may have queued the request (issue #21, defect 5: a Redis
stall past the socket timeout, or a 63 MiB request slower than it). The gateway never answers
"could not queue" then: a request waits for its answer until its deadline, and a job is looked
for; a client is never told something did not happen that did.

Redis is stopped (SIGSTOP) with the gateway's socket timeout at 0.5 s: the XADD is written,
times out, and Redis runs it when it carries on, as it did for the red team."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from inferq.redisserver import RedisServer
from runtime.connections import RedisSettings
from tests.support import Stack, sim_body, wait_until

pytestmark = pytest.mark.integration

SOCKET_TIMEOUT_S = 0.5
STALL_S = 1.5
"""Longer than the socket timeout: the XADD's reply is given up on before Redis answers it."""


@pytest.fixture
def stalled_stack(namespace, model_repo) -> Iterator[tuple[RedisServer, Stack]]:
    started: list[Any] = []
    with RedisServer() as server:
        s = Stack(server.url, namespace, model_repo, started)
        redis = RedisSettings(server.url, socket_timeout_s=SOCKET_TIMEOUT_S)
        s.add_worker(("sim",), redis=redis)
        s.start_gateway(redis=redis)
        s.wait_ready("sim")
        try:
            yield server, s
        finally:
            for thing in reversed(started):
                thing.stop()


def stalled(server: RedisServer, seconds: float) -> threading.Thread:
    """Stop Redis now and let it carry on after ``seconds`` (in the background)."""
    assert server._process is not None
    pid = server._process.pid
    os.kill(pid, signal.SIGSTOP)

    def carry_on() -> None:
        time.sleep(seconds)  # the scenario: a stall this long
        os.kill(pid, signal.SIGCONT)

    thread = threading.Thread(target=carry_on)
    thread.start()
    return thread


def test_a_request_whose_xadd_reply_was_lost_is_waited_for_never_refused(stalled_stack):
    """Answered if Redis ran it; else a 504 at its deadline that says it may have run. The
    gateway's lean connection resets on a timeout, so Redis usually drops the unread XADD;
    redis-py's pool closes gracefully, and Redis runs it (the job case below)."""
    server, s = stalled_stack
    resumer = stalled(server, STALL_S)
    try:
        r = s.infer("sim", sim_body(7, cache=False, timeout=4_000_000))
    finally:
        resumer.join()
    assert r.status_code in (200, 504), r.text  # before: 503 "could not queue the request"
    if r.status_code == 200:
        assert r.json()["outputs"][0]["data"] == [7.0]
    else:
        assert "may have run" in r.json()["error"]
    assert sum(w.stats.requests for w in s.workers) == (r.status_code == 200)


def test_a_job_whose_submit_reply_was_lost_is_never_refused_as_not_queued(stalled_stack):
    server, s = stalled_stack
    resumer = stalled(server, STALL_S)
    try:
        with s.client() as c:
            r = c.post("/v2/models/sim/jobs", content=json.dumps(sim_body(3)))
    finally:
        resumer.join()
    # Found after the stall (202), or the gateway could not tell (504 naming the job id).
    assert r.status_code in (202, 504), r.text
    if r.status_code == 504:
        assert "may have" in r.json()["error"]
        job_id = r.json()["error"].split("job ", 1)[1].split(" ", 1)[0]
    else:
        job_id = r.json()["id"]
    with s.client() as c:
        wait_until(
            lambda: c.get(f"/v2/jobs/{job_id}").json().get("status") == "succeeded",
            20,
            "the job to run",
        )


@pytest.mark.serial  # sends within a fixed 1.5 s stall
def test_a_request_redis_did_not_run_times_out_saying_it_may_have_run(stalled_stack):
    """Stopped past the request's deadline: no answer, and the 504 does not claim it did not
    run (it was queued; the worker drops it as expired)."""
    server, s = stalled_stack
    resumer = stalled(server, STALL_S)
    try:
        r = s.infer("sim", sim_body(1, cache=False, timeout=1_000_000))
    finally:
        resumer.join()
    assert r.status_code == 504, r.text
    assert "may have run" in r.json()["error"] and "could not queue" not in r.json()["error"]

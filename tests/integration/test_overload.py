"""Overload: refuse at once what cannot meet its deadline; fail fast while a model fails."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support import sim_body, wait_until


@pytest.mark.serial  # probes before a 2 s backlog drains
def test_a_request_that_cannot_meet_its_deadline_is_refused_at_once(stack):
    s = stack(models=("serial",))  # 200 ms per request, one at a time
    assert s.infer("serial", sim_body(0)).status_code == 200  # measures the service time
    registry = s.gateway.gateway.registry
    with ThreadPoolExecutor(12) as pool:
        queued = [pool.submit(s.infer, "serial", sim_body(i)) for i in range(12)]
        wait_until(lambda: registry.backlog("serial") >= 5, what="a visible backlog")
        r = s.infer("serial", sim_body(99, timeout=300_000))  # 300 ms deadline
        assert r.status_code == 429, r.text  # not queued: a queued one would end in 504
        assert "overloaded" in r.json()["error"] and "deadline" in r.json()["error"]
        assert int(r.headers["retry-after"]) >= 1
        assert all(f.result().status_code == 200 for f in queued)


def test_a_backlog_at_its_cap_is_refused(stack):
    s = stack(models=("serial",), max_backlog=3)
    with ThreadPoolExecutor(8) as pool:
        # A frozen worker reads nothing more, so the backlog reaches its cap however slowly the
        # requests arrive (a draining worker raced them on a loaded machine). A read it had in
        # flight when it froze may still take one request, which is then no longer backlog (the
        # group's lag): of six, three or four are queued and the rest refused.
        with s.workers[0].paused():
            sent = [pool.submit(s.infer, "serial", sim_body(i)) for i in range(6)]
            wait_until(lambda: sum(f.done() for f in sent) >= 2, what="two requests refused")
            refused = [f.result() for f in sent if f.done()]
            assert all(r.status_code == 429 for r in refused), [r.text for r in refused]
            assert all("limit of 3" in r.json()["error"] for r in refused)
        statuses = sorted(f.result().status_code for f in sent)
    assert statuses.count(200) in (3, 4) and statuses.count(429) == 6 - statuses.count(200)


def test_a_failing_model_trips_its_breaker_and_fails_fast(stack):
    s = stack(models=("broken",))
    codes = [s.infer("broken", sim_body(i)).status_code for i in range(20)]
    assert codes == [500] * 20
    calls = s.workers[0].backend("broken").calls
    r = s.infer("broken", sim_body(99))
    assert r.status_code == 503 and "failing" in r.json()["error"]
    assert "retry-after" in r.headers
    assert s.workers[0].backend("broken").calls == calls  # the model was not called


def test_bytes_in_flight_are_capped_per_gateway(stack):
    # A request holds its body and its headers (httpx sends about 200 bytes of them).
    one = len(json.dumps(sim_body(1, rows=400))) + 200
    s = stack(models=("sim",), max_inflight_bytes=3 * one + one // 2)
    worker = s.workers[0]
    with ThreadPoolExecutor(3) as pool:
        with worker.paused():
            held = [pool.submit(s.infer, "sim", sim_body(i, rows=400)) for i in range(3)]
            wait_until(
                lambda: s.gateway.gateway.replies.waiting == 3, what="three requests waiting"
            )
            r = s.infer("sim", sim_body(9, rows=400))
            assert r.status_code == 429, r.text
            assert "bytes" in r.json()["error"] and int(r.headers["retry-after"]) >= 1
        for i, f in enumerate(held):
            answer = f.result()
            assert answer.status_code == 200 and answer.json()["outputs"][0]["data"][0] == 4 * i
    # Answered requests hand their bytes back.
    assert s.infer("sim", sim_body(9, rows=400)).status_code == 200
    too_big = s.infer("sim", sim_body(1, rows=1600))
    assert too_big.status_code == 413 and "--max-inflight-bytes" in too_big.json()["error"]

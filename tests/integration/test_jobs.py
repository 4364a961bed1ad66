"""Async jobs: submit now, poll later, from any gateway; cancel; idempotent retries; deadlines."""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import redis

from protocol.jobs import JOB_ID_RANDOM_BYTES, new_job_id
from protocol.keys import Keys, Lane
from tests.support import binary_body, sim_body, wait_until

SAMPLES = json.loads((Path(__file__).parents[2] / "models/digits/samples.json").read_text())
FINAL = {"succeeded", "failed", "expired", "cancelled"}


def digits_body(i: int, **extra):
    row = SAMPLES["inputs"][i % 10]
    return {
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": row}],
        **extra,
    }


def submit(client, model: str, body: dict, **headers):
    return client.post(
        f"/v2/models/{model}/jobs",
        content=json.dumps(body),
        headers={"content-type": "application/json", **headers},
    )


def poll(client, job_id: str, wait: float = 20.0) -> dict:
    deadline = time.monotonic() + 60
    while True:
        r = client.get(f"/v2/jobs/{job_id}", params={"wait": wait})
        assert r.status_code == 200, r.text
        job = r.json()
        if job["status"] in FINAL or time.monotonic() > deadline:
            return job


@pytest.fixture
def paused(stack):
    """A stack whose models are known (a worker ran once) but no worker runs now."""

    def make(models=("sim",), **gateway):
        s = stack(models=models, **gateway)
        s.workers[0].stop()
        with s.client() as c:
            wait_until(
                lambda: c.get(f"/v2/models/{models[0]}/ready").status_code == 503,
                what="no live worker",
            )
        return s

    return make


def test_a_job_is_accepted_at_once_and_polled_to_its_result(stack):
    s = stack(models=("slow",))
    with s.client() as c:
        r = submit(
            c,
            "slow",
            sim_body(2, rows=1),
            **{"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"},
        )
        assert r.status_code == 202
        job = r.json()
        assert job["status"] == "queued" and job["model_name"] == "slow"
        assert r.headers["location"] == f"/v2/jobs/{job['id']}"
        assert len(job["id"]) >= 22  # 128 random bits, URL-safe
        started = time.monotonic()
        done = c.get(f"/v2/jobs/{job['id']}", params={"wait": 30}).json()
        assert time.monotonic() - started < 20, "the long poll did not wake on completion"
    assert done["status"] == "succeeded"
    assert done["result"]["outputs"][0]["data"] == [8.0]
    assert done["result"]["model_name"] == "slow"
    for stamp in ("created_at", "started_at", "finished_at"):
        assert done[stamp].endswith("Z")


def test_a_thousand_jobs_queue_without_workers_then_all_succeed_like_sync(paused, redis_url):
    s = paused(models=("digits",))
    keys = Keys(s.namespace)
    with s.client() as c, ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda i: submit(c, "digits", digits_body(i)), range(1000)))
        assert {r.status_code for r in responses} == {202}
        ids = [r.json()["id"] for r in responses]
        assert len(set(ids)) == 1000
        assert {c.get(f"/v2/jobs/{i}").json()["status"] for i in ids[::50]} == {"queued"}
        with redis.Redis.from_url(redis_url) as r:
            assert r.xlen(keys.stream("digits", Lane.LOW)) == 1000  # the backlog, visible
        s.add_worker(("digits",))
        jobs = list(pool.map(lambda i: poll(c, i), ids))
        sync = [
            s.infer("digits", digits_body(i), **{"cache-control": "no-cache"}).json()
            for i in range(10)
        ]
    assert {j["status"] for j in jobs} == {"succeeded"}
    for i, job in enumerate(jobs):
        assert job["result"]["outputs"] == sync[i % 10]["outputs"]


def test_a_job_cancelled_before_it_starts_never_runs(paused):
    s = paused()
    with s.client() as c:
        job = submit(c, "sim", sim_body(1)).json()
        r = c.delete(f"/v2/jobs/{job['id']}")
        assert r.status_code == 200 and r.json()["status"] == "cancelled"
        assert c.delete(f"/v2/jobs/{job['id']}").status_code == 200  # idempotent
        worker = s.add_worker(("sim",))
        wait_until(lambda: worker.stats.skipped_jobs == 1, what="the worker to skip the job")
        assert worker.backend("sim").calls == 0
        assert c.get(f"/v2/jobs/{job['id']}").json()["status"] == "cancelled"


def test_finished_jobs_cannot_be_cancelled_and_unknown_ids_are_404(stack):
    s = stack(models=("sim",))
    with s.client() as c:
        job = submit(c, "sim", sim_body(1)).json()
        assert poll(c, job["id"])["status"] == "succeeded"
        r = c.delete(f"/v2/jobs/{job['id']}")
        assert r.status_code == 409 and "already finished" in r.json()["error"]
        assert c.get("/v2/jobs/AAAAAAAAAAAAAAAAAAAAAA").status_code == 404
        assert c.get("/v2/jobs/../../etc").status_code == 404
        assert c.delete("/v2/jobs/nope").status_code == 404
        assert c.get(f"/v2/jobs/{job['id']}", params={"wait": "soon"}).status_code == 400


def test_the_result_survives_a_gateway_restart(stack):
    s = stack(models=("slow",))
    with s.client() as c:
        job = submit(c, "slow", sim_body(3)).json()
    s.gateway.stop()
    s.start_gateway()  # a new process in all but name: new id, new reply stream, no state
    with s.client() as c:
        done = poll(c, job["id"])
    assert done["status"] == "succeeded" and done["result"]["outputs"][0]["data"] == [12.0]


def test_the_same_idempotency_key_gives_one_job_and_one_execution(stack):
    s = stack(models=("sim",))
    worker = s.workers[0]
    with s.client() as c:
        first = submit(c, "sim", sim_body(1), **{"idempotency-key": "order-42"})
        second = submit(c, "sim", sim_body(1), **{"idempotency-key": "order-42"})
        assert first.status_code == second.status_code == 202
        assert second.headers["idempotent-replayed"] == "true"
        assert first.json()["id"] == second.json()["id"]
        assert poll(c, first.json()["id"])["status"] == "succeeded"
        other = submit(c, "sim", sim_body(1), **{"idempotency-key": "order-43"})
        assert other.json()["id"] != first.json()["id"]
        assert poll(c, other.json()["id"])["status"] == "succeeded"
    assert worker.backend("sim").calls == 2


def test_an_expired_job_is_never_executed(paused):
    s = paused()
    with s.client() as c:
        late = submit(c, "sim", sim_body(1, timeout=1_000)).json()  # 1 ms, in microseconds
        seen_by_worker = submit(c, "sim", sim_body(2, timeout=1_000)).json()
        # No worker runs: once the 1 ms deadline has passed, reading the job finds it expired.
        wait_until(
            lambda: c.get(f"/v2/jobs/{late['id']}").json()["status"] != "queued",
            what="the deadline to pass",
        )
        job = c.get(f"/v2/jobs/{late['id']}").json()
        assert job["status"] == "expired" and "deadline" in job["error"]
        worker = s.add_worker(("sim",))
        wait_until(
            lambda: worker.stats.expired + worker.stats.skipped_jobs == 2,
            what="the worker to drop both",
        )
        assert worker.backend("sim").calls == 0
        assert poll(c, seen_by_worker["id"])["status"] == "expired"


def test_jobs_go_to_the_low_lane_unless_a_priority_is_given(paused, redis_url):
    s = paused()
    keys = Keys(s.namespace)
    with s.client() as c:
        submit(c, "sim", sim_body(1))
        submit(c, "sim", sim_body(1, priority=1))
    with redis.Redis.from_url(redis_url) as r:
        assert r.xlen(keys.stream("sim", Lane.LOW)) == 1
        assert r.xlen(keys.stream("sim", Lane.HIGH)) == 1


def test_a_full_backlog_answers_429_with_retry_after(paused):
    s = paused(max_job_backlog=3)
    with s.client() as c:
        codes = [submit(c, "sim", sim_body(i)).status_code for i in range(4)]
        r = submit(c, "sim", sim_body(9))
    assert codes[:3] == [202, 202, 202] and 429 in (codes[3], r.status_code)
    assert r.status_code == 429 and r.headers["retry-after"] == "5"
    assert "queued" in r.json()["error"]


def test_job_submissions_are_validated_like_infer(stack):
    s = stack(models=("sim",))
    with s.client() as c:
        assert submit(c, "nope", sim_body(1)).status_code == 404
        bad = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}
        r = submit(c, "sim", bad)
        assert r.status_code == 400 and "[-1, 4]" in r.json()["error"]
        r = c.post("/v2/models/sim/jobs", content=b"x", headers={"content-type": "text/plain"})
        assert r.status_code == 415


def test_binary_outputs_are_returned_when_the_submission_asked_for_them(stack):
    s = stack(models=("sim",))
    with s.client() as c:
        job = submit(c, "sim", sim_body(1, binary_data_output=True)).json()
        r = c.get(f"/v2/jobs/{job['id']}", params={"wait": 20})
        while "inference-header-content-length" not in r.headers:
            assert r.json()["status"] not in FINAL, r.text
            r = c.get(f"/v2/jobs/{job['id']}", params={"wait": 20})
    n = int(r.headers["inference-header-content-length"])
    header = json.loads(r.content[:n])
    assert header["status"] == "succeeded"
    size = header["result"]["outputs"][0]["parameters"]["binary_data_size"]
    assert len(r.content) - n == size == 4


def test_a_retry_after_a_refused_enqueue_makes_a_job_that_runs(paused, redis_url):
    s = paused()
    keys = Keys(s.namespace)
    low = keys.stream("sim", Lane.LOW)
    with redis.Redis.from_url(redis_url) as r, s.client() as c:
        # The enqueue (XADD) fails after the gateway has checked everything else.
        r.delete(low)
        r.set(low, b"not a stream")
        refused = submit(c, "sim", sim_body(1), **{"idempotency-key": "retry-1"})
        assert refused.status_code == 503 and "retry-after" in refused.headers
        # Nothing of the refused submission is left behind: no record, no key.
        assert r.keys(f"{s.namespace}:job:*") == []
        assert r.exists(keys.idempotency("sim", "retry-1")) == 0
        r.delete(low)
        retried = submit(c, "sim", sim_body(1), **{"idempotency-key": "retry-1"})
        assert retried.status_code == 202, retried.text
        assert "idempotent-replayed" not in retried.headers
        s.add_worker(("sim",))
        job = poll(c, retried.json()["id"])
    assert job["status"] == "succeeded" and job["result"]["outputs"][0]["data"] == [4.0]


def test_a_reused_idempotency_key_with_a_different_body_is_refused_with_422(stack):
    s = stack(models=("sim", "slow"))
    worker = s.workers[0]
    with s.client() as c:
        first = submit(c, "sim", sim_body(1), **{"idempotency-key": "order-7"})
        assert first.status_code == 202
        other = submit(c, "sim", sim_body(2), **{"idempotency-key": "order-7"})
        assert other.status_code == 422, other.text
        error = other.json()["error"]
        assert "order-7" in error and "different" in error
        assert first.json()["id"] not in error  # keys are per model, not per caller: no leak
        # The same request, sent again (as binary data this time), is the original job.
        body, headers = binary_body("x", np.ones((1, 4)))
        same = c.post(
            "/v2/models/sim/jobs",
            content=body,
            headers={**headers, "idempotency-key": "order-7"},
        )
        assert same.status_code == 202 and same.headers["idempotent-replayed"] == "true"
        assert same.json()["id"] == first.json()["id"]
        # The key's scope is the model: the same key for another model is another job.
        elsewhere = submit(c, "slow", sim_body(2), **{"idempotency-key": "order-7"})
        assert elsewhere.status_code == 202 and "idempotent-replayed" not in elsewhere.headers
        assert poll(c, first.json()["id"])["result"]["outputs"][0]["data"] == [4.0]
    assert worker.backend("sim").calls == 1


def _forged_id(now_ms: int) -> str:
    """What the red team made: a fresh time, random bits and the id's check recomputed (it was
    an unkeyed BLAKE2b anyone could run)."""
    body = now_ms.to_bytes(6, "big") + secrets.token_bytes(16)
    check = hashlib.blake2b(body, digest_size=2, person=b"inferq-job-id").digest()
    return base64.urlsafe_b64encode(body + check).decode()


def test_a_lost_record_is_410_even_when_its_id_is_stamped_ahead_of_this_gateways_clock(
    stack, redis_url
):
    """Gateways estimate the Redis clock each on its own, so a job another gateway issued can
    carry a stamp a few milliseconds after this one's now: still a job Redis lost, not an
    unknown id."""
    s = stack(models=("sim",))
    key = s.gateway.settings.job_id_mac_key()
    ahead_ms = int(time.time() * 1000) + 2_000
    job_id = new_job_id(ahead_ms, secrets.token_bytes(JOB_ID_RANDOM_BYTES), key)
    with s.client() as c:
        gone = c.get(f"/v2/jobs/{job_id}")
    assert gone.status_code == 410 and "Redis lost data" in gone.json()["error"], gone.text


def test_ids_no_gateway_issued_answer_404_and_a_lost_record_410(stack, redis_url):
    s = stack(models=("sim",))
    now_ms = int(time.time() * 1000)
    other_key = replace(s.gateway.settings, job_id_key="not this deployment's").job_id_mac_key()
    forged = [
        _forged_id(now_ms),
        new_job_id(now_ms, secrets.token_bytes(JOB_ID_RANDOM_BYTES), other_key),
    ]
    with s.client() as c:
        for job_id in forged:
            r = c.get(f"/v2/jobs/{job_id}")
            assert r.status_code == 404, r.text
            assert "no job" in r.json()["error"]
        job_id = submit(c, "sim", sim_body(1)).json()["id"]
        assert poll(c, job_id)["status"] == "succeeded"
        with redis.Redis.from_url(redis_url) as r:
            assert r.delete(Keys(s.namespace).job(job_id)) == 1  # as if Redis lost it
        gone = c.get(f"/v2/jobs/{job_id}")
    assert gone.status_code == 410 and "Redis lost data" in gone.json()["error"], gone.text

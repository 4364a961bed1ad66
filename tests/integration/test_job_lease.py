"""Every job answered 202 reaches a final state, even when the worker that started it dies or
the reply to its claim is lost: a running job is leased (``protocol.jobs``,
``consumer.leases``), and a job found running under a lapsed lease, or under the claiming
worker's own name, is run again.

Against the suite's real redis-server: the claim and renewal scripts themselves, a claim whose
reply was lost (the record says "running" for this worker before it ever ran the job), a
worker process SIGKILLed in the middle of a job, and a job whose entry is dead-lettered.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from protocol.jobs import CLAIM_SCRIPT, RENEW_SCRIPT
from protocol.keys import GROUP, Keys, Lane
from protocol.messages import EVENT_STATUS_FIELD, JOB_EVENT_FIELD
from protocol.registry import ModelMetadata, WorkerInfo
from tests.integration.test_webhooks import HOOKS
from tests.receiver import receiver
from tests.support import sim_body, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

LONG_MS = 3_600_000


@pytest.fixture
def r(redis_url: str) -> Any:
    with redis.Redis.from_url(redis_url) as client:
        yield client


def _claim(r: Any, keys: list[str], worker: str, lease_ms: int = 60_000) -> list[Any]:
    return list(r.eval(CLAIM_SCRIPT, len(keys), *keys, worker, lease_ms, 5))


def _lease(r: Any, key: str) -> int:
    return int(r.hget(key, "lease_until_ms"))


def test_the_claim_takes_queued_jobs_its_own_lost_claims_and_lapsed_leases_only(r, namespace):
    keys = [f"{namespace}:job:{name}" for name in ("queued", "mine", "live", "lapsed", "done")]
    for key, fields in zip(
        keys,
        [
            {"status": "queued"},
            {"status": "running", "worker": "w1", "lease_until_ms": 1},
            {"status": "running", "worker": "w2", "lease_until_ms": 2**50},
            {"status": "running", "worker": "w2", "lease_until_ms": 1},
            {"status": "succeeded", "worker": "w2", "lease_until_ms": 1},
        ],
        strict=True,
    ):
        r.hset(key, mapping=fields)
    missing = f"{namespace}:job:missing"
    replies = _claim(r, [*keys, missing], "w1")
    assert replies == [b"claimed", b"again", b"leased", b"again", b"succeeded", None]
    now_ms = int(r.time()[0]) * 1000
    for key in (keys[0], keys[1], keys[3]):
        assert r.hget(key, "status") == b"running" and r.hget(key, "worker") == b"w1"
        assert now_ms + 50_000 < _lease(r, key) < now_ms + 70_000
    assert r.hget(keys[0], "started_ms") == b"5"
    # Left alone: another worker's live lease, a finished job.
    assert r.hget(keys[2], "worker") == b"w2" and _lease(r, keys[2]) == 2**50
    assert r.hget(keys[4], "status") == b"succeeded" and r.hget(keys[4], "worker") == b"w2"


def test_the_heartbeat_renews_only_this_workers_leases_on_running_jobs(r, namespace):
    mine, theirs, done = (f"{namespace}:job:{n}" for n in ("mine", "theirs", "done"))
    r.hset(mine, mapping={"status": "running", "worker": "w1", "lease_until_ms": 1})
    r.hset(theirs, mapping={"status": "running", "worker": "w2", "lease_until_ms": 1})
    r.hset(done, mapping={"status": "failed", "worker": "w1", "lease_until_ms": 1})
    assert r.eval(RENEW_SCRIPT, 3, mine, theirs, done, "w1", 10_000) == [1, 0, 0]
    assert _lease(r, mine) > int(r.time()[0]) * 1000
    assert _lease(r, theirs) == 1 and _lease(r, done) == 1


def _job(c: httpx.Client, model: str, value: float) -> str:
    r = c.post(f"/v2/models/{model}/jobs", json=sim_body(value))
    assert r.status_code == 202, r.text
    job_id: str = r.json()["id"]
    return job_id


def _final(c: httpx.Client, job_id: str) -> dict[str, Any]:
    body: dict[str, Any] = c.get(f"/v2/jobs/{job_id}", params={"wait": 30}).json()
    return body


def test_a_job_whose_claim_reply_was_lost_is_run_by_that_worker_and_succeeds(stack, r):
    s = stack(workers=1, models=("sim",))
    s.wait_ready("sim")
    (worker,) = s.workers
    keys = Keys(s.namespace)
    with s.client() as c:
        with worker.paused():
            job_id = _job(c, "sim", 3)
            # As after a claim whose reply the connection lost: Redis ran it, the worker never
            # heard, and retries the claim.
            r.hset(
                keys.job(job_id),
                mapping={
                    "status": "running",
                    "worker": worker.worker.id,
                    "lease_until_ms": int(r.time()[0]) * 1000 + LONG_MS,
                },
            )
        done = _final(c, job_id)
    assert done["status"] == "succeeded", done
    assert done["result"]["outputs"][0]["data"] == [12.0]
    assert worker.worker.stats.jobs_run_again == 1
    again = "inferq_worker_jobs_run_again_total"
    assert worker.worker.metrics.registry.get_sample_value(again, {"model": "sim"}) == 1


def _worker_process(redis_url: str, namespace: str, repo: Path, worker_id: str) -> Any:
    return subprocess.Popen(
        [
            sys.executable, "-m", "inferq", "worker",
            "--redis", redis_url,
            "--namespace", namespace,
            "--model-repository", str(repo),
            "--models", "hold",
            "--worker-id", worker_id,
            "--heartbeat-s", "0.3",
            "--claim-idle-ms", "1500",
            "--metrics-port", "0",
            "--log-level", "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip


@pytest.mark.serial  # kills within one 3 s batch
def test_a_job_left_running_by_a_sigkilled_worker_is_run_again_by_another_and_succeeds(
    stack, r, redis_url, namespace, model_repo
):
    s = stack(workers=0)
    first = _worker_process(redis_url, namespace, model_repo, "doomed")
    try:
        s.wait_ready("hold")  # 3 s a batch: the kill comes while the job runs
        record = Keys(namespace).job
        with s.client() as c:
            job_id = _job(c, "hold", 2)
            wait_until(
                lambda: r.hget(record(job_id), "status") == b"running", 30, "the job running"
            )
            os.kill(first.pid, signal.SIGKILL)
            first.wait(10)
            second = s.add_worker(("hold",), worker_id="heir", claim_idle_ms=1500)
            done = _final(c, job_id)
        assert done["status"] == "succeeded", done
        assert done["result"]["outputs"][0]["data"] == [8.0]
        assert r.hget(record(job_id), "worker") == b"heir"
        assert second.worker.stats.jobs_run_again == 1
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()


def test_a_job_left_running_by_a_lost_worker_past_its_deadline_ends_failed(stack, r):
    s = stack(workers=1, models=("sim",))
    s.wait_ready("sim")
    (worker,) = s.workers
    key = Keys(s.namespace).job
    with s.client() as c:
        with worker.paused():
            r2 = c.post("/v2/models/sim/jobs", json=sim_body(1, timeout=200_000))  # 200 ms
            assert r2.status_code == 202
            job_id = r2.json()["id"]
            # Started by a worker that died: running, its lease long lapsed.
            r.hset(
                key(job_id), mapping={"status": "running", "worker": "gone", "lease_until_ms": 1}
            )
            deadline_ms = int(r.hget(key(job_id), "deadline_ms"))
            wait_until(lambda: int(r.time()[0]) * 1000 > deadline_ms + 1000, 10, "the deadline")
        done = _final(c, job_id)
    assert done["status"] == "failed", done
    assert "stopped renewing its lease" in done["error"]


def _strand_with_a_ghost(s: Any, r: Any) -> None:
    """Register the model with a worker that then stops, and a live-looking worker ("ghost")
    that never reads: the gateway accepts jobs, and nothing runs them."""
    keys = Keys(s.namespace)
    first = s.add_worker(("sim",))
    s.wait_ready("sim")
    first.stop()
    meta = ModelMetadata.decode(r.hget(keys.models, "sim"))
    ghost = WorkerInfo(id="ghost", host="h", pid=1, started_ms=0, models=(meta,))
    r.set(keys.worker("ghost"), ghost.encode())
    r.zadd(keys.workers, {"ghost": 10**15})
    s.wait_ready("sim")


@pytest.fixture
def hooks() -> Any:
    with receiver() as rec:
        yield rec


@pytest.mark.parametrize("record", ["queued", "running"])
def test_a_job_whose_entry_is_dead_lettered_ends_failed_with_its_event(stack, r, record, hooks):
    """A job that kept crashing its workers: its entry is dead-lettered after
    ``--max-deliveries``, and the job fails with that reason, whether its record was re-queued
    (its last worker's lease lapsed) or still says running (its lease had not yet)."""
    s = stack(workers=0, **HOOKS)
    keys = Keys(s.namespace)
    _strand_with_a_ghost(s, r)
    stream = keys.stream("sim", Lane.LOW)  # where jobs queue
    with s.client() as c:
        r2 = c.post("/v2/models/sim/jobs", json=sim_body(1, webhook=hooks.url))
        assert r2.status_code == 202, r2.text
        job_id = r2.json()["id"]
        wait_until(lambda: r.xlen(stream) >= 1, what="the job's entry queued")
        r.xreadgroup(GROUP, "ghost", {stream: ">"}, count=10)
        entry_id = r.xpending_range(stream, GROUP, "-", "+", 1)[0]["message_id"]
        # As if it had crashed five workers already.
        r.xclaim(stream, GROUP, "ghost", 0, [entry_id], retrycount=5, justid=True)
        if record == "running":
            r.hset(
                keys.job(job_id),
                mapping={"status": "running", "worker": "ghost", "lease_until_ms": 2**50},
            )
        worker = s.add_worker(("sim",), claim_idle_ms=100, max_deliveries=5)
        done = _final(c, job_id)
        assert done["status"] == "failed", done
        assert "dead-letter" in done["error"], done
        wait_until(lambda: len(hooks.accepted()) == 1, what="the webhook delivery")
    assert r.xlen(keys.dlq("sim")) == 1
    assert worker.backend("sim").calls == 0
    events = r.xrange(keys.job_events)
    mine = [f for _, f in events if f[JOB_EVENT_FIELD] == job_id.encode()]
    assert mine[-1][EVENT_STATUS_FIELD] == b"failed"
    (delivery,) = hooks.accepted()
    assert delivery.headers["inferq-event"] == "failed"
    assert delivery.json["status"] == "failed"

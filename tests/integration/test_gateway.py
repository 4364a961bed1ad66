"""Health, metadata, readiness, and what the gateway costs Redis."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis

from loadgen.http import HTTPConnection
from protocol.keys import Keys
from tests.support import sim_body, wait_until


def test_liveness_and_readiness_follow_redis_and_workers(stack):
    s = stack(workers=0)
    with s.client() as c:
        assert c.get("/v2/health/live").json() == {"live": True}
        r = c.get("/v2/health/ready")
        assert r.status_code == 503
        assert r.json() == {"ready": False, "problems": ["no live worker serves any model"]}
        s.add_worker()
        wait_until(
            lambda: c.get("/v2/health/ready").status_code == 200,
            what="readiness once a worker runs",
        )
        assert c.get("/v2/health/ready").json() == {"ready": True}


def test_readiness_reads_the_live_workers_from_redis_not_from_the_last_refresh(
    stack, redis_url, namespace
):
    """A worker's advertisement vanished (an evicting Redis took it) after the last periodic
    refresh: readiness says 503 at once, as the requests are refused, rather than 200 from what
    the registry last saw (issue #21: "ready", then 84 of 100 requests failed)."""
    s = stack(workers=0, registry_refresh_s=3600)  # no periodic refresh during the test
    worker = s.add_worker(heartbeat_s=60, worker_ttl_s=120)  # nor a heartbeat to re-advertise
    keys = Keys(namespace)
    s.wait_ready("sim")  # the model's readiness looks the worker up (one early refresh)
    with s.client() as c, redis.Redis.from_url(redis_url) as r:
        assert c.get("/v2/health/ready").status_code == 200
        assert r.delete(keys.worker(worker.worker.settings.worker_id)) == 1  # evicted
        ready = c.get("/v2/health/ready")
        assert ready.status_code == 503, ready.text
        assert ready.json()["problems"] == ["no live worker serves any model"]
        assert s.infer("sim", sim_body(1)).status_code == 503  # as readiness says


def test_server_metadata_lists_the_extensions(stack):
    with stack().client() as c:
        meta = c.get("/v2").json()
    assert meta["name"] == "inferq"
    assert {"binary_tensor_data", "schedule_policy"} <= set(meta["extensions"])


def test_model_metadata_is_what_the_workers_publish(stack):
    with stack().client() as c:
        meta = c.get("/v2/models/digits").json()
        versioned = c.get("/v2/models/digits/versions/1").json()
        ready = c.get("/v2/models/digits/versions/1/ready")
    assert meta == versioned
    assert meta["name"] == "digits" and meta["versions"] == ["1"]
    assert meta["platform"] == "onnxruntime_onnx"
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}]
    assert meta["outputs"] == [
        {"name": "logits", "datatype": "FP32", "shape": [-1, 10]},
        {"name": "label", "datatype": "INT64", "shape": [-1]},
    ]
    assert ready.status_code == 200 and ready.json()["ready"] is True


@pytest.mark.serial  # a thousand waiters must queue within one batch
def test_waiting_requests_hold_no_redis_connections(stack, redis_url):
    """1,000 requests waiting at once use the same handful of connections as one does."""
    s = stack(models=("hold",))  # 3 s per batch: everything sent meanwhile waits together
    gateway = s.gateway.gateway
    prefix = f"inferq-gateway-{gateway.settings.gateway_id}"

    def gateway_connections() -> int:
        with redis.Redis.from_url(redis_url) as r:
            return sum(1 for c in r.client_list() if c["name"].startswith(prefix))

    assert s.infer("hold", sim_body(1)).status_code == 200
    idle = gateway_connections()

    async def flood(n: int) -> list[int]:
        # loadgen's lean client, one connection per request: httpx took 7 s of this process's
        # CPU (which the gateway shares) to read the 1,000 answers.
        conns = [HTTPConnection.from_url(s.url, timeout=60) for _ in range(n)]

        async def one(i: int, conn: HTTPConnection) -> int:
            r = await conn.request(
                "POST",
                "/v2/models/hold/infer",
                json.dumps(sim_body(i)).encode(),
                {"content-type": "application/json"},
            )
            return r.status

        try:
            tasks = [asyncio.create_task(one(i, c)) for i, c in enumerate(conns)]
            # The first request may start a batch alone; every other one waits for the next.
            await asyncio.to_thread(
                wait_until, lambda: gateway.replies.waiting >= n - 1, 30, f"{n} waiting requests"
            )
            busy = await asyncio.to_thread(gateway_connections)
            statuses = await asyncio.gather(*tasks)
        finally:
            await asyncio.gather(*(c.aclose() for c in conns))
        return [busy, *statuses]

    busy, *statuses = asyncio.run(flood(1000))
    assert statuses == [200] * 1000
    assert busy <= idle + gateway.settings.redis.pool_size
    assert busy <= 2 + gateway.settings.redis.pool_size


def test_the_reply_listener_reconnects_without_losing_results(stack, redis_url, namespace, capsys):
    """A result published while the listener's connection is down is read after it reconnects.

    The listener's connection is killed and the reply published in one MULTI/EXEC, so the reply
    certainly lands while the listener is disconnected (it cannot have been delivered to the
    blocked read that the kill ends). A listener that resumed at ``$`` would never see it, and
    the request would wait out its deadline."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from protocol.keys import GROUP, Keys, Lane
    from protocol.messages import FIELD, InferRequest, InferResult, Status
    from protocol.registry import ModelMetadata, WorkerInfo
    from protocol.tensor import Tensor

    keys = Keys(namespace)
    s = stack(workers=1, models=("sim",))
    s.wait_ready("sim")
    s.workers[0].stop()  # no worker answers: the only reply is the one this test publishes
    gateway_id = s.gateway.gateway.settings.gateway_id
    stream = keys.stream("sim", Lane.NORMAL)
    with ThreadPoolExecutor(1) as pool, redis.Redis.from_url(redis_url) as r:
        meta = ModelMetadata.decode(r.hget(keys.models, "sim"))
        ghost = WorkerInfo(id="ghost", host="h", pid=1, started_ms=0, models=(meta,))
        r.set(keys.worker("ghost"), ghost.encode())
        r.zadd(keys.workers, {"ghost": 10**15})  # a live-looking worker, so the gateway queues
        s.wait_ready("sim")
        waiting = pool.submit(s.infer, "sim", sim_body(3, timeout=10_000_000))
        wait_until(lambda: r.xlen(stream) == 1, what="the request queued")
        request = InferRequest.decode(r.xrange(stream)[0][1][FIELD])
        r.xreadgroup(GROUP, "ghost", {stream: ">"}, count=1)  # the worker that then vanished
        result = InferResult(
            id=request.id,
            status=Status.OK,
            model="sim",
            version=request.version,
            outputs=[Tensor.from_numpy("sum", np.array([[12.0]], dtype=np.float32))],
            worker="ghost",
        )
        (listener,) = [
            c["id"] for c in r.client_list() if c["name"] == f"inferq-gateway-replies-{gateway_id}"
        ]
        tx = r.pipeline(transaction=True)
        tx.execute_command("CLIENT", "KILL", "ID", listener)
        tx.xadd(request.reply_to, {FIELD: result.encode()})
        killed, _ = tx.execute()
        response = waiting.result()
    with capsys.disabled():
        print(
            f"\nchaos[7 reply reader killed]: sent=1 published_while_disconnected=1 "
            f"connections_killed={killed} status={response.status_code} "
            f"correct={int(response.json().get('outputs', [{}])[0].get('data') == [12.0])}"
        )
    assert killed == 1
    assert response.status_code == 200 and response.json()["outputs"][0]["data"] == [12.0]

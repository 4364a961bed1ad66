"""inferq on a real Redis Cluster (3 masters): every path a user takes, answers checked per
request id, keys shown to spread over the masters."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import redis
import redis.cluster
from redis.crc import key_slot

from inferq.cli import main
from protocol.keys import GROUP, Keys, Lane, hash_tag
from protocol.messages import FIELD, InferResult, Status
from tests.cluster.conftest import PARTITIONS
from tests.conftest import DIGITS
from tests.localcluster import LocalCluster
from tests.support import sim_body, sim_request, wait_until

# serial: its cluster fails a node over when it is starved for 2 s.
pytestmark = pytest.mark.serial

SAMPLES = json.loads((DIGITS / "samples.json").read_text())


def digits_body(i: int) -> dict[str, Any]:
    row = SAMPLES["inputs"][i % len(SAMPLES["inputs"])]
    return {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": row}]}


def cluster_client(c: LocalCluster) -> redis.cluster.RedisCluster:
    return redis.cluster.RedisCluster(host="127.0.0.1", port=c.ports[0])


def entries_read(r: Any, stream: str) -> int:
    group = next(g for g in r.xinfo_groups(stream) if g["name"] == GROUP.encode())
    return int(group["entries-read"] or 0)


def json_of(out: str) -> Any:
    """The JSON document a command printed (log lines of background threads may surround it)."""
    lines = out.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line[:1] in ("{", "["))
    text = "".join(lines[start:])
    return json.JSONDecoder().raw_decode(text)[0]


def sums(response: Any) -> list[float]:
    return next(o for o in response.json()["outputs"] if o["name"] == "sum")["data"]


def test_sync_infer_answers_every_model_correctly_with_their_streams_on_several_masters(
    cluster_stack, redis_cluster
):
    s = cluster_stack(models=("digits", "sim", "echo"))
    keys = Keys(s.namespace)
    masters = {
        redis_cluster.master_of(keys.stream(m, Lane.NORMAL)).port for m in ("digits", "sim", "echo")
    }
    assert len(masters) >= 2  # different models, different slots, different masters

    def call(i: int) -> tuple[int, bool]:
        if i % 3 == 0:
            r = c.post(
                "/v2/models/digits/infer",
                json=digits_body(i),
                headers={"cache-control": "no-cache"},
            )
            label = next(o for o in r.json()["outputs"] if o["name"] == "label")["data"][0]
            return i, r.status_code == 200 and label == SAMPLES["labels"][i % 10]
        model = "sim" if i % 3 == 1 else "echo"
        r = c.post(f"/v2/models/{model}/infer", json=sim_body(float(i)))
        return i, r.status_code == 200 and sums(r) == [4.0 * i]

    with s.client() as c, ThreadPoolExecutor(8) as pool:
        results = dict(pool.map(call, range(150)))
    assert [i for i, ok in results.items() if not ok] == []


def test_a_single_seed_is_enough_and_cluster_mode_is_detected(cluster_stack, redis_cluster):
    s = cluster_stack(models=("sim",), url=redis_cluster.seed_url(2))
    assert s.gateway is not None and s.gateway.gateway.broker.kind == "cluster"
    assert s.workers[0].worker.groups[0].reads.address is not None
    r = s.infer("sim", sim_body(2.5))
    assert r.status_code == 200 and sums(r) == [10.0]


def test_connections_stay_flat_per_node_under_many_concurrent_requests(
    cluster_stack, redis_cluster
):
    s = cluster_stack(models=("sim",))
    gateway_name = f"inferq-gateway-{s.gateway.settings.gateway_id}"  # type: ignore[union-attr]

    def count() -> dict[int, int]:
        out = {}
        for port in redis_cluster.ports:
            with redis_cluster.client(port) as r:
                out[port] = sum(1 for c in r.client_list() if c["name"] == gateway_name)
        return out

    def client_loop(k: int) -> list[int]:
        with s.client() as c:
            return [
                c.post("/v2/models/sim/infer", json=sim_body(k * 10 + i)).status_code
                for i in range(10)
            ]

    peak: dict[int, int] = {}
    with ThreadPoolExecutor(40) as pool:
        calls = [pool.submit(client_loop, k) for k in range(40)]
        while not all(f.done() for f in calls):
            for port, n in count().items():
                peak[port] = max(peak.get(port, 0), n)
        statuses = [code for f in calls for code in f.result()]
    assert statuses == [200] * 400
    # The command client's gate: at most pool_size (8) per node, whatever the concurrency (the
    # blocking readers have names of their own).
    assert sum(peak.values()) > 0
    assert max(peak.values()) <= 8, peak


def test_jobs_submit_poll_cancel_and_idempotency_on_a_cluster(cluster_stack, redis_cluster):
    s = cluster_stack(models=("sim",))
    keys = Keys(s.namespace)
    with s.client() as c:
        r = c.post("/v2/models/sim/jobs", json=sim_body(3))
        assert r.status_code == 202
        job = r.json()["id"]
        done = c.get(f"/v2/jobs/{job}", params={"wait": 10}).json()
        assert done["status"] == "succeeded"
        assert done["result"]["outputs"][0]["data"] == [12.0]

        first = c.post("/v2/models/sim/jobs", json=sim_body(5), headers={"idempotency-key": "k-1"})
        again = c.post("/v2/models/sim/jobs", json=sim_body(5), headers={"idempotency-key": "k-1"})
        assert first.status_code == again.status_code == 202
        assert again.json()["id"] == first.json()["id"]
        assert again.headers["idempotent-replayed"] == "true"
        # The record and its key share a slot (the job id carries the key's tag).
        record, key = keys.job(first.json()["id"]), keys.idempotency("sim", "k-1")
        assert hash_tag(record) == hash_tag(key)
        with cluster_client(redis_cluster) as r:
            assert r.exists(record) and r.get(key).decode().split()[0] == first.json()["id"]

    # Cancel a job no worker has started: stop the worker first.
    s.workers[0].stop()
    with s.client() as c:
        queued = c.post("/v2/models/sim/jobs", json=sim_body(7)).json()["id"]
        cancelled = c.delete(f"/v2/jobs/{queued}")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        assert c.delete(f"/v2/jobs/{queued}").json()["status"] == "cancelled"
        assert c.get("/v2/jobs/AAAAAAAAAAAAAAAAAAAAAA").status_code == 404


def test_a_job_long_poll_wakes_from_the_job_events_stream(cluster_stack):
    s = cluster_stack(models=("sim",), reply_block_ms=2000)
    s.workers[0].stop()
    with s.client() as c:
        job = c.post("/v2/models/sim/jobs", json=sim_body(1)).json()["id"]
        with ThreadPoolExecutor(1) as pool:
            started = time.monotonic()
            waiting = pool.submit(c.get, f"/v2/jobs/{job}", params={"wait": 30})
            s.add_worker(("sim",))
            assert waiting.result().json()["status"] == "succeeded"
        assert time.monotonic() - started < 20


def test_a_cache_hit_on_a_cluster_never_reaches_a_worker(cluster_stack):
    s = cluster_stack(models=("cached",))
    first = s.infer("cached", sim_body(9))
    assert first.headers["x-inferq-cache"] == "miss" and sums(first) == [36.0]
    executed = s.workers[0].stats.requests
    second = s.infer("cached", sim_body(9))
    assert second.headers["x-inferq-cache"] == "hit" and sums(second) == [36.0]
    assert s.workers[0].stats.requests == executed


def test_a_partitioned_model_spreads_over_several_masters_and_answers_correctly(
    cluster_stack, redis_cluster
):
    s = cluster_stack(workers=2, models=("wide",))
    keys = Keys(s.namespace)
    streams = [keys.stream("wide", Lane.NORMAL, p) for p in range(PARTITIONS)]
    assert len({hash_tag(st) for st in streams}) == PARTITIONS
    assert len({redis_cluster.master_of(st).port for st in streams}) >= 2

    with s.client() as c, ThreadPoolExecutor(16) as pool:
        answers = list(
            pool.map(
                lambda i: (i, c.post("/v2/models/wide/infer", json=sim_body(float(i)))), range(240)
            )
        )
    wrong = [i for i, r in answers if r.status_code != 200 or sums(r) != [4.0 * i]]
    assert wrong == []

    with cluster_client(redis_cluster) as r:
        read = [entries_read(r, st) for st in streams]
    assert sum(read) == 240
    assert all(n == 240 // PARTITIONS for n in read)  # round-robin from one gateway


def test_inferq_lag_and_the_stream_gauges_show_partitions_and_totals(
    cluster_stack, redis_cluster, capsys
):
    s = cluster_stack(models=("wide", "sim"), stream_gauges_s=0.2)
    for w in s.workers:
        w.stop()
    keys = Keys(s.namespace)
    with cluster_client(redis_cluster) as r:
        now = int(time.time() * 1000)
        for p in range(PARTITIONS):
            for i in range(p + 1):
                request = sim_request(keys, f"p{p}-{i}", now)
                r.xadd(keys.stream("wide", Lane.LOW, p), {FIELD: request.encode()})
    total = sum(p + 1 for p in range(PARTITIONS))

    lag = ["lag", "--redis", redis_cluster.url, "--namespace", s.namespace, "--sample-s", "0"]
    capsys.readouterr()
    assert main([*lag, "--json"], environ={}) == 0
    doc = json_of(capsys.readouterr().out)
    wide = [lane for lane in doc["lanes"] if lane["model"] == "wide" and lane["lane"] == "low"]
    assert sorted((lane["partition"], lane["lag"]) for lane in wide) == [
        (p, p + 1) for p in range(PARTITIONS)
    ]
    assert next(m for m in doc["models"] if m["model"] == "wide")["backlog"] == total

    assert main(lag, environ={}) == 0
    table = capsys.readouterr().out.splitlines()
    assert any(line.split()[:3] == ["MODEL", "PART", "LANE"] for line in table)
    assert any(line.split()[:3] == ["wide", "all", "total"] for line in table)

    with s.client() as c:

        def gauges() -> str:
            return c.get("/metrics").text

        wait_until(
            lambda: f'inferq_stream_lag{{lane="low",model="wide"}} {float(total)}' in gauges(),
            what="the stream gauges to sum the partitions",
        )
        text = gauges()
    assert f'inferq_model_backlog{{model="wide"}} {float(total)}' in text
    for p in range(PARTITIONS):
        line = f'inferq_stream_partition_backlog{{model="wide",partition="{p}"}} {float(p + 1)}'
        assert line in text


def test_a_poison_request_reaches_the_dead_letter_stream_and_inferq_dlq_replays_it(
    cluster_stack, redis_cluster, capsys
):
    s = cluster_stack(workers=0)
    keys = Keys(s.namespace)
    stream = keys.stream("sim", Lane.NORMAL)
    with cluster_client(redis_cluster) as r:
        now = int(time.time() * 1000)
        entry = r.xadd(stream, {FIELD: sim_request(keys, "poison-1", now).encode()})
        r.xgroup_create(stream, GROUP, id="0", mkstream=True)
        r.xreadgroup(GROUP, "crashed-1", {stream: ">"})
        for i in range(5):  # each XCLAIM counts a delivery: five crashed workers
            r.xclaim(stream, GROUP, f"crashed-{i + 2}", 0, [entry])
    worker = s.add_worker(("sim",), claim_idle_ms=100)
    with cluster_client(redis_cluster) as r:
        wait_until(lambda: r.xlen(keys.dlq("sim")) == 1, what="the entry dead-lettered")
        wait_until(lambda: r.xpending(stream, GROUP)["pending"] == 0, what="the entry acked")
    assert worker.stats.dead_lettered == 1

    dlq = ["dlq", "--redis", redis_cluster.url, "--namespace", s.namespace]
    capsys.readouterr()
    assert main([*dlq, "list", "--json"], environ={}) == 0
    listing = json_of(capsys.readouterr().out)
    assert listing["sim"]["total"] == 1
    letter = listing["sim"]["entries"][0]
    assert letter["request"]["id"] == "poison-1"

    assert main([*dlq, "retry", "--model", "sim", "--all"], environ={}) == 0
    assert "replayed 1 of 1" in capsys.readouterr().out
    with cluster_client(redis_cluster) as r:
        wait_until(lambda: r.get(keys.result("poison-1")) is not None, what="the replay to run")
        result = InferResult.decode(r.get(keys.result("poison-1")))
        assert result.status is Status.OK
        assert np.asarray(result.outputs[0].to_numpy()).ravel().tolist() == [4.0]
        assert r.xlen(keys.dlq("sim")) == 0


def test_a_hot_swap_on_a_cluster(cluster_stack, redis_cluster, tmp_path):
    from tests.integration.test_model_control import AUTH, TOKEN, admin, make_repo

    repo = make_repo(tmp_path, ["1", "2"])
    s = cluster_stack(workers=0, admin_token=TOKEN)
    s.repo = repo
    for _ in range(2):
        s.add_worker(retire_after_s=1.0)
    s.wait_ready("digits")
    assert s.infer("digits", digits_body(0)).json()["model_version"] == "1"
    loaded = admin(s, "/v2/repository/models/digits/load", {"parameters": {"version": "2"}})
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["versions"] == ["2"]
    versions = {
        s.infer("digits", digits_body(i), **{"cache-control": "no-cache"}).json()["model_version"]
        for i in range(20)
    }
    assert versions == {"2"}
    assert AUTH  # the token the stack's gateway checks


@pytest.mark.parametrize("model", ["sim"])
def test_workers_hold_one_blocking_connection_per_slot_group(cluster_stack, model):
    s = cluster_stack(models=(model, "wide"))
    groups = s.workers[0].worker.groups
    streams = [st for g in groups for st in g.streams]
    assert len(streams) == 3 * (1 + PARTITIONS)  # a partition's three lanes share a slot
    # One group, and one blocking connection, per slot.
    assert len(groups) == len({key_slot(st.encode()) for st in streams})
    assert all(len({key_slot(st.encode()) for st in g.streams}) == 1 for g in groups)


def test_inferq_models_reads_the_registry_of_a_cluster(cluster_stack, redis_cluster, capsys):
    s = cluster_stack(models=("sim", "wide"))
    capsys.readouterr()
    args = ["models", "list", "--redis", redis_cluster.url, "--namespace", s.namespace, "--json"]
    assert main(args, environ={}) == 0
    listing = json_of(capsys.readouterr().out)
    rows = listing if isinstance(listing, list) else listing["models"]
    assert {row["name"] for row in rows} == {"sim", "wide"}


def test_auth_on_a_cluster_works_as_on_one_redis(namespace, cluster_repo):
    from tests.support import GatewayThread, Stack, WorkerThread

    started: list[GatewayThread | WorkerThread] = []
    with LocalCluster(masters=3, password="s3cret") as cluster:
        try:
            assert ":s3cret@" in cluster.url
            s = Stack(cluster.url, namespace, cluster_repo, started)
            s.add_worker(("sim",))
            s.start_gateway()
            r = s.infer("sim", sim_body(2.0))
            assert r.status_code == 200 and sums(r) == [8.0]
        finally:
            for thing in reversed(started):
                thing.stop()


def test_a_model_folder_added_on_a_cluster_is_loaded_read_on_its_slots_and_counted(
    cluster_stack, tmp_path
):
    """The new model's partitions live on other slots than digits: the worker opens a read
    group (and a blocking connection) per new slot, and the statistics' MGET of the workers'
    keys works on a cluster."""
    from tests.integration.test_model_control import TOKEN, admin, make_repo
    from tests.support import write_simulated_model

    repo = make_repo(tmp_path, ["1"])
    s = cluster_stack(workers=0, admin_token=TOKEN)
    s.repo = repo
    s.add_worker()
    s.wait_ready("digits")
    write_simulated_model(repo, "late", base_ms=1, per_row_ms=0, max_batch=8, partitions=3)
    loaded = admin(s, "/v2/repository/models/late/load")
    assert loaded.status_code == 200, loaded.text
    for i in range(12):
        r = s.infer("late", sim_body(float(i)))
        assert r.status_code == 200, r.text
        assert sums(r) == [4.0 * i]
    groups = s.workers[0].worker.groups
    late = {st for g in groups for st in g.streams if ":{late" in st}
    assert len(late) == 3 * 3
    assert all(len({key_slot(st.encode()) for st in g.streams}) == 1 for g in groups)

    def counted() -> int:
        with s.client() as c:
            [row] = c.get("/v2/models/late/stats").json()["model_stats"]
        return int(row["inference_stats"]["success"]["count"])

    wait_until(lambda: counted() == 12, what="the statistics of the new model")

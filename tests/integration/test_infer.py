"""Submit-and-wait through real HTTP, a real Redis, a real gateway and real workers."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import redis
import tritonclient.http as triton

from protocol.keys import Keys, Lane
from tests.support import sim_body, wait_until

SAMPLES = json.loads((Path(__file__).parents[2] / "models/digits/samples.json").read_text())


def digits_body(rows: list[list[float]], **extra: object) -> dict[str, object]:
    flat = [x for row in rows for x in row]
    return {
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [len(rows), 64], "data": flat}],
        **extra,
    }


def test_known_digits_are_classified_correctly(stack):
    s = stack(workers=2)
    for row, label in zip(SAMPLES["inputs"], SAMPLES["labels"], strict=True):
        r = s.infer("digits", digits_body([row], id="req-7"))
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"] == "req-7"
        assert body["model_name"] == "digits" and body["model_version"] == "1"
        outputs = {o["name"]: o for o in body["outputs"]}
        assert outputs["label"]["data"] == [label]
        assert outputs["logits"]["shape"] == [1, 10]
        assert int(np.argmax(outputs["logits"]["data"])) == label


def test_a_multi_row_request_gets_one_row_back_per_input_row(stack):
    s = stack()
    r = s.infer("digits", digits_body(SAMPLES["inputs"]))
    assert r.status_code == 200, r.text
    label = next(o for o in r.json()["outputs"] if o["name"] == "label")
    assert label["shape"] == [10] and label["data"] == SAMPLES["labels"]


def test_only_the_requested_outputs_are_returned(stack):
    s = stack()
    r = s.infer("digits", digits_body(SAMPLES["inputs"][:1], outputs=[{"name": "label"}]))
    assert [o["name"] for o in r.json()["outputs"]] == ["label"]


def test_tritonclient_works_unmodified(stack):
    s = stack(workers=2)
    client = triton.InferenceServerClient(s.url.removeprefix("http://"))
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("digits")
        meta = client.get_model_metadata("digits")
        assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}]
        batch = np.array(SAMPLES["inputs"], dtype=np.float32)
        for binary in (True, False):
            inp = triton.InferInput("input", list(batch.shape), "FP32")
            inp.set_data_from_numpy(batch, binary_data=binary)
            result = client.infer(
                "digits", [inp], request_id="t1", headers={"cache-control": "no-cache"}
            )
            assert result.get_response()["id"] == "t1"
            assert result.as_numpy("label").tolist() == SAMPLES["labels"]
            assert result.as_numpy("logits").shape == (10, 10)
        # Named outputs with binary data, and the V2 timeout/priority parameters.
        inp = triton.InferInput("input", [1, 64], "FP32")
        inp.set_data_from_numpy(batch[:1])
        out = triton.InferRequestedOutput("label", binary_data=True)
        result = client.infer("digits", [inp], outputs=[out], timeout=5_000_000, priority=1)
        assert result.as_numpy("label").tolist() == SAMPLES["labels"][:1]
        assert result.as_numpy("logits") is None
    finally:
        client.close()


def test_binary_extension_round_trip_over_raw_http(stack):
    s = stack()
    rows = np.array(SAMPLES["inputs"][:3], dtype="<f4")
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "datatype": "FP32",
                    "shape": [3, 64],
                    "parameters": {"binary_data_size": rows.nbytes},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    with s.client() as c:
        r = c.post(
            "/v2/models/digits/infer",
            content=header + rows.tobytes(),
            headers={
                "inference-header-content-length": str(len(header)),
                "content-type": "application/octet-stream",
            },
        )
    assert r.status_code == 200, r.text
    n = int(r.headers["inference-header-content-length"])
    meta = json.loads(r.content[:n])
    blobs = r.content[n:]
    offset = 0
    arrays = {}
    for o in meta["outputs"]:
        size = o["parameters"]["binary_data_size"]
        dtype = {"FP32": "<f4", "INT64": "<i8"}[o["datatype"]]
        arrays[o["name"]] = np.frombuffer(blobs[offset : offset + size], dtype).reshape(o["shape"])
        offset += size
    assert offset == len(blobs)
    assert arrays["label"].tolist() == SAMPLES["labels"][:3]


def test_batches_form_under_concurrency(stack):
    s = stack(models=("slow",))
    worker = s.workers[0]
    with ThreadPoolExecutor(16) as pool:
        first = pool.submit(s.infer, "slow", sim_body(0))
        # While the first batch runs (300 ms), more requests queue up in the stream.
        wait_until(lambda: worker.backend("slow").calls == 1, what="the first batch to start")
        rest = [pool.submit(s.infer, "slow", sim_body(i)) for i in range(1, 13)]
        responses = [first.result(), *(f.result() for f in rest)]
    for i, r in enumerate(responses):
        assert r.status_code == 200, r.text
        assert r.json()["outputs"][0]["data"] == [4.0 * i]  # each gets its own row back
    assert max(worker.stats.batch_sizes) > 1
    assert worker.backend("slow").calls < len(responses)


def test_digits_under_concurrency_batch_and_stay_correct(stack):
    s = stack(workers=1)
    rows = SAMPLES["inputs"] * 10
    with ThreadPoolExecutor(32) as pool:
        futures = [
            pool.submit(s.infer, "digits", digits_body([row]), **{"cache-control": "no-cache"})
            for row in rows
        ]
        labels = [
            next(o for o in f.result().json()["outputs"] if o["name"] == "label")["data"][0]
            for f in futures
        ]
    assert labels == SAMPLES["labels"] * 10
    assert sum(s.workers[0].stats.batch_sizes) == len(rows)


@pytest.mark.serial  # the late request must arrive within one 200 ms call
def test_a_short_deadline_while_workers_are_busy_gets_504_and_never_runs(stack):
    s = stack(models=("serial",))
    worker = s.workers[0]
    with ThreadPoolExecutor(2) as pool:
        busy = pool.submit(s.infer, "serial", sim_body(1))
        wait_until(lambda: worker.backend("serial").calls == 1, what="the worker to be busy")
        late = s.infer("serial", sim_body(2, timeout=20_000))  # 20 ms, in microseconds
        assert late.status_code == 504
        assert "deadline" in late.json()["error"]
        assert busy.result().status_code == 200
    wait_until(lambda: worker.stats.expired == 1, what="the late request to be dropped")
    assert worker.backend("serial").calls == 1
    assert worker.stats.requests == 1


def test_a_cache_hit_never_reaches_a_worker(stack):
    s = stack()
    body = digits_body(SAMPLES["inputs"][:1])
    first = s.infer("digits", body)
    assert first.headers["x-inferq-cache"] == "miss"
    executed = s.workers[0].stats.requests
    second = s.infer("digits", body)
    assert second.status_code == 200
    assert second.headers["x-inferq-cache"] == "hit"
    assert second.json()["outputs"] == first.json()["outputs"]
    assert s.workers[0].stats.requests == executed
    bypass = s.infer("digits", body, **{"cache-control": "no-cache"})
    assert bypass.headers["x-inferq-cache"] == "miss"
    assert s.workers[0].stats.requests == executed + 1


def test_high_priority_requests_overtake_queued_normal_ones(stack):
    s = stack(models=("serial",))
    worker = s.workers[0]
    done: list[str] = []

    def call(name: str, **params: object) -> None:
        r = s.infer("serial", sim_body(len(done), **params))
        assert r.status_code == 200, r.text
        done.append(name)

    with ThreadPoolExecutor(5) as pool:
        pool.submit(call, "first")
        wait_until(lambda: worker.backend("serial").calls == 1, what="the worker to be busy")
        keys = Keys(s.namespace)
        normal_stream, high_stream = (
            keys.stream("serial", lane) for lane in (Lane.NORMAL, Lane.HIGH)
        )
        # Everything is queued while the worker is frozen, so how fast the requests arrive on a
        # loaded machine cannot decide the order; only the lanes can.
        with worker.paused(), redis.Redis.from_url(s.redis_url) as r:
            normal = [pool.submit(call, f"normal-{i}") for i in range(3)]
            wait_until(
                lambda: r.xinfo_stream(normal_stream)["entries-added"] == 4,
                what="three queued normal requests",
            )
            high = pool.submit(call, "high", priority=1)
            wait_until(lambda: r.exists(high_stream) == 1, what="the queued high request")
        for f in [*normal, high]:
            f.result()
    # The worker reads ahead at most one batch (one request here), so the high-priority request
    # overtakes every normal one still in the stream.
    overtaken = [
        n for n in ("normal-0", "normal-1", "normal-2") if done.index(n) > done.index("high")
    ]
    assert len(overtaken) >= 2


@pytest.mark.parametrize("workers", [2])
def test_every_worker_takes_a_share_of_the_load(stack, workers):
    s = stack(workers=workers, models=("slow",))
    with ThreadPoolExecutor(24) as pool:
        responses = list(pool.map(lambda i: s.infer("slow", sim_body(i)), range(24)))
    assert all(r.status_code == 200 for r in responses)
    assert all(w.stats.requests > 0 for w in s.workers)


def test_a_tiny_models_batches_run_on_the_event_loop_and_a_slow_ones_on_its_thread(stack):
    """The digits MLP answers in microseconds: once measured (on its thread, where every model
    starts) its batches run inline, skipping the hand-off to the thread. The simulated model
    sleeps 1 ms a call, over ``consumer.inline.INLINE_MAX_S``: never inline."""
    s = stack(models=("digits", "sim"))
    stats = s.workers[0].worker.stats
    row, label = SAMPLES["inputs"][0], SAMPLES["labels"][0]
    for _ in range(50):  # a stall on this shared machine may cost a few calls on the thread
        r = s.infer("digits", digits_body([row], parameters={"cache": False}))
        assert r.status_code == 200 and r.json()["outputs"][1]["data"] == [label]
        if stats.inline_batches >= 3:
            break
    assert stats.inline_batches >= 3
    before = stats.inline_batches
    for i in range(3):
        assert s.infer("sim", sim_body(i, cache=False)).status_code == 200
    assert stats.inline_batches == before

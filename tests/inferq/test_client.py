"""inferq.client against a real stack: sync and asyncio inference (JSON and binary, numpy in and
out), jobs (result, cancel, events), batches with progress, and retries after Retry-After."""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np
import pytest
import redis

from inferq.client import AsyncClient, Client, InferqError, infer_body, read_result
from protocol.keys import Keys, Lane
from tests.support import wait_until

pytestmark = pytest.mark.integration

X = np.arange(8, dtype=np.float32).reshape(2, 4)
SUMS = X.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_infer_takes_and_gives_numpy_arrays(stack, binary):
    s = stack(models=("sim",))
    with Client(s.url) as client:
        result = client.infer("sim", {"x": X}, binary=binary)
    assert result.model_name == "sim"
    assert result["sum"].dtype == np.float32
    np.testing.assert_array_equal(result["sum"], SUMS)
    if binary:
        assert result.raw["outputs"][0]["parameters"]["binary_data_size"] == 8


def test_the_asyncio_client_infers_and_runs_jobs(stack):
    s = stack(models=("sim",))

    async def main():
        async with AsyncClient(s.url) as client:
            result = await client.infer("sim", {"x": X}, binary=True)
            job = await client.submit("sim", {"x": X})
            done = await job.result(timeout=30)
            batch = await client.batch([{"inputs": _inputs(1.0)}], model="sim")
            final = await batch.wait(timeout=30)
            lines = [doc async for doc in batch.output()]
            return result, done, final, lines

    result, done, final, lines = asyncio.run(main())
    np.testing.assert_array_equal(result["sum"], SUMS)
    np.testing.assert_array_equal(done["sum"], SUMS)
    assert final["status"] == "completed" and len(lines) == 1


def test_a_job_handle_gives_status_result_events_and_cancel(stack):
    s = stack(models=("sim",))
    with Client(s.url) as client:
        job = client.submit("sim", {"x": X}, binary=True)
        np.testing.assert_array_equal(job.result(timeout=30)["sum"], SUMS)
        assert job.status()["status"] == "succeeded"
        statuses = [e["data"]["status"] for e in job.events()]
        assert statuses == ["queued", "running", "succeeded"]
        with s.workers[0].paused():
            waiting = client.submit("sim", {"x": X})
            assert waiting.cancel()["status"] == "cancelled"
        with pytest.raises(InferqError, match="cancelled"):
            waiting.result(timeout=5)
        with pytest.raises(InferqError) as e:
            client.infer("nope", {"x": X})
        assert e.value.status == 404


def test_a_batch_handle_reports_progress_and_streams_its_answers(stack):
    s = stack(models=("sim",))
    lines = [
        {"custom_id": f"r{i}", "url": "/v2/models/sim/infer", "body": {"inputs": _inputs(i)}}
        for i in range(40)
    ]
    with Client(s.url) as client:
        batch = client.batch([*lines, b"{broken"], metadata={"k": "v"})
        seen = []
        final = batch.wait(timeout=60, progress=seen.append, poll_s=0.05)
        assert final["status"] == "completed" and seen[-1] == final
        assert final["request_counts"] == {"total": 41, "completed": 40, "failed": 1}
        out = list(batch.output())
        assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(40)]
        assert out[3]["response"]["body"]["outputs"][0]["data"] == [12.0]
        assert [e["line"] for e in batch.errors()] == [41]
        assert client.get_batch(batch.id).last["metadata"] == {"k": "v"}


def test_a_429_is_retried_after_the_time_retry_after_names(stack):
    """--max-job-backlog 1 with the one worker paused: jobs are refused (429) once the gateway
    sees the backlog, until the worker runs them; the client waits as told and gets in.

    A read the worker had in flight when it froze may take the first job, which is then no
    longer backlog (the group's lag) once the gateway next refreshes: a refusal counts only
    once Redis reports a job unread, so that the refusals last until the worker runs."""
    s = stack(models=("sim",), max_job_backlog=1)
    low = Keys(s.namespace).stream("sim", Lane.LOW)
    with (
        contextlib.ExitStack() as paused,
        Client(s.url, retries=0) as plain,
        redis.Redis.from_url(s.redis_url) as r,
    ):
        paused.enter_context(s.workers[0].paused())
        queued = []

        def refused() -> bool:
            try:
                queued.append(plain.submit("sim", {"x": X}))
            except InferqError as e:
                return e.status == 429 and r.xinfo_groups(low)[0]["lag"] >= 1
            return False

        wait_until(refused, what="a submission refused at the backlog", poll_s=0.05)
        waits: list[float] = []

        def sleep(seconds: float) -> None:
            waits.append(seconds)
            paused.close()  # the worker runs the queued jobs: the backlog empties
            for job in queued:
                job.result(timeout=30)
            # Then wait as told (capped), as the client would: the gateway sees the backlog
            # empty only at its next backlog refresh, and a retry sooner is refused again.
            time.sleep(min(seconds, 1.0))

        with Client(s.url, sleep=sleep, retries=10) as client:
            second = client.submit("sim", {"x": X}, idempotency_key="second")
            np.testing.assert_array_equal(second.result(timeout=30)["sum"], SUMS)
    assert waits and waits[0] > 0, "the client did not wait before retrying"


def test_requests_are_built_and_read_back_without_a_server():
    body, headers = infer_body({"x": X}, binary=True)
    length = int(headers["inference-header-content-length"])
    assert body[length:] == X.tobytes()
    doc = {
        "model_name": "m",
        "outputs": [
            {"name": "a", "datatype": "INT64", "shape": [2], "data": [1, 2]},
            {"name": "b", "datatype": "FP32", "shape": [1], "parameters": {"binary_data_size": 4}},
        ],
    }
    result = read_result(doc, np.array([2.5], dtype="<f4").tobytes())
    assert result["a"].tolist() == [1, 2] and result["b"].tolist() == [2.5]


def _inputs(value: float) -> list[dict]:
    return [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [float(value)] * 4}]

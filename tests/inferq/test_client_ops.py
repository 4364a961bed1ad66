"""inferq.client's operations without a server (httpx.MockTransport): the Retry-After retry,
the idempotent submission after a lost connection, job and batch endings, streams, and that
the sync and asyncio clients send the same requests for the same calls."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
import numpy as np
import pytest

from inferq.client import (
    AsyncClient,
    Batch,
    Call,
    Client,
    InferqError,
    Sleep,
    retried,
)

X = np.arange(4, dtype=np.float32).reshape(1, 4)
JOB = {"id": "job_1", "status": "queued"}
RESULT = {"outputs": [{"name": "y", "datatype": "INT64", "shape": [1], "data": [7]}]}
DONE = {"id": "job_1", "status": "succeeded", "result": RESULT}

Handler = Callable[[httpx.Request], httpx.Response]


def answers(*replies: httpx.Response | Exception) -> tuple[Handler, list[httpx.Request]]:
    """A handler giving ``replies`` in turn (an exception is raised), and the requests seen."""
    seen: list[httpx.Request] = []
    left = list(replies)

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        reply = left.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply

    return handle, seen


def sync_client(handler: Handler, **kwargs) -> tuple[Client, list[float]]:
    waits: list[float] = []
    http = httpx.Client(base_url="http://gw", transport=httpx.MockTransport(handler))
    return Client(http=http, sleep=waits.append, **kwargs), waits


def async_client(handler: Handler, **kwargs) -> AsyncClient:
    http = httpx.AsyncClient(base_url="http://gw", transport=httpx.MockTransport(handler))
    return AsyncClient(http=http, **kwargs)


def test_a_retry_after_is_waited_as_named_capped_and_defaulted():
    refused = [
        httpx.Response(429, headers={"retry-after": "2"}),
        httpx.Response(503, headers={"retry-after": "600"}),
        httpx.Response(503),
        httpx.Response(429, headers={"retry-after": "soon"}),
    ]
    handler, seen = answers(*refused, httpx.Response(200, json=RESULT))
    client, waits = sync_client(handler)
    assert client.infer("m", {"x": X})["y"].tolist() == [7]
    assert waits == [2.0, 30.0, 1.0, 1.0] and len(seen) == 5


def test_after_the_last_retry_the_refusal_is_raised():
    handler, seen = answers(*[httpx.Response(429, json={"error": "full"})] * 3)
    client, waits = sync_client(handler, retries=2)
    with pytest.raises(InferqError) as e:
        client.infer("m", {"x": X})
    assert (e.value.status, e.value.message) == (429, "full")
    assert len(seen) == 3 and len(waits) == 2


def test_a_submission_lost_on_the_wire_is_sent_again_with_the_same_key():
    lost = httpx.ConnectError("reset")
    handler, seen = answers(lost, lost, httpx.Response(202, json=JOB))
    client, waits = sync_client(handler)
    job = client.submit("m", {"x": X}, version="2", webhook="http://hook", webhook_events=["x"])
    assert job.id == "job_1" and job.last == JOB
    keys = {r.headers["idempotency-key"] for r in seen}
    assert len(seen) == 3 and len(keys) == 1 and waits == [0.5, 0.5]
    assert seen[0].url.path == "/v2/models/m/versions/2/jobs"
    assert seen[0].headers["inferq-webhook"] == "http://hook"
    assert seen[0].headers["inferq-webhook-events"] == "x"


def test_an_inference_lost_on_the_wire_is_not_sent_again():
    handler, seen = answers(httpx.ConnectError("reset"), httpx.Response(200, json=RESULT))
    client, _ = sync_client(handler)
    with pytest.raises(httpx.ConnectError):
        client.infer("m", {"x": X})
    assert len(seen) == 1


def test_a_job_that_ends_unsuccessfully_raises_and_one_that_outlives_its_timeout_too():
    failed = {"id": "job_1", "status": "failed", "error": "boom"}
    handler, seen = answers(httpx.Response(200, json=JOB), httpx.Response(200, json=failed))
    client, _ = sync_client(handler)
    job = client.job("job_1")
    with pytest.raises(InferqError, match="job_1 failed: boom"):
        job.result(timeout=60)
    assert job.last == failed and float(seen[0].url.params["wait"]) <= 30.0
    with pytest.raises(TimeoutError):
        job.result(timeout=0)


def test_a_batch_wait_reports_each_reading_and_times_out_when_not_final():
    running = {"id": "b", "status": "in_progress"}
    handler, _ = answers(httpx.Response(200, json=running), httpx.Response(200, json=running))
    client, waits = sync_client(handler)
    batch = client.get_batch("b")  # the first reading
    seen: list[dict] = []
    with pytest.raises(TimeoutError, match="batch b"):
        batch.wait(timeout=0, progress=seen.append, poll_s=0.25)
    assert seen == [running] and waits == []


def test_streams_skip_blank_lines_and_heartbeats_and_raise_the_gateways_error():
    events = 'id: 1\ndata: {"status": "queued"}\n\n: heartbeat\n\nid: 2\ndata: {}\n\n'
    handler, seen = answers(
        httpx.Response(200, text=events),
        httpx.Response(200, text='{"custom_id": "a"}\n\n{"custom_id": "b"}\n'),
        httpx.Response(204),
        httpx.Response(404, json={"error": "no batch b"}),
    )
    client, _ = sync_client(handler)
    job = client.job("j")
    got = list(job.events(last_event_id="0"))
    assert got == [{"id": "1", "data": {"status": "queued"}}, {"id": "2", "data": {}}]
    assert seen[0].headers["last-event-id"] == "0"
    batch = Batch(client, "b", {})
    assert [d["custom_id"] for d in batch.output()] == ["a", "b"]
    assert list(client.events("/v2/batches/b/events")) == []
    with pytest.raises(InferqError, match="no batch b"):
        list(batch.errors())


def test_the_asyncio_client_sends_what_the_sync_client_sends():
    """Both clients drive the same operations: the same calls give the same requests."""

    def script() -> tuple[Handler, list[httpx.Request]]:
        return answers(
            httpx.Response(429, headers={"retry-after": "0"}),
            httpx.Response(200, json=RESULT),
            httpx.ConnectError("reset"),
            httpx.Response(202, json=JOB),
            httpx.Response(200, json=DONE),
            httpx.Response(200, json={"id": "b", "status": "validating"}),
            httpx.Response(200, json={"id": "b", "status": "completed"}),
            httpx.Response(200, json={"id": "b", "status": "cancelled"}),
            httpx.Response(200, json={"id": "b", "deleted": True}),
        )

    sync_handler, sync_seen = script()
    client, _ = sync_client(sync_handler)
    results = [client.infer("m", {"x": X}, binary=True, outputs=["y"], parameters={"p": 1})]
    job = client.submit("m", {"x": X}, idempotency_key="k")
    results.append(job.result())
    batch = client.batch([{"a": 1}, b"{}", "{}\n"], model="m", metadata={"k": "v"})
    results += [batch.wait(poll_s=0), batch.cancel(), batch.delete()]

    async def main() -> list:
        handler, seen = script()
        async with async_client(handler) as client:
            out = [
                await client.infer("m", {"x": X}, binary=True, outputs=["y"], parameters={"p": 1})
            ]
            job = await client.submit("m", {"x": X}, idempotency_key="k")
            out.append(await job.result())
            batch = await client.batch([{"a": 1}, b"{}", "{}\n"], model="m", metadata={"k": "v"})
            out += [await batch.wait(poll_s=0), await batch.cancel(), await batch.delete()]
        return [out, seen]

    async_results, async_seen = asyncio.run(main())

    def shown(requests: list[httpx.Request]) -> list[tuple]:
        return [(r.method, str(r.url), r.content, sorted(r.headers.items())) for r in requests]

    assert shown(async_seen) == shown(sync_seen) and len(sync_seen) == 9
    assert [r.raw if hasattr(r, "raw") else r for r in async_results] == [
        r.raw if hasattr(r, "raw") else r for r in results
    ]
    assert json.loads(sync_seen[5].content.splitlines()[0]) == {"a": 1}


def test_an_operation_is_a_generator_of_calls_and_pauses():
    """The core does no I/O: ``retried`` yields the call, a pause, and the call again."""
    call = Call("GET", "/v2/jobs/j")
    op = retried(call, retries=1)
    assert next(op) == call
    assert op.send(httpx.Response(503, headers={"retry-after": "3"})) == Sleep(3.0)
    assert op.send(None) == call
    ok = httpx.Response(200)
    with pytest.raises(StopIteration) as done:
        op.send(ok)
    assert done.value.value is ok

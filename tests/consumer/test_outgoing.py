"""What the writer is told to store for each way a request ends (``consumer.outgoing``): pure
logic, no Redis."""

from __future__ import annotations

import time

import numpy as np

from consumer.outgoing import Outcomes
from consumer.slots import Delivery
from protocol.keys import Keys, Lane
from protocol.messages import InferRequest, InferResult, Kind, Status
from protocol.tensor import Tensor

KEYS = Keys("t")
STREAM = KEYS.stream("m", Lane.NORMAL)


def delivery(result_key: str, *, reply_to: str | None = "t:replies:g", kind=Kind.INFER):
    request = InferRequest(
        id="r1",
        model="m",
        version="1",
        inputs=[Tensor.from_numpy("x", np.zeros((1, 4), dtype=np.float32))],
        outputs=None,
        deadline_ms=10_000,
        enqueued_ms=1_000,
        result_key=result_key,
        result_ttl_ms=60_000,
        reply_to=reply_to,
        kind=kind,
    )
    return Delivery(STREAM, b"1-1", request, read_ms=1_000, read_at=0.0)


def outcomes() -> Outcomes:
    return Outcomes(KEYS, lambda: 2_000, "w1")


def ok() -> InferResult:
    return InferResult("r1", Status.OK, "m", "1", worker="w1")


def test_an_uncached_sync_result_key_only_backs_up_its_reply():
    out = outcomes().result(delivery(KEYS.result("r1")), ok())
    assert out.reply_to == "t:replies:g"
    assert out.result_key == KEYS.result("r1")
    assert out.result_backup


def test_a_cache_key_is_always_written():
    cache_key = KEYS.cache("m", "1", "digest")
    out = outcomes().result(delivery(cache_key), ok())
    assert out.result_key == cache_key and not out.result_backup


def test_a_result_nobody_waits_on_a_reply_stream_for_is_kept_in_its_key():
    out = outcomes().result(delivery(KEYS.result("r1"), reply_to=None), ok())
    assert out.result_key == KEYS.result("r1") and not out.result_backup


def test_failures_are_only_replies():
    failed = InferResult("r1", Status.FAILED, "m", "1", error="boom", worker="w1")
    out = outcomes().result(delivery(KEYS.result("r1")), failed)
    assert out.result_key is None and out.reply_to == "t:replies:g"


def test_a_job_result_goes_to_its_record():
    out = outcomes().result(delivery("", reply_to=None, kind=Kind.JOB), ok())
    assert out.job is not None and out.job.key == KEYS.job("r1")
    assert out.result_key is None and not out.result_backup


def test_the_reply_clock_starts_when_the_batch_ended_or_else_now():
    # A batch's results share the moment its model call ended; a lone answer takes "now".
    for kind in (Kind.INFER, Kind.JOB):
        given = outcomes().result(delivery(KEYS.result("r1"), kind=kind), ok(), 12.5)
        assert given.finished_at == 12.5
    before = time.monotonic()
    out = outcomes().result(delivery(KEYS.result("r1")), ok())
    assert before <= out.finished_at <= time.monotonic()

"""A job's document carries, under ``result``, the V2 response a synchronous request would get,
with the binary outputs after the JSON, in the same form."""

from __future__ import annotations

import json

import numpy as np

from producer.jobs import render
from producer.v2_response import encode_infer_response, response_document
from protocol.jobs import JobRecord, JobStatus
from protocol.messages import InferResult, Status
from protocol.tensor import Tensor

LOGITS = Tensor.from_numpy("logits", np.array([[0.1, -1.5, 2.0]], dtype=np.float32))
LABEL = Tensor.from_numpy("label", np.array([2], dtype=np.int64))
TEXT = Tensor.from_numpy("text", np.array(["héllo".encode()], dtype=object))


def succeeded(**fields: object) -> JobRecord:
    result = InferResult("j", Status.OK, "digits", "2", outputs=[LOGITS, LABEL, TEXT])
    return JobRecord(
        id="j",
        model="digits",
        version="2",
        status=JobStatus.SUCCEEDED,
        created_ms=1_700_000_000_000,
        deadline_ms=1_700_000_060_000,
        result=result.encode(),
        **fields,  # type: ignore[arg-type]
    )


def sync_answer(record: JobRecord) -> tuple[bytes, int | None]:
    return encode_infer_response(
        *response_document(
            client_id=record.client_id or None,
            model_name="digits",
            model_version="2",
            outputs=[LOGITS, LABEL, TEXT],
            binary_outputs=frozenset(record.binary_outputs),
            binary_all=record.binary_all,
        )
    )


def test_a_json_result_is_the_synchronous_answer_under_result():
    record = succeeded(client_id="c1")
    body, header_length = render(record)
    answer, answer_length = sync_answer(record)
    assert header_length is None and answer_length is None
    doc = json.loads(body)
    assert doc["result"] == json.loads(answer)
    assert doc["status"] == "succeeded" and doc["created_at"] == "2023-11-14T22:13:20.000Z"
    assert "\\u00e9" in body.decode()  # the job document is ASCII JSON, as it always was


def test_binary_outputs_follow_the_job_document_as_they_follow_a_synchronous_answer():
    record = succeeded(binary_outputs=("logits",))
    body, header_length = render(record)
    answer, answer_length = sync_answer(record)
    assert header_length is not None and answer_length is not None
    assert json.loads(body[:header_length])["result"] == json.loads(answer[:answer_length])
    assert body[header_length:] == answer[answer_length:] == LOGITS.data


def test_a_failed_job_has_its_error_and_no_result():
    record = JobRecord("j", "digits", "1", JobStatus.FAILED, 1, 2, error="model failed")
    body, header_length = render(record)
    assert header_length is None
    doc = json.loads(body)
    assert doc["error"] == "model failed" and "result" not in doc

"""The batch wire contract: input lines (OpenAI's shape and bare V2), the record codec, ids,
completion windows, and answer lines."""

from __future__ import annotations

import json

import pytest

from protocol import ProtocolError
from protocol.batches import (
    BatchLine,
    BatchRecord,
    BatchStatus,
    LineError,
    error_line,
    is_batch_id,
    new_batch_id,
    output_line,
    parse_line,
    parse_window,
)


def test_an_openai_line_names_its_model_version_and_custom_id():
    raw = json.dumps(
        {"custom_id": "a", "method": "POST", "url": "/v2/models/m/versions/2/infer", "body": {}}
    )
    line = parse_line(raw.encode(), 3, "", "")
    assert (line.line, line.custom_id, line.model, line.version) == (3, "a", "m", "2")
    assert json.loads(line.body) == {}


def test_a_bare_line_takes_the_default_model_and_its_id_or_line_number():
    assert parse_line(b'{"inputs": []}', 7, "d", "").custom_id == "7"
    line = parse_line(b'{"id": "x", "inputs": []}', 7, "d", "1")
    assert (line.custom_id, line.model, line.version) == ("x", "d", "1")


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"{nope", "not valid JSON"),
        (b"[1]", "not a JSON object"),
        (b'{"inputs": []}', "no default 'model'"),
        (b'{"url": "/v2/models/m/infer", "body": {}}', "'custom_id'"),
        (b'{"custom_id": "a", "url": "/v2/x", "body": {}}', "'url' must be"),
        (b'{"custom_id": "a", "method": "GET", "url": "/v2/models/m/infer"}', "POST"),
        (b'{"custom_id": "a", "url": "/v2/models/m/infer", "body": 1}', "'body'"),
    ],
)
def test_a_malformed_line_says_why_with_its_number(raw, says):
    with pytest.raises(LineError) as e:
        parse_line(raw, 12, "", "")
    assert str(e.value).startswith("line 12") and says in str(e.value)


def test_a_stored_line_and_a_record_read_back_as_written():
    line = BatchLine(4, "c", "m", "", b'{"inputs":[]}')
    assert BatchLine.decode(line.encode()) == line
    record = BatchRecord(
        id=new_batch_id(1_700_000_000_000, bytes(16)),
        status=BatchStatus.IN_PROGRESS,
        model="m",
        version="",
        created_ms=1,
        deadline_ms=2,
        total=3,
        valid=2,
        ingested=1,
        stamps={"validating": 1, "in_progress": 1},
        metadata={"k": "v"},
        webhook="http://h/x",
        webhook_events=("completed",),
    )
    raw = {str(k).encode(): str(v).encode() for k, v in record.to_fields().items()}
    assert BatchRecord.from_fields(raw) == record
    with pytest.raises(ProtocolError):
        BatchRecord.from_fields({b"id": b"x"})


def test_batch_ids_sort_by_creation_and_are_recognised():
    early, late = new_batch_id(1000, bytes(16)), new_batch_id(2000, b"\xff" * 16)
    assert early < late and is_batch_id(early) and not is_batch_id("batch_x")


@pytest.mark.parametrize(("raw", "s"), [("24h", 86400), ("30m", 1800), ("90s", 90), (5, 5)])
def test_a_completion_window_is_a_duration(raw, s):
    assert parse_window(raw) == s


@pytest.mark.parametrize("raw", ["soon", 0, -1, True, None])
def test_a_completion_window_that_is_not_a_duration_is_refused(raw):
    with pytest.raises(ProtocolError):
        parse_window(raw)


def test_answers_carry_the_custom_id_the_line_and_a_response_or_an_error():
    ok = json.loads(output_line(2, "c", {"outputs": []}))
    assert ok == {
        "custom_id": "c",
        "line": 2,
        "response": {"status_code": 200, "body": {"outputs": []}},
        "error": None,
    }
    bad = json.loads(error_line(3, None, "invalid_request", "line 3: no"))
    assert bad["error"] == {"code": "invalid_request", "message": "line 3: no"}
    assert bad["response"] is None and bad["custom_id"] is None


def test_a_line_nested_too_deeply_is_an_error_line_not_a_crash():
    deep = b'{"custom_id": "x", "body": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(LineError, match="line 3 is not valid JSON: it is nested too deeply"):
        parse_line(deep, 3, "", "")

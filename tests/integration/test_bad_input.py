"""Every class of bad input gets a 4xx with a V2 error body a person can act on; never a 500."""

from __future__ import annotations

import gzip
import json
import zlib

import numpy as np
import pytest

from tests.support import binary_body, sim_body

ROW = [0.0] * 64
DEEP = b"[" * 1000 + b"]" * 1000
"""Lists nested 1,000 deep: orjson reads them (its limit is 1,024), and walking them recursed
out of Python's stack (the Idempotency-Key fingerprint: a 500)."""


def deep(raw: bytes) -> bytes:
    """``raw`` with its string "DEEP" replaced by ``DEEP`` (json.dumps cannot write it)."""
    return raw.replace(b'"DEEP"', DEEP)


def body(inputs=None, **extra):
    inputs = (
        inputs
        if inputs is not None
        else [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": ROW}]
    )
    return json.dumps({"inputs": inputs, **extra}).encode()


CASES = [
    # (name, path, raw body, headers, status, words expected in the error)
    ("unknown model", "/v2/models/nope/infer", body(), {}, 404, ["unknown model 'nope'"]),
    ("unknown version", "/v2/models/digits/versions/9/infer", body(), {}, 404, ["no version '9'"]),
    (
        "wrong input name",
        "/v2/models/digits/infer",
        body([{"name": "pixels", "datatype": "FP32", "shape": [1, 64], "data": ROW}]),
        {},
        400,
        ["pixels"],
    ),
    ("missing input", "/v2/models/digits/infer", body([]), {}, 400, ["input"]),
    (
        "wrong datatype",
        "/v2/models/digits/infer",
        body([{"name": "input", "datatype": "FP64", "shape": [1, 64], "data": ROW}]),
        {},
        400,
        ["FP64", "FP32"],
    ),
    (
        "wrong shape",
        "/v2/models/digits/infer",
        body([{"name": "input", "datatype": "FP32", "shape": [1, 63], "data": ROW[:63]}]),
        {},
        400,
        ["[1, 63]", "[-1, 64]"],
    ),
    (
        "shape vs data length",
        "/v2/models/digits/infer",
        body([{"name": "input", "datatype": "FP32", "shape": [2, 64], "data": ROW}]),
        {},
        400,
        ["128"],
    ),
    (
        "strings for numbers",
        "/v2/models/digits/infer",
        body([{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": ["a"] * 64}]),
        {},
        400,
        ["input"],
    ),
    ("not JSON", "/v2/models/digits/infer", b"{nope", {}, 400, ["not valid JSON"]),
    ("JSON but not an object", "/v2/models/digits/infer", b"[1,2]", {}, 400, ["object"]),
    (
        "unknown output",
        "/v2/models/digits/infer",
        body(outputs=[{"name": "proba"}]),
        {},
        400,
        ["proba"],
    ),
    (
        "bad timeout parameter",
        "/v2/models/digits/infer",
        body(parameters={"timeout": "soon"}),
        {},
        400,
        ["timeout"],
    ),
    (
        "bad priority parameter",
        "/v2/models/digits/infer",
        body(parameters={"priority": -1}),
        {},
        400,
        ["priority"],
    ),
    (
        "binary without header length",
        "/v2/models/digits/infer",
        body(),
        {"content-type": "application/octet-stream"},
        400,
        ["Inference-Header-Content-Length"],
    ),
    (
        "binary data too short",
        "/v2/models/digits/infer",
        body(
            [
                {
                    "name": "input",
                    "datatype": "FP32",
                    "shape": [1, 64],
                    "parameters": {"binary_data_size": 256},
                }
            ]
        )
        + b"\0" * 10,
        {"inference-header-content-length": "SELF"},
        400,
        ["binary"],
    ),
    (
        "unsupported content type",
        "/v2/models/digits/infer",
        body(),
        {"content-type": "text/plain"},
        415,
        ["application/json"],
    ),
    (
        "form-encoded body",
        "/v2/models/digits/infer",
        body(),
        {"content-type": "application/x-www-form-urlencoded"},
        415,
        ["Content-Type"],
    ),
    (
        "unsupported encoding",
        "/v2/models/digits/infer",
        body(),
        {"content-encoding": "br"},
        415,
        ["br"],
    ),
    (
        "corrupt gzip",
        "/v2/models/digits/infer",
        b"not gzip",
        {"content-encoding": "gzip"},
        400,
        ["gzip"],
    ),
    (
        "truncated gzip",
        "/v2/models/digits/infer",
        gzip.compress(body())[:-6],
        {"content-encoding": "gzip"},
        400,
        ["truncated gzip"],
    ),
    (
        "gzip then trailing garbage",
        "/v2/models/digits/infer",
        gzip.compress(body()) + b"garbage",
        {"content-encoding": "gzip"},
        400,
        ["7 bytes after the end of its gzip data"],
    ),
    (
        "deflate then trailing garbage",
        "/v2/models/digits/infer",
        zlib.compress(body()) + b"xx",
        {"content-encoding": "deflate"},
        400,
        ["after the end of its deflate data"],
    ),
    (
        "lone surrogate in an input name",
        "/v2/models/digits/infer",
        body().replace(b'"input"', b'"\\ud800"'),
        {},
        400,
        ["\\ud800", "unpaired surrogate"],
    ),
    (
        "lone surrogate in the id",
        "/v2/models/digits/infer",
        body(id="ID").replace(b'"ID"', b'"\\udc00"'),
        {},
        400,
        ["\\udc00", "unpaired surrogate"],
    ),
    (
        "lone surrogate in a job's id",
        "/v2/models/digits/jobs",
        body(id="ID").replace(b'"ID"', b'"a\\udbff"'),
        {},
        400,
        ["\\udbff"],
    ),
    (
        "deeply nested parameters",
        "/v2/models/digits/infer",
        deep(body(parameters={"x": "DEEP"})),
        {},
        400,
        ["request 'parameters' nests", "more than 32 deep"],
    ),
    (
        "deeply nested parameters of a job with an Idempotency-Key",
        "/v2/models/digits/jobs",
        deep(body(parameters={"x": "DEEP"})),
        {"idempotency-key": "deep-1"},
        400,
        ["more than 32 deep"],
    ),
    (
        "deeply nested input parameters",
        "/v2/models/digits/infer",
        deep(
            body(
                [
                    {
                        "name": "input",
                        "datatype": "FP32",
                        "shape": [1, 64],
                        "data": ROW,
                        "parameters": {"x": "DEEP"},
                    }
                ]
            )
        ),
        {},
        400,
        ["input 'input': 'parameters' nests"],
    ),
    ("body too large", "/v2/models/digits/infer", b"x" * 5000, {}, 413, ["limit"]),
    (
        "gzip bomb",
        "/v2/models/digits/infer",
        gzip.compress(b" " * 100_000),
        {"content-encoding": "gzip"},
        413,
        ["limit"],
    ),
    ("unknown endpoint", "/v2/nothing/here", b"", {}, 404, ["no such endpoint"]),
    ("wrong method", "/v2/models/digits/infer", None, {}, 405, ["not allowed"]),
]


@pytest.mark.parametrize(
    ("name", "path", "raw", "headers", "status", "words"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_input_gets_a_clear_4xx(small_stack, name, path, raw, headers, status, words):
    headers = dict(headers)
    if headers.get("inference-header-content-length") == "SELF":
        headers["inference-header-content-length"] = str(raw.index(b"}]}") + 3)
    with small_stack.client() as c:
        if raw is None:
            r = c.get(path)
        else:
            headers.setdefault("content-type", "application/json")
            r = c.post(path, content=raw, headers=headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    for word in words:
        assert word in error, error


@pytest.fixture
def small_stack(stack):
    return stack(max_body_bytes=4096)


def test_gzip_bodies_are_accepted(small_stack):
    with small_stack.client() as c:
        r = c.post(
            "/v2/models/digits/infer",
            content=gzip.compress(body()),
            headers={"content-type": "application/json", "content-encoding": "gzip"},
        )
    assert r.status_code == 200, r.text


def test_a_model_without_live_workers_answers_503_with_retry_after(stack):
    s = stack(workers=1)
    s.workers[0].stop()
    # The stopped worker withdrew its advertisement; the model stays known.
    with s.client() as c:
        from tests.support import wait_until

        wait_until(
            lambda: c.get("/v2/models/digits/ready").status_code == 503,
            what="the model to be reported not ready",
        )
        r = c.post(
            "/v2/models/digits/infer", content=body(), headers={"content-type": "application/json"}
        )
    assert r.status_code == 503
    assert "no live worker" in r.json()["error"]
    assert r.headers["retry-after"] == "5"


def digits_json(data: str, **extra: str) -> bytes:
    """A digits request whose ``data`` is the literal JSON text ``data``."""
    params = "".join(f',"{k}":{v}' for k, v in extra.items())
    return (
        '{"inputs":[{"name":"input","datatype":"FP32","shape":[1,64],"data":['
        + data
        + "]}]"
        + params
        + "}"
    ).encode()


HUGE = "9" * 4301
"""Longer than Python's default limit on integer string conversion (4,300 digits)."""

LITERAL_CASES = [
    ("huge integer in data", digits_json(",".join([HUGE] + ["0"] * 63)), ["4300"]),
    (
        "huge integer parameter",
        digits_json(",".join(["0"] * 64), parameters='{"timeout":' + HUGE + "}"),
        ["4300"],
    ),
    ("NaN", digits_json(",".join(["NaN"] + ["0"] * 63)), ["NaN", "binary"]),
    ("Infinity", digits_json(",".join(["-Infinity"] + ["0"] * 63)), ["Infinity", "binary"]),
    ("overflowing literal", digits_json(",".join(["1e999"] + ["0"] * 63)), ["finite"]),
]


@pytest.mark.parametrize(("name", "raw", "words"), LITERAL_CASES, ids=[c[0] for c in LITERAL_CASES])
def test_json_literals_that_are_not_finite_numbers_get_400(stack, name, raw, words):
    s = stack()
    with s.client() as c:
        for path in ("/v2/models/digits/infer", "/v2/models/digits/jobs"):
            r = c.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text
            for word in words:
                assert word in r.json()["error"], r.json()["error"]


def test_a_header_length_with_thousands_of_digits_gets_400(stack):
    s = stack()
    with s.client() as c:
        r = c.post(
            "/v2/models/digits/infer",
            content=body(),
            headers={"content-type": "application/json", "inference-header-content-length": HUGE},
        )
    assert r.status_code == 400 and "Inference-Header-Content-Length" in r.json()["error"]


def strict_json(raw: bytes):
    """Parse as strict JSON (RFC 8259): NaN and Infinity are not JSON."""

    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(raw, parse_constant=refuse)


def test_non_finite_outputs_are_sent_only_as_binary_data(stack):
    s = stack(models=("sim",))
    request, headers = binary_body("x", np.array([[1, 1, 1, 1], [np.nan, 0, 0, 0]]))
    with s.client() as c:
        r = c.post("/v2/models/sim/infer", content=request, headers=headers)
    assert r.status_code == 200, r.text
    n = int(r.headers["inference-header-content-length"])
    response = strict_json(r.content[:n])
    (out,) = response["outputs"]
    assert "data" not in out and out["parameters"]["binary_data_size"] == 8
    values = np.frombuffer(r.content[n:], dtype="<f4")
    assert values[0] == 4.0 and np.isnan(values[1])


def test_one_client_sending_zero_rows_does_not_open_the_breaker_for_everyone(stack):
    """Zero rows are refused at the gateway, so they never reach the model nor count toward its
    breaker. Before, each was a 500 from the model (the simulated backend cannot reshape
    nothing), and once the breaker's minimum of 20 requests had failed every client got 503
    for 10 s (issue #21): the red team sent 16, this sends 24."""
    s = stack(models=("sim",))
    s.wait_ready("sim")
    empty = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [0, 4], "data": []}]}
    calls = s.workers[0].backend("sim").calls
    codes = [s.infer("sim", empty, **{"cache-control": "no-cache"}) for _ in range(24)]
    assert [r.status_code for r in codes] == [400] * 24, codes[-1].text
    assert "0 rows" in codes[0].json()["error"]
    r = s.infer("sim", sim_body(2))  # another client
    assert r.status_code == 200, r.text
    assert s.workers[0].backend("sim").calls == calls + 1  # only the valid one reached it
    assert s.gateway.gateway.service.breakers["sim"].failure_ratio() == 0.0


def test_a_gzip_body_of_several_members_is_accepted(small_stack):
    whole = body()
    members = gzip.compress(whole[:50]) + gzip.compress(whole[50:])  # RFC 1952 allows it
    with small_stack.client() as c:
        r = c.post(
            "/v2/models/digits/infer",
            content=members,
            headers={"content-type": "application/json", "content-encoding": "gzip"},
        )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "path",
    ["/v2/repository/index", "/v2/repository/models/digits/load", "/v2/repository/models/x/unload"],
)
def test_deeply_nested_model_control_bodies_get_400(stack, path):
    s = stack(admin_token="tok")
    nested = b'{"parameters": ' + DEEP + b"}"
    with s.client() as c:
        r = c.post(path, content=nested, headers={"authorization": "Bearer tok"})
    assert r.status_code == 400, r.text
    assert "nests lists or objects more than 32 deep" in r.json()["error"]

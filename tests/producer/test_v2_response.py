"""V2 inference responses: result tensors to a body that tritonclient itself decodes, so these
tests prove that a real Triton client and this gateway understand each other."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.http as triton

from producer.v2_request import parse_infer_request
from producer.v2_response import encode_infer_response, response_document
from protocol.registry import ModelMetadata, TensorSpec
from protocol.tensor import Tensor

DIGITS = ModelMetadata(
    name="digits",
    versions=("1",),
    default_version="1",
    platform="onnxruntime_onnx",
    inputs=(TensorSpec("input", "FP32", (-1, 64)),),
    outputs=(TensorSpec("logits", "FP32", (-1, 10)), TensorSpec("label", "INT64", (-1,))),
    max_batch=64,
    default_timeout_ms=1000,
    cache_enabled=False,
    cache_ttl_s=0,
)

LOGITS = np.linspace(-1, 1, 20, dtype=np.float32).reshape(2, 10)
LABELS = np.array([3, 9], dtype=np.int64)


def _digits_outputs() -> list[Tensor]:
    return [Tensor.from_numpy("logits", LOGITS), Tensor.from_numpy("label", LABELS)]


def _respond(
    outputs: list[Tensor],
    binary_outputs: frozenset[str] = frozenset(),
    binary_all: bool = False,
    client_id: str | None = "r1",
) -> tuple[bytes, int | None]:
    return encode_infer_response(
        *response_document(
            client_id=client_id,
            model_name="digits",
            model_version="1",
            outputs=outputs,
            binary_outputs=binary_outputs,
            binary_all=binary_all,
        )
    )


def _triton_result(body: bytes, header_length: int | None) -> triton.InferResult:
    return triton.InferResult.from_response_body(body, header_length=header_length)


def test_json_response_has_the_v2_fields_and_flat_data() -> None:
    body, header_length = _respond(_digits_outputs())

    assert header_length is None
    response = json.loads(body)
    assert response["id"] == "r1"
    assert response["model_name"] == "digits" and response["model_version"] == "1"
    logits, label = response["outputs"]
    assert logits == {
        "name": "logits",
        "datatype": "FP32",
        "shape": [2, 10],
        "data": LOGITS.reshape(-1).tolist(),
    }
    assert label == {"name": "label", "datatype": "INT64", "shape": [2], "data": [3, 9]}


def test_response_leaves_out_id_when_the_request_had_none() -> None:
    body, _ = _respond(_digits_outputs(), client_id=None)
    assert "id" not in json.loads(body)


def test_json_response_decodes_in_tritonclient() -> None:
    body, header_length = _respond(_digits_outputs())

    result = _triton_result(body, header_length)

    np.testing.assert_array_equal(result.as_numpy("logits"), LOGITS)
    np.testing.assert_array_equal(result.as_numpy("label"), LABELS)
    assert result.get_response()["id"] == "r1"


def test_binary_response_decodes_in_tritonclient() -> None:
    body, header_length = _respond(_digits_outputs(), binary_all=True)

    assert header_length is not None
    header = json.loads(body[:header_length])
    assert header["outputs"][0]["parameters"] == {"binary_data_size": LOGITS.nbytes}
    assert "data" not in header["outputs"][0]
    result = _triton_result(body, header_length)
    np.testing.assert_array_equal(result.as_numpy("logits"), LOGITS)
    np.testing.assert_array_equal(result.as_numpy("label"), LABELS)


def test_mixed_response_puts_binary_outputs_after_the_json_in_output_order() -> None:
    extra = Tensor.from_numpy("extra", np.array([7], dtype=np.int32))
    outputs = [Tensor.from_numpy("label", LABELS), extra, Tensor.from_numpy("logits", LOGITS)]

    body, header_length = _respond(outputs, binary_outputs=frozenset({"logits", "label"}))

    assert header_length is not None
    header = json.loads(body[:header_length])
    assert [o["name"] for o in header["outputs"]] == ["label", "extra", "logits"]
    assert header["outputs"][1]["data"] == [7]
    assert body[header_length:] == LABELS.tobytes() + LOGITS.tobytes()
    result = _triton_result(body, header_length)
    np.testing.assert_array_equal(result.as_numpy("logits"), LOGITS)
    np.testing.assert_array_equal(result.as_numpy("label"), LABELS)
    np.testing.assert_array_equal(result.as_numpy("extra"), [7])


def test_bytes_response_round_trips_as_json_and_binary() -> None:
    reply = Tensor.from_numpy("reply", np.array([b"ok", "héllo".encode(), b""], dtype=object))

    body, header_length = _respond([reply])
    assert header_length is None
    assert json.loads(body)["outputs"][0]["data"] == ["ok", "héllo", ""]
    decoded = _triton_result(body, header_length).as_numpy("reply")
    assert [str(x) for x in decoded] == ["ok", "héllo", ""]

    body, header_length = _respond([reply], binary_all=True)
    decoded = _triton_result(body, header_length).as_numpy("reply")
    assert decoded.tolist() == [b"ok", "héllo".encode(), b""]


def test_non_utf8_bytes_output_falls_back_to_binary_data() -> None:
    reply = Tensor.from_numpy("reply", np.array([b"\xff\xfe", b"ok"], dtype=object))

    body, header_length = _respond([reply, Tensor.from_numpy("label", LABELS)])

    assert header_length is not None
    header = json.loads(body[:header_length])
    assert "data" not in header["outputs"][0] and header["outputs"][1]["data"] == [3, 9]
    result = _triton_result(body, header_length)
    assert result.as_numpy("reply").tolist() == [b"\xff\xfe", b"ok"]


def test_non_finite_float_outputs_are_sent_only_as_binary_data() -> None:
    values = np.array([np.nan, np.inf, -np.inf, 1.5], dtype=np.float32)

    body, header_length = _respond(
        [Tensor.from_numpy("logits", values), Tensor.from_numpy("label", LABELS)]
    )

    assert header_length is not None
    header = json.loads(body[:header_length], parse_constant=lambda c: pytest.fail(c))
    assert "data" not in header["outputs"][0] and header["outputs"][1]["data"] == [3, 9]
    np.testing.assert_array_equal(_triton_result(body, header_length).as_numpy("logits"), values)


def test_empty_binary_output_decodes_in_tritonclient() -> None:
    empty = Tensor.from_numpy("logits", np.zeros((0, 10), dtype=np.float32))
    body, header_length = _respond([empty], binary_all=True)
    assert header_length == len(body)
    assert _triton_result(body, header_length).as_numpy("logits").shape == (0, 10)


def test_full_round_trip_from_tritonclient_request_to_tritonclient_result() -> None:
    x = np.random.default_rng(1).random((2, 64), dtype=np.float32)
    inp = triton.InferInput("input", [2, 64], "FP32").set_data_from_numpy(x)
    outputs = [
        triton.InferRequestedOutput("label", binary_data=False),
        triton.InferRequestedOutput("logits", binary_data=True),
    ]
    body, header_length = triton.InferenceServerClient.generate_request_body(
        [inp], outputs=outputs, request_id="rt"
    )
    req = parse_infer_request(bytes(body), header_length, DIGITS)
    assert req.outputs == ["label", "logits"]

    results = {t.name: t for t in _digits_outputs()}
    body, header_length = encode_infer_response(
        *response_document(
            client_id=req.client_id,
            model_name="digits",
            model_version="1",
            outputs=[results[name] for name in req.outputs],
            binary_outputs=req.binary_outputs,
            binary_all=req.binary_all,
        )
    )

    result = _triton_result(body, header_length)
    header = result.get_response()
    assert header["id"] == "rt"
    assert "data" in header["outputs"][0] and "data" not in header["outputs"][1]
    np.testing.assert_array_equal(result.as_numpy("logits"), LOGITS)
    np.testing.assert_array_equal(result.as_numpy("label"), LABELS)

"""V2 inference requests: parsing a body and validating it against the model.

Binary-extension requests are built with tritonclient itself, so these tests prove that a real
Triton client and this gateway understand each other.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pytest
import tritonclient.http as triton

from producer.errors import BadRequest
from producer.v2_request import InferRequestBody, parse_infer_request, parse_json_object
from protocol.registry import ModelMetadata, TensorSpec
from protocol.tensor import DTYPES, Tensor, pack_bytes_elements


def _model(name: str, inputs: list[TensorSpec], outputs: list[TensorSpec]) -> ModelMetadata:
    return ModelMetadata(
        name=name,
        versions=("1",),
        default_version="1",
        platform="onnxruntime_onnx",
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        max_batch=64,
        default_timeout_ms=1000,
        cache_enabled=False,
        cache_ttl_s=0,
    )


DIGITS = _model(
    "digits",
    [TensorSpec("input", "FP32", (-1, 64))],
    [TensorSpec("logits", "FP32", (-1, 10)), TensorSpec("label", "INT64", (-1,))],
)
ECHO = _model(
    "echo",
    [TensorSpec("text", "BYTES", (-1,))],
    [TensorSpec("reply", "BYTES", (-1,))],
)
TYPES = _model(
    "types",
    [
        TensorSpec("u8", "UINT8", (-1,)),
        TensorSpec("i64", "INT64", (-1,)),
        TensorSpec("f16", "FP16", (-1,)),
        TensorSpec("flag", "BOOL", (-1,)),
    ],
    [TensorSpec("out", "FP32", (-1,))],
)


def _json(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode()


def _digits_request(rows: int = 1, **extra: Any) -> dict[str, Any]:
    data = np.arange(rows * 64, dtype=np.float32).reshape(rows, 64) / 16
    return {
        "inputs": [
            {"name": "input", "datatype": "FP32", "shape": [rows, 64], "data": data.tolist()}
        ],
        **extra,
    }


def _rejects(body: bytes, model: ModelMetadata = DIGITS, header_length: int | None = None) -> str:
    """Parse an invalid request; return the error message after checking it reads as prose."""
    with pytest.raises(BadRequest) as info:
        parse_infer_request(body, header_length, model)
    message = str(info.value)
    assert info.value.status == 400
    assert 10 < len(message) < 400
    assert "Traceback" not in message and "<class" not in message
    return message


def _input(name: str, datatype: str, shape: list[int], data: Any) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape, "data": data}


def _bad_input(model: ModelMetadata, *inputs: dict[str, Any]) -> str:
    return _rejects(_json({"inputs": list(inputs)}), model)


def _types_request(**overrides: dict[str, Any]) -> bytes:
    inputs = {
        "u8": _input("u8", "UINT8", [2], [0, 255]),
        "i64": _input("i64", "INT64", [2], [-(2**63), 2**63 - 1]),
        "f16": _input("f16", "FP16", [2], [0.5, -65504.0]),
        "flag": _input("flag", "BOOL", [2], [True, False]),
    }
    inputs.update(overrides)
    return _json({"inputs": list(inputs.values())})


def _as_numpy(tensor: Tensor) -> np.ndarray:
    return tensor.to_numpy()


# --- JSON requests ------------------------------------------------------------------------


def test_json_request_with_nested_data_gives_the_row_major_tensor() -> None:
    req = parse_infer_request(_json(_digits_request(rows=3)), None, DIGITS)

    assert isinstance(req, InferRequestBody)
    [tensor] = req.inputs
    assert (tensor.name, tensor.datatype, tensor.shape) == ("input", "FP32", (3, 64))
    expected = np.arange(3 * 64, dtype=np.float32).reshape(3, 64) / 16
    np.testing.assert_array_equal(_as_numpy(tensor), expected)
    assert tensor.data == expected.astype("<f4").tobytes()


def test_json_request_with_flat_data_is_the_same_as_nested() -> None:
    nested = _digits_request(rows=2)
    flat = _digits_request(rows=2)
    flat["inputs"][0]["data"] = np.array(flat["inputs"][0]["data"]).reshape(-1).tolist()

    a = parse_infer_request(_json(nested), None, DIGITS)
    b = parse_infer_request(_json(flat), None, DIGITS)

    assert a.inputs == b.inputs


def test_json_request_defaults_when_id_outputs_and_parameters_are_absent() -> None:
    req = parse_infer_request(_json(_digits_request()), None, DIGITS)

    assert req.client_id is None
    assert req.outputs is None
    assert req.parameters == {}
    assert req.binary_outputs == frozenset()
    assert req.binary_all is False


def test_id_and_request_parameters_are_kept() -> None:
    body = _json(_digits_request(id="req-7", parameters={"timeout": 5000, "priority": 2}))

    req = parse_infer_request(body, None, DIGITS)

    assert req.client_id == "req-7"
    assert req.parameters == {"timeout": 5000, "priority": 2}


def test_requested_outputs_keep_their_order_and_binary_choice() -> None:
    body = _json(
        _digits_request(
            outputs=[{"name": "label"}, {"name": "logits", "parameters": {"binary_data": True}}]
        )
    )

    req = parse_infer_request(body, None, DIGITS)

    assert req.outputs == ["label", "logits"]
    assert req.binary_outputs == frozenset({"logits"})
    assert req.binary_all is False


def test_empty_outputs_list_means_all_outputs() -> None:
    req = parse_infer_request(_json(_digits_request(outputs=[])), None, DIGITS)
    assert req.outputs is None


def test_binary_data_output_makes_every_output_binary() -> None:
    req = parse_infer_request(
        _json(_digits_request(parameters={"binary_data_output": True})), None, DIGITS
    )

    assert req.binary_all is True
    assert req.binary_outputs == frozenset({"logits", "label"})


def test_output_binary_data_false_overrides_binary_data_output() -> None:
    body = _json(
        _digits_request(
            parameters={"binary_data_output": True},
            outputs=[{"name": "logits"}, {"name": "label", "parameters": {"binary_data": False}}],
        )
    )

    req = parse_infer_request(body, None, DIGITS)

    assert req.binary_outputs == frozenset({"logits"})
    assert req.binary_all is False


def test_every_fixed_datatype_converts_exactly_including_range_limits() -> None:
    req = parse_infer_request(_types_request(), None, TYPES)

    got = {t.name: _as_numpy(t) for t in req.inputs}
    np.testing.assert_array_equal(got["u8"], np.array([0, 255], dtype=np.uint8))
    np.testing.assert_array_equal(got["i64"], np.array([-(2**63), 2**63 - 1], dtype=np.int64))
    np.testing.assert_array_equal(got["f16"], np.array([0.5, -65504.0], dtype=np.float16))
    np.testing.assert_array_equal(got["flag"], np.array([True, False]))


def test_whole_floats_are_accepted_for_integer_datatypes() -> None:
    req = parse_infer_request(
        _types_request(i64=_input("i64", "INT64", [2], [3.0, -1.0])), None, TYPES
    )
    i64 = next(t for t in req.inputs if t.name == "i64")
    np.testing.assert_array_equal(_as_numpy(i64), [3, -1])


def test_integers_beyond_int64_are_accepted_for_uint64_and_floats() -> None:
    model = _model(
        "wide",
        [TensorSpec("u", "UINT64", (-1,)), TensorSpec("f", "FP64", (-1,))],
        [TensorSpec("out", "FP32", (-1,))],
    )
    body = _json(
        {
            "inputs": [
                _input("u", "UINT64", [2], [0, 2**64 - 1]),
                _input("f", "FP64", [2], [2**70, 1]),
            ]
        }
    )

    u, f = parse_infer_request(body, None, model).inputs

    assert _as_numpy(u).tolist() == [0, 2**64 - 1]
    assert _as_numpy(f).tolist() == [float(2**70), 1.0]


@pytest.mark.parametrize(
    ("datatype", "values"),
    [
        ("UINT64", [1, 2**63 + 1, 2**64 - 1]),
        ("INT64", [1.0, 2**62 + 1, -(2**62) - 1]),
    ],
)
def test_large_integers_keep_every_digit_when_numpy_would_go_through_float(
    datatype: str, values: list[Any]
) -> None:
    model = _model("wide", [TensorSpec("x", datatype, (-1,))], [])
    body = _json({"inputs": [_input("x", datatype, [len(values)], values)]})

    [tensor] = parse_infer_request(body, None, model).inputs

    assert _as_numpy(tensor).tolist() == [int(v) for v in values]


def test_zero_rows_are_refused_before_they_reach_the_model() -> None:
    # A model cannot run nothing: its failure would count toward its breaker (issue #21).
    message = _bad_input(DIGITS, _input("input", "FP32", [0, 64], []))
    assert "0 rows" in message and "at least one" in message


def test_a_variable_dimension_of_size_zero_is_refused() -> None:
    model = _model(
        "tokens", [TensorSpec("ids", "INT64", (-1, -1))], [TensorSpec("out", "FP32", (-1,))]
    )
    message = _bad_input(model, _input("ids", "INT64", [2, 0], []))
    assert "dimension 1 of size 0" in message


def test_inputs_with_different_row_counts_are_refused() -> None:
    message = _rejects(
        _types_request(
            u8=_input("u8", "UINT8", [3], [1, 2, 3]), i64=_input("i64", "INT64", [2], [1, 2])
        ),
        TYPES,
    )
    assert "same number of rows" in message and "'i64'" in message


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_refused_in_json_for_they_are_not_json(literal: str) -> None:
    body = (
        b'{"inputs": [{"name": "f16", "datatype": "FP16", "shape": [2], "data": [1, '
        + literal.encode()
        + b"]}]}"
    )
    model = _model("f", [TensorSpec("f16", "FP16", (-1,))], [])
    error = _rejects(body, model)
    assert literal in error and "binary data" in error


def test_a_literal_too_large_to_be_finite_is_refused() -> None:
    body = b'{"inputs": [{"name": "f64", "datatype": "FP64", "shape": [1], "data": [-1e999]}]}'
    model = _model("f", [TensorSpec("f64", "FP64", (-1,))], [])
    assert "finite" in _rejects(body, model)


def test_nan_and_infinity_are_accepted_as_binary_data() -> None:
    data = np.array([np.nan, np.inf], dtype="<f2").tobytes()
    header = _json(
        {
            "inputs": [
                {
                    "name": "f16",
                    "datatype": "FP16",
                    "shape": [2],
                    "parameters": {"binary_data_size": len(data)},
                }
            ]
        }
    )
    model = _model("f", [TensorSpec("f16", "FP16", (-1,))], [])
    [tensor] = parse_infer_request(header + data, len(header), model).inputs
    values = _as_numpy(tensor)
    assert np.isnan(values[0]) and values[1] == np.inf


def test_an_integer_literal_beyond_4300_digits_is_a_client_error() -> None:
    body = b'{"inputs": [], "parameters": {"timeout": ' + b"7" * 4301 + b"}}"
    assert "4300 digits" in _rejects(body)


def test_bytes_json_request_is_stored_length_prefixed() -> None:
    body = _json({"inputs": [_input("text", "BYTES", [3], ["hi", "", "héllo"])]})

    [tensor] = parse_infer_request(body, None, ECHO).inputs

    assert tensor.data == pack_bytes_elements([b"hi", b"", "héllo".encode()])
    assert tensor.shape == (3,)


def test_bytes_json_request_accepts_nested_lists() -> None:
    model = _model("grid", [TensorSpec("text", "BYTES", (2, 2))], [])
    body = _json({"inputs": [_input("text", "BYTES", [2, 2], [["a", "b"], ["c", "d"]])]})

    [tensor] = parse_infer_request(body, None, model).inputs

    assert tensor.data == pack_bytes_elements([b"a", b"b", b"c", b"d"])


# --- binary extension requests (built by tritonclient) -------------------------------------


def _triton_request(*inputs: Any, **kwargs: Any) -> tuple[bytes, int | None]:
    body, header_length = triton.InferenceServerClient.generate_request_body(list(inputs), **kwargs)
    return bytes(body), header_length


def test_tritonclient_binary_request_round_trips() -> None:
    x = np.random.default_rng(0).random((4, 64), dtype=np.float32)
    inp = triton.InferInput("input", [4, 64], "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    body, header_length = _triton_request(inp, request_id="abc", priority=1, timeout=2000)
    assert header_length is not None

    req = parse_infer_request(body, header_length, DIGITS)

    [tensor] = req.inputs
    np.testing.assert_array_equal(_as_numpy(tensor), x)
    assert req.client_id == "abc"
    assert req.parameters["priority"] == 1 and req.parameters["timeout"] == 2000
    # tritonclient asks for binary outputs when none are named
    assert req.outputs is None and req.binary_all is True


def test_tritonclient_json_request_round_trips() -> None:
    x = np.ones((2, 64), dtype=np.float32) / 3
    inp = triton.InferInput("input", [2, 64], "FP32")
    inp.set_data_from_numpy(x, binary_data=False)
    outputs = [triton.InferRequestedOutput("label", binary_data=False)]
    body, header_length = _triton_request(inp, outputs=outputs)
    assert header_length is None

    req = parse_infer_request(body, header_length, DIGITS)

    np.testing.assert_array_equal(_as_numpy(req.inputs[0]), x)
    assert req.outputs == ["label"] and req.binary_outputs == frozenset()


def test_tritonclient_binary_bytes_and_mixed_inputs_round_trip() -> None:
    model = _model(
        "mixed",
        [
            TensorSpec("text", "BYTES", (-1,)),
            TensorSpec("ids", "INT32", (-1, 2)),
            TensorSpec("flag", "BOOL", (-1,)),
        ],
        [TensorSpec("reply", "BYTES", (-1,))],
    )
    text = np.array([b"\xff\x00binary", b""], dtype=object)
    ids = np.array([[1, -2], [3, 2**31 - 1]], dtype=np.int32)
    flag = np.array([True, False])
    a = triton.InferInput("text", [2], "BYTES").set_data_from_numpy(text, binary_data=True)
    b = triton.InferInput("ids", [2, 2], "INT32").set_data_from_numpy(ids, binary_data=False)
    c = triton.InferInput("flag", [2], "BOOL").set_data_from_numpy(flag, binary_data=True)
    body, header_length = _triton_request(a, b, c)

    t_text, t_ids, t_flag = parse_infer_request(body, header_length, model).inputs

    assert _as_numpy(t_text).tolist() == [b"\xff\x00binary", b""]
    np.testing.assert_array_equal(_as_numpy(t_ids), ids)
    np.testing.assert_array_equal(_as_numpy(t_flag), flag)


def test_binary_input_with_leftover_bytes_is_rejected() -> None:
    inp = triton.InferInput("input", [1, 64], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 64), dtype=np.float32))
    body, header_length = _triton_request(inp)

    message = _rejects(body + b"\x00" * 8, header_length=header_length)

    assert "8 bytes of binary data" in message and "no input claims" in message


def test_binary_input_with_too_little_data_is_rejected() -> None:
    inp = triton.InferInput("input", [1, 64], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 64), dtype=np.float32))
    body, header_length = _triton_request(inp)

    message = _rejects(body[:-4], header_length=header_length)

    assert "input 'input'" in message and "binary_data_size 256" in message
    assert "only 252 bytes" in message


def test_binary_input_without_header_length_is_rejected() -> None:
    body = _json(
        {
            "inputs": [
                {
                    "name": "input",
                    "datatype": "FP32",
                    "shape": [1, 64],
                    "parameters": {"binary_data_size": 256},
                }
            ]
        }
    )
    message = _rejects(body)
    assert "Inference-Header-Content-Length" in message


def test_binary_size_that_does_not_fit_the_shape_is_rejected() -> None:
    header = _json(
        {
            "inputs": [
                {
                    "name": "input",
                    "datatype": "FP32",
                    "shape": [1, 64],
                    "parameters": {"binary_data_size": 252},
                }
            ]
        }
    )
    message = _rejects(header + b"\x00" * 252, header_length=len(header))
    assert "input 'input'" in message and "needs 256 bytes" in message and "252" in message


def test_malformed_binary_bytes_elements_are_rejected() -> None:
    header = _json(
        {
            "inputs": [
                {
                    "name": "text",
                    "datatype": "BYTES",
                    "shape": [1],
                    "parameters": {"binary_data_size": 6},
                }
            ]
        }
    )
    message = _rejects(header + b"\x09\x00\x00\x00ab", ECHO, header_length=len(header))
    assert "input 'text'" in message and "runs past the end" in message


def test_header_length_beyond_the_body_is_rejected() -> None:
    body = _json(_digits_request())
    message = _rejects(body, header_length=len(body) + 1)
    assert "Inference-Header-Content-Length" in message and str(len(body)) in message


def test_negative_header_length_is_rejected() -> None:
    message = _rejects(_json(_digits_request()), header_length=-1)
    assert "Inference-Header-Content-Length is -1" in message


def test_header_length_that_cuts_the_json_is_rejected_as_invalid_json() -> None:
    body = _json(_digits_request())
    message = _rejects(body, header_length=10)
    assert message.startswith("request body") and "not valid JSON" in message
    assert "first 10 bytes" in message


def test_input_with_both_data_and_binary_size_is_rejected() -> None:
    body = _digits_request()
    body["inputs"][0]["parameters"] = {"binary_data_size": 256}
    header = _json(body)
    message = _rejects(header + b"\x00" * 256, header_length=len(header))
    assert "both 'data' and a binary_data_size" in message


# --- request structure errors --------------------------------------------------------------


def test_invalid_json_is_rejected() -> None:
    message = _rejects(b'{"inputs": [')
    assert message.startswith("request body is not valid JSON: ")


def test_invalid_utf8_is_rejected() -> None:
    message = _rejects(b'{"id": "\xff"}')
    assert message.startswith("request body is not valid JSON: ") and "UTF-8" in message


def test_deeply_nested_json_is_rejected() -> None:
    message = _rejects(b"[" * 100_000 + b"]" * 100_000)
    assert "nested too deeply" in message


def test_json_that_is_not_an_object_is_rejected() -> None:
    assert "must be a JSON object, got a list" in _rejects(b"[1, 2]")


def test_missing_inputs_are_rejected() -> None:
    message = _rejects(b"{}")
    assert "'inputs'" in message and "'input' (FP32 [-1, 64])" in message


def test_empty_inputs_list_is_rejected() -> None:
    assert "non-empty list" in _rejects(_json({"inputs": []}))


def test_input_that_is_not_an_object_is_rejected() -> None:
    assert "inputs[0] must be an object" in _rejects(_json({"inputs": [1]}))


def test_non_string_id_is_rejected() -> None:
    assert "'id' must be a string, got a number" in _rejects(_json(_digits_request(id=5)))


def test_non_object_parameters_are_rejected() -> None:
    message = _rejects(_json(_digits_request(parameters=[1])))
    assert "'parameters' must be an object, got a list" in message


def test_non_boolean_binary_data_output_is_rejected() -> None:
    message = _rejects(_json(_digits_request(parameters={"binary_data_output": "yes"})))
    assert "binary_data_output" in message


def test_input_without_data_is_rejected() -> None:
    message = _bad_input(DIGITS, {"name": "input", "datatype": "FP32", "shape": [1, 64]})
    assert "input 'input' has no 'data'" in message


def test_shared_memory_input_is_rejected() -> None:
    inp = triton.InferInput("input", [1, 64], "FP32").set_shared_memory("region0", 256)
    body, header_length = _triton_request(inp)
    message = _rejects(body, header_length=header_length)
    assert "shared memory is not supported" in message


# --- validation against the model ----------------------------------------------------------


def test_unknown_input_is_rejected_listing_the_model_inputs() -> None:
    message = _bad_input(DIGITS, _input("pixels", "FP32", [1, 64], [0.0] * 64))
    assert message == "model 'digits' has no input 'pixels'; its inputs are 'input' (FP32 [-1, 64])"


def test_missing_declared_input_is_rejected() -> None:
    body = _types_request()
    request = json.loads(body)
    request["inputs"] = [i for i in request["inputs"] if i["name"] not in ("u8", "flag")]
    message = _rejects(_json(request), TYPES)
    assert message == "model 'types' needs inputs 'u8', 'flag', missing from the request"


def test_duplicate_input_is_rejected() -> None:
    one = _input("input", "FP32", [1, 64], [0.0] * 64)
    assert "input 'input' appears more than once" in _bad_input(DIGITS, one, one)


def test_wrong_datatype_is_rejected() -> None:
    message = _bad_input(DIGITS, _input("input", "FP64", [1, 64], [0.0] * 64))
    assert message == "input 'input' has datatype FP64 but model 'digits' expects FP32"


def test_unknown_datatype_is_rejected() -> None:
    message = _bad_input(DIGITS, _input("input", "FLOAT32", [1, 64], [0.0] * 64))
    assert "unknown datatype 'FLOAT32'" in message and "expects FP32" in message


def test_fixed_dimension_mismatch_is_rejected() -> None:
    message = _bad_input(DIGITS, _input("input", "FP32", [1, 63], [0.0] * 63))
    assert message == "input 'input' has shape [1, 63] but model 'digits' expects [-1, 64]"


def test_rank_mismatch_is_rejected() -> None:
    message = _bad_input(DIGITS, _input("input", "FP32", [64], [0.0] * 64))
    assert message == "input 'input' has shape [64] but model 'digits' expects [-1, 64]"


@pytest.mark.parametrize("shape", [[1, -64], [1.0, 64], "1x64", [True, 64]])
def test_malformed_shape_is_rejected(shape: Any) -> None:
    message = _bad_input(DIGITS, _input("input", "FP32", shape, [0.0] * 64))
    assert "input 'input': 'shape' must be a list of non-negative integers" in message


def test_element_count_must_match_the_shape() -> None:
    message = _bad_input(DIGITS, _input("input", "FP32", [2, 64], [0.0] * 64))
    assert message == "input 'input': shape [2, 64] needs 128 elements, got 64"


def test_bytes_element_count_must_match_the_shape() -> None:
    message = _bad_input(ECHO, _input("text", "BYTES", [2], ["a"]))
    assert message == "input 'text': shape [2] needs 2 elements, got 1"


# --- wrong kinds of values ----------------------------------------------------------------


def test_strings_for_a_float_input_are_rejected() -> None:
    message = _bad_input(DIGITS, _input("input", "FP32", [1, 64], ["0.5"] * 64))
    assert message == "input 'input': FP32 data must be numbers, found strings"


def test_booleans_for_a_float_input_are_rejected() -> None:
    message = _bad_input(DIGITS, _input("input", "FP32", [1, 64], [True] * 64))
    assert "FP32 data must be numbers, found true/false values" in message


def test_nulls_in_numeric_data_are_rejected() -> None:
    message = _bad_input(DIGITS, _input("input", "FP32", [1, 64], [None] + [0.0] * 63))
    assert message == "input 'input': FP32 data must be numbers, found null"


def test_ragged_nested_data_is_rejected() -> None:
    message = _bad_input(DIGITS, _input("input", "FP32", [2, 64], [[0.0] * 64, [0.0] * 63]))
    assert "input 'input'" in message and "ragged" in message


def test_data_that_is_not_a_list_is_rejected() -> None:
    message = _bad_input(DIGITS, _input("input", "FP32", [1, 64], 3.0))
    assert "input 'input': 'data' must be a list, got a number" in message


def test_integer_out_of_range_is_rejected() -> None:
    message = _rejects(_types_request(u8=_input("u8", "UINT8", [2], [0, 256])), TYPES)
    assert message == "input 'u8': a value is out of range for UINT8 (0 to 255), found 256"


def test_negative_integer_for_unsigned_is_rejected() -> None:
    message = _rejects(_types_request(u8=_input("u8", "UINT8", [2], [-1, 2])), TYPES)
    assert "out of range for UINT8" in message and "found -1" in message


def test_integer_beyond_int64_is_rejected() -> None:
    message = _rejects(_types_request(i64=_input("i64", "INT64", [2], [0, 2**63])), TYPES)
    assert "out of range for INT64" in message and str(2**63) in message


def test_huge_integer_is_rejected() -> None:
    message = _rejects(_types_request(i64=_input("i64", "INT64", [2], [0, 2**80])), TYPES)
    assert "out of range for INT64" in message


def test_float_just_beyond_int64_is_rejected() -> None:
    message = _rejects(_types_request(i64=_input("i64", "INT64", [1], [2.0**63])), TYPES)
    assert "out of range for INT64" in message


def test_fraction_for_an_integer_input_is_rejected() -> None:
    message = _rejects(_types_request(i64=_input("i64", "INT64", [2], [1, 2.5])), TYPES)
    assert "input 'i64': INT64 data must be whole numbers" in message


def test_float_out_of_range_for_fp16_is_rejected() -> None:
    message = _rejects(_types_request(f16=_input("f16", "FP16", [1], [70000.0])), TYPES)
    assert "input 'f16': a value is out of range for FP16" in message


def test_numbers_for_a_bool_input_are_rejected() -> None:
    message = _rejects(_types_request(flag=_input("flag", "BOOL", [2], [1, 0])), TYPES)
    assert message == "input 'flag': BOOL data must be true or false, found integers"


def test_non_strings_for_a_bytes_input_are_rejected() -> None:
    message = _bad_input(ECHO, _input("text", "BYTES", [2], ["a", 1]))
    assert message == "input 'text': BYTES data must be strings, found a number"


def test_ragged_bytes_data_is_rejected() -> None:
    message = _bad_input(ECHO, _input("text", "BYTES", [3], [["a"], ["b", "c"]]))
    assert "input 'text'" in message and "ragged" in message


def test_lone_surrogate_in_bytes_data_is_rejected() -> None:
    body = b'{"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["\\ud800"]}]}'
    assert "not valid Unicode" in _rejects(body, ECHO)


# --- requested outputs --------------------------------------------------------------------


def test_unknown_output_is_rejected_listing_the_model_outputs() -> None:
    message = _rejects(_json(_digits_request(outputs=[{"name": "probs"}])))
    assert message == (
        "model 'digits' has no output 'probs'; its outputs are "
        "'logits' (FP32 [-1, 10]), 'label' (INT64 [-1])"
    )


def test_duplicate_output_is_rejected() -> None:
    message = _rejects(_json(_digits_request(outputs=[{"name": "label"}, {"name": "label"}])))
    assert message == "output 'label' is requested more than once"


def test_classification_output_is_rejected() -> None:
    x = np.zeros((1, 64), dtype=np.float32)
    inp = triton.InferInput("input", [1, 64], "FP32").set_data_from_numpy(x)
    out = triton.InferRequestedOutput("logits", class_count=3)
    body, header_length = _triton_request(inp, outputs=[out])
    message = _rejects(body, header_length=header_length)
    assert "classification extension is not supported" in message


def test_shared_memory_output_is_rejected() -> None:
    out = {"name": "logits", "parameters": {"shared_memory_region": "r", "binary_data": False}}
    message = _rejects(_json(_digits_request(outputs=[out])))
    assert "output 'logits': shared memory is not supported" in message


def test_non_boolean_binary_data_is_rejected() -> None:
    out = {"name": "logits", "parameters": {"binary_data": 1}}
    message = _rejects(_json(_digits_request(outputs=[out])))
    assert "'binary_data' must be true or false" in message


def test_outputs_that_are_not_a_list_are_rejected() -> None:
    message = _rejects(_json(_digits_request(outputs={"name": "label"})))
    assert "'outputs' must be a list, got an object" in message


# --- parse_json_object --------------------------------------------------------------------


def test_parse_json_object_returns_the_object() -> None:
    assert parse_json_object(b'{"a": [1, 2]}', "load request") == {"a": [1, 2]}


def test_parse_json_object_names_what_it_was_parsing() -> None:
    with pytest.raises(BadRequest, match=re.escape("load request is not valid JSON: ")):
        parse_json_object(b"{nope", "load request")
    with pytest.raises(BadRequest, match="load request must be a JSON object, got a string"):
        parse_json_object(b'"x"', "load request")


@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64"])
def test_float_data_at_and_past_the_datatype_limit_converts_as_numpy_rounds_it(
    datatype: str,
) -> None:
    """The one-reduction path for float data (the common case) must agree with the checks it
    skips: the largest finite value and its negation convert exactly; a value past it that
    rounds to that value converts to it; one that rounds to infinity is refused."""
    dtype = DTYPES[datatype]
    top = float(np.finfo(dtype).max)
    model = _model("f", [TensorSpec("x", datatype, (-1,))], [])

    def parsed(values: list[float]) -> np.ndarray:
        body = _json({"inputs": [_input("x", datatype, [len(values)], values)]})
        return _as_numpy(parse_infer_request(body, None, model).inputs[0])

    assert parsed([top, -top, 0.5, -0.0]).tolist() == [top, -top, 0.5, -0.0]
    if datatype == "FP64":
        return  # a float64 past its limit is not a finite JSON number: refused as such
    ulp = 2.0 ** (np.finfo(dtype).maxexp - 1 - np.finfo(dtype).nmant)  # the spacing at the top
    assert parsed([0.25, top + ulp / 4]).tolist() == [0.25, top]  # rounds down: no overflow
    message = _bad_input(model, _input("x", datatype, [2], [0.25, -(top + ulp)]))
    assert f"a value is out of range for {datatype}" in message

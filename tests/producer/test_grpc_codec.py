"""gRPC tensors in and out: typed and raw contents of every datatype become the same wire
tensors the HTTP parser makes, and answers come back the way the request came."""

from __future__ import annotations

import numpy as np
import pytest

from producer.errors import BadRequest
from producer.grpc_codec import (
    TYPED_FIELDS,
    decode_infer_request,
    encode_infer_response,
    parameter_values,
)
from protocol.grpc import inferq_v2_pb2 as pb
from protocol.registry import ModelMetadata, TensorSpec
from protocol.tensor import BYTES, DTYPES, Tensor

VALUES = {
    "BOOL": [True, False, True, True],
    "INT8": [-128, 0, 5, 127],
    "INT16": [-32768, 1, 2, 32767],
    "INT32": [-(2**31), 1, 2, 2**31 - 1],
    "INT64": [-(2**63), 1, 2, 2**63 - 1],
    "UINT8": [0, 1, 2, 255],
    "UINT16": [0, 1, 2, 65535],
    "UINT32": [0, 1, 2, 2**32 - 1],
    "UINT64": [0, 1, 2, 2**64 - 1],
    "FP32": [0.5, -1.25, 3.0, 1e30],
    "FP64": [0.5, -1.25, 3.0, 1e300],
}


def model(datatype: str) -> ModelMetadata:
    return ModelMetadata(
        name="m",
        versions=("1",),
        default_version="1",
        platform="test",
        inputs=(TensorSpec("x", datatype, (-1, 2)),),
        outputs=(TensorSpec("y", datatype, (-1, 2)), TensorSpec("z", "FP32", (-1,))),
        max_batch=8,
        default_timeout_ms=1000,
        cache_enabled=False,
        cache_ttl_s=0,
    )


def request(datatype: str, *, raw: bytes | None = None, **typed: list) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="m", id="r1")
    tensor = r.inputs.add(name="x", datatype=datatype, shape=[2, 2])
    for field, values in typed.items():
        getattr(tensor.contents, field).extend(values)
    if raw is not None:
        r.raw_input_contents.append(raw)
    return r


@pytest.mark.parametrize("datatype", sorted(VALUES))
def test_typed_and_raw_contents_give_the_same_wire_tensor(datatype):
    values = VALUES[datatype]
    expected = Tensor.from_numpy("x", np.array(values, DTYPES[datatype]).reshape(2, 2), datatype)
    typed = decode_infer_request(
        request(datatype, **{TYPED_FIELDS[datatype]: values}), model(datatype), {}
    )
    raw = decode_infer_request(request(datatype, raw=expected.data), model(datatype), {})
    assert typed.inputs == raw.inputs == [expected]
    assert typed.client_id == "r1" and typed.outputs is None


def test_bytes_travel_raw_or_typed():
    elements = [b"a", b"", "é".encode(), b"\xff\x00"]
    expected = Tensor.from_numpy("x", np.array(elements, dtype=object).reshape(2, 2), BYTES)
    typed = decode_infer_request(request(BYTES, bytes_contents=elements), model(BYTES), {})
    raw = decode_infer_request(request(BYTES, raw=expected.data), model(BYTES), {})
    assert typed.inputs == raw.inputs == [expected]


def test_fp16_travels_raw_only():
    data = np.arange(4, dtype="<f2").tobytes()
    assert decode_infer_request(request("FP16", raw=data), model("FP16"), {}).inputs[0].data == data
    with pytest.raises(BadRequest, match="FP16 has no typed contents field"):
        decode_infer_request(request("FP16", fp32_contents=[1.0] * 4), model("FP16"), {})


@pytest.mark.parametrize(
    ("datatype", "value", "message"),
    [
        ("INT8", 128, "a value is out of range for INT8 (-128 to 127), found 128"),
        ("UINT16", 65536, "a value is out of range for UINT16 (0 to 65535), found 65536"),
        ("INT16", -40000, "a value is out of range for INT16 (-32768 to 32767), found -40000"),
    ],
)
def test_typed_values_outside_a_narrow_datatype_are_refused(datatype, value, message):
    field = TYPED_FIELDS[datatype]
    with pytest.raises(BadRequest, match=message.replace("(", r"\(").replace(")", r"\)")):
        decode_infer_request(request(datatype, **{field: [0, 0, 0, value]}), model(datatype), {})


def test_requested_outputs_and_parameters_are_read_as_http_reads_them():
    r = request("FP32", fp32_contents=[0.0] * 4)
    r.outputs.add(name="z")
    r.parameters["priority"].uint64_param = 1
    r.parameters["cache"].bool_param = False
    r.parameters["note"].string_param = "hi"
    r.parameters["weight"].double_param = 0.5
    r.parameters["empty"].CopyFrom(pb.InferParameter())
    params = parameter_values(r.parameters)
    assert params == {"priority": 1, "cache": False, "note": "hi", "weight": 0.5, "empty": None}
    body = decode_infer_request(r, model("FP32"), params)
    assert body.outputs == ["z"] and body.parameters is params
    r.outputs.add(name="nope")
    with pytest.raises(BadRequest, match="model 'm' has no output 'nope'"):
        decode_infer_request(r, model("FP32"), {})


def test_answers_are_raw_unless_the_request_was_typed():
    y = Tensor.from_numpy("y", np.array([[1, 2], [3, 4]], dtype=np.int32))
    z = Tensor.from_numpy("z", np.array([0.5, 1.5], dtype=np.float32))
    raw = encode_infer_response(
        client_id="c", model_name="m", model_version="1", outputs=[y, z], typed=False
    )
    assert raw.id == "c" and raw.model_version == "1"
    assert [(o.name, o.datatype, list(o.shape)) for o in raw.outputs] == [
        ("y", "INT32", [2, 2]),
        ("z", "FP32", [2]),
    ]
    assert list(raw.raw_output_contents) == [y.data, z.data]
    typed = encode_infer_response(
        client_id=None, model_name="m", model_version="1", outputs=[y, z], typed=True
    )
    assert not typed.raw_output_contents and typed.id == ""
    assert list(typed.outputs[0].contents.int_contents) == [1, 2, 3, 4]
    assert list(typed.outputs[1].contents.fp32_contents) == [0.5, 1.5]
    text = Tensor.from_numpy("t", np.array([b"x", b"yz"], dtype=object), BYTES)
    half = Tensor.from_numpy("h", np.zeros(2, dtype="<f2"))
    answer = encode_infer_response(
        client_id=None, model_name="m", model_version="1", outputs=[text], typed=True
    )
    assert list(answer.outputs[0].contents.bytes_contents) == [b"x", b"yz"]
    # FP16 has no typed field: then every output comes back raw.
    mixed = encode_infer_response(
        client_id=None, model_name="m", model_version="1", outputs=[z, half], typed=True
    )
    assert list(mixed.raw_output_contents) == [z.data, half.data]

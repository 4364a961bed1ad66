"""V2 gRPC messages <-> the gateway's request body and result tensors. Pure functions, no I/O.

The checks are the HTTP parser's own (``producer.v2_request``), so a bad request gets the same
BadRequest message over either transport; only the data differs. ``raw_input_contents`` is
exactly the wire form of :class:`protocol.tensor.Tensor` (passed through, checked for size);
typed ``contents`` use the datatype's field, range-checked (FP16 has none: send it raw).
Answers come back the way the request came: raw outputs (what Triton sends and ``tritonclient``
reads) unless the request sent typed contents (then typed, unless an output has no field).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from producer.errors import BadRequest
from producer.v2_request import (
    InferRequestBody,
    check_element_count,
    check_input_parameters,
    check_inputs_complete,
    check_rows,
    check_tensor_header,
    raise_no_inputs,
    requested_outputs,
)
from protocol.errors import ProtocolError
from protocol.grpc import inferq_v2_pb2 as pb
from protocol.registry import ModelMetadata
from protocol.tensor import BYTES, DTYPES, Tensor, pack_bytes_elements, unpack_bytes_elements

TYPED_FIELDS: dict[str, str] = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    BYTES: "bytes_contents",
}
"""The ``InferTensorContents`` field of each V2 datatype (FP16 has none)."""

_INT_RANGES: dict[str, tuple[int, int]] = {
    name: (int(np.iinfo(DTYPES[name]).min), int(np.iinfo(DTYPES[name]).max))
    for name in ("INT8", "INT16", "UINT8", "UINT16")
}
"""Datatypes narrower than their typed field, whose values need a range check."""


def parameter_values(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """A protobuf parameter map (``InferParameter`` or ``ModelRepositoryParameter`` values) as
    plain Python values, the form the V2 JSON ``parameters`` object has."""
    values: dict[str, Any] = {}
    for key, parameter in parameters.items():
        kind = parameter.WhichOneof("parameter_choice")
        values[key] = None if kind is None else getattr(parameter, kind)
    return values


def decode_infer_request(
    request: pb.ModelInferRequest, model: ModelMetadata, parameters: dict[str, Any]
) -> InferRequestBody:
    """Validate ``request`` for ``model``; ``parameters`` are its request parameters as plain
    values (see :func:`parameter_values`; the caller may have merged the call's deadline in)."""
    inputs = request.inputs
    if not inputs:
        raise_no_inputs(model)
    raw = request.raw_input_contents
    if raw:
        if any(t.HasField("contents") for t in inputs):
            raise BadRequest(
                "the request has both raw_input_contents and typed 'contents': send every "
                "input one way or the other"
            )
        if len(raw) != len(inputs):
            raise BadRequest(
                f"raw_input_contents has {len(raw)} entries but the request has {len(inputs)} "
                "inputs: send one entry per input, in the order of 'inputs'"
            )
    specs = {s.name: s for s in model.inputs}
    tensors: list[Tensor] = []
    seen: set[str] = set()
    for index, tensor in enumerate(inputs):
        name, datatype, shape = check_tensor_header(
            {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)},
            index,
            specs,
            model,
        )
        if name in seen:
            raise BadRequest(f"input '{name}' appears more than once in the request")
        seen.add(name)
        check_input_parameters(name, parameter_values(tensor.parameters))
        if raw:
            try:
                tensors.append(Tensor.checked(name, datatype, shape, raw[index]))
            except ProtocolError as e:
                raise BadRequest(
                    f"input '{name}': raw_input_contents[{index}] does not fit: {e}"
                ) from None
        else:
            data = _typed_data(name, datatype, shape, tensor.contents)
            tensors.append(Tensor(name, datatype, shape, data))
    check_inputs_complete(seen, model)
    check_rows(tensors)
    outputs, _, _ = requested_outputs(
        [{"name": o.name, "parameters": parameter_values(o.parameters)} for o in request.outputs],
        model,
        False,
    )
    return InferRequestBody(
        client_id=request.id or None,
        inputs=tensors,
        outputs=outputs,
        binary_outputs=frozenset(),
        binary_all=False,
        parameters=parameters,
    )


def _typed_data(
    name: str, datatype: str, shape: tuple[int, ...], contents: pb.InferTensorContents
) -> bytes:
    field = TYPED_FIELDS.get(datatype)
    if field is None:
        raise BadRequest(
            f"input '{name}': {datatype} has no typed contents field; send it in raw_input_contents"
        )
    for other, _ in contents.ListFields():
        if other.name != field:
            raise BadRequest(
                f"input '{name}' is {datatype}: its values go in contents.{field}, found "
                f"contents.{other.name}"
            )
    values = getattr(contents, field)
    check_element_count(name, shape, math.prod(shape), len(values))
    if datatype == BYTES:
        return pack_bytes_elements(list(values))
    if datatype in _INT_RANGES and values:
        lo, hi = _INT_RANGES[datatype]
        low, high = min(values), max(values)
        if low < lo or high > hi:
            raise BadRequest(
                f"input '{name}': a value is out of range for {datatype} ({lo} to {hi}), "
                f"found {low if low < lo else high}"
            )
    return np.array(values, dtype=DTYPES[datatype]).tobytes()


def encode_infer_response(
    *,
    client_id: str | None,
    model_name: str,
    model_version: str,
    outputs: list[Tensor],
    typed: bool,
) -> pb.ModelInferResponse:
    """The answer: raw outputs, or typed contents when ``typed`` and every output has a typed
    field."""
    response = pb.ModelInferResponse(
        model_name=model_name, model_version=model_version, id=client_id or ""
    )
    typed = typed and all(t.datatype in TYPED_FIELDS for t in outputs)
    for tensor in outputs:
        out = response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        if not typed:
            response.raw_output_contents.append(tensor.data)
        elif tensor.datatype == BYTES:
            out.contents.bytes_contents.extend(unpack_bytes_elements(tensor.data))
        else:
            values = np.frombuffer(tensor.data, dtype=DTYPES[tensor.datatype]).tolist()
            getattr(out.contents, TYPED_FIELDS[tensor.datatype]).extend(values)
    return response

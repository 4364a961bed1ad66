"""Open Inference Protocol (KServe V2) inference responses: result tensors to a response body.
Pure functions, no I/O.

An output goes as JSON ``data`` (flat, row-major) unless the request asked for it as binary data
(``binary_all or name in binary_outputs``, see ``producer.v2_request.InferRequestBody``), or JSON
cannot carry it exactly: BYTES elements that are not UTF-8, floats that are not finite. Those go
as binary data whatever was asked (lossless, and every client of the binary extension reads it),
so callers always honour the returned header length. The JSON part is strict JSON.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from protocol.tensor import BYTES, DTYPES, Tensor
from protocol.tensor import unpack_bytes_elements as _unpack_bytes

__all__ = ["encode_infer_response", "response_document"]


def response_document(
    *,
    client_id: str | None,
    model_name: str,
    model_version: str,
    outputs: list[Tensor],
    binary_outputs: frozenset[str],
    binary_all: bool,
) -> tuple[dict[str, Any], list[bytes]]:
    """The response's JSON document and the binary data that follows it, in output order (an
    output sent as binary data has ``"parameters": {"binary_data_size": n}`` and no ``data``)."""
    entries: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for tensor in outputs:
        entry: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
        }
        data = None
        if not (binary_all or tensor.name in binary_outputs):
            data = _json_values(tensor)
        if data is None:
            entry["parameters"] = {"binary_data_size": len(tensor.data)}
            blobs.append(tensor.data)
        else:
            entry["data"] = data
        entries.append(entry)
    document: dict[str, Any] = {}
    if client_id is not None:
        document["id"] = client_id
    document["model_name"] = model_name
    document["model_version"] = model_version
    document["outputs"] = entries
    return document, blobs


def encode_infer_response(document: dict[str, Any], blobs: list[bytes]) -> tuple[bytes, int | None]:
    """The body of a ``response_document`` and its header length: ``None`` for plain JSON
    (``application/json``); else the length to send as ``Inference-Header-Content-Length``
    with ``application/octet-stream``."""
    header = orjson.dumps(document)  # compact and strict: non-finite values are in the blobs
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)


def _json_values(tensor: Tensor) -> list[Any] | None:
    """The flat JSON values of a tensor, or None when JSON cannot carry them exactly."""
    if tensor.datatype == BYTES:
        try:
            return [e.decode("utf-8") for e in _unpack_bytes(tensor.data)]
        except UnicodeDecodeError:
            return None
    arr = np.frombuffer(tensor.data, dtype=DTYPES[tensor.datatype])
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        return None
    values: list[Any] = arr.tolist()
    return values

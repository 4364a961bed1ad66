"""Open Inference Protocol (KServe V2) inference requests: parse a body and check it against the
model. Pure functions, no I/O.

In: the raw body and the ``Inference-Header-Content-Length`` value (``None``: the whole body is
JSON; else the first ``n`` bytes are the JSON header and the rest the raw data of the inputs that
set ``parameters.binary_data_size``, in their order). Out: an :class:`InferRequestBody` whose
tensors are already in wire form (:class:`protocol.tensor.Tensor`, which is also the binary
extension's form, so binary data passes through untouched). Every problem raises
:class:`producer.errors.BadRequest` with a message for the person who sent it, naming the input
or output concerned. The gRPC codec (``producer.grpc_codec``) calls the same checks, so both
transports refuse alike.

Deliberate rules: ``NaN``, ``Infinity`` and number literals too large to be finite are not JSON
(RFC 8259) and are refused (non-finite values travel as binary data); so is an integer literal
beyond Python's 4,300-digit conversion limit. ``true``/``false`` mixed with numbers read as 1/0
(numpy's conversion; checking would cost a loop per element). Shared memory and the
classification extension are refused.

A request must hold work the model's config allows, for a request the model cannot run fails
at the model and counts toward its circuit breaker, against every caller (issue #21). So: every
dimension has at least one element (a config's dimensions are positive or -1, variable; zero
rows are not a request), and all inputs have the same number of rows (the batch dimension, the
first, along which the worker batches requests), whatever the order they come in.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt
import orjson

from producer.errors import BadRequest
from protocol.errors import ProtocolError
from protocol.registry import ModelMetadata, TensorSpec
from protocol.tensor import BYTES, DATATYPES, DTYPES, Tensor, pack_bytes_elements

__all__ = [
    "InferRequestBody",
    "check_element_count",
    "check_input_parameters",
    "check_inputs_complete",
    "check_nesting",
    "check_rows",
    "check_tensor_header",
    "parse_infer_request",
    "parse_json_object",
    "raise_no_inputs",
    "requested_outputs",
]

_INT_RANGES: dict[str, tuple[int, int]] = {
    name: (int(np.iinfo(dt).min), int(np.iinfo(dt).max))
    for name, dt in DTYPES.items()
    if dt.kind in "iu"
}
_EXACT_FLOAT_INT = 2**53
"""Every integer up to this magnitude is exact in float64."""
_FLOAT_TYPES = frozenset(name for name, dt in DTYPES.items() if dt.kind == "f")
_FLOAT_MAX = {name: float(np.finfo(DTYPES[name]).max) for name in _FLOAT_TYPES}
"""The largest finite value of each float datatype: a value at most this large casts to it
without overflow."""
_DATATYPE_LIST = ", ".join(sorted(DATATYPES))

_FLOAT_KINDS = "f"

MAX_NESTING = 32
"""The deepest lists and objects may nest in ``parameters`` and in model-control bodies. The
protocol's parameters are scalars, and what inferq takes besides (a webhook, traffic weights)
nests two levels; deeper, code that walks them (the Idempotency-Key fingerprint, logs,
msgpack) would recurse out of Python's stack, a 500 (issue #21)."""

_KIND_WORDS = {
    "b": "true/false values",
    "i": "integers",
    "u": "integers",
    "f": "numbers",
    "U": "strings",
    "S": "strings",
    "O": "mixed or non-numeric values",
}


@dataclass(frozen=True, slots=True)
class InferRequestBody:
    """A validated inference request.

    ``binary_outputs`` and ``binary_all`` are resolved from ``parameters.binary_data_output`` and
    each output's ``parameters.binary_data`` (which wins): an output is sent as binary data
    exactly when ``binary_all or name in binary_outputs`` (``producer.v2_response``).
    ``binary_all`` holds only when ``binary_data_output`` is set and no requested output opted
    out; ``binary_outputs`` then names every output too.
    """

    client_id: str | None
    """The request's ``id``, echoed in the response; ``None`` when absent."""
    inputs: list[Tensor]
    """Validated inputs in wire form, in the order the request lists them."""
    outputs: list[str] | None
    """Requested output names in request order; ``None`` (also for an empty list) means all."""
    binary_outputs: frozenset[str]
    binary_all: bool
    parameters: dict[str, Any]
    """The request-level ``parameters`` object as sent (``timeout``, ``priority``, ...); ``{}``
    when absent. Only ``binary_data_output`` is checked here."""


class _NotJsonNumber(ValueError):
    """``NaN``, ``Infinity`` or ``-Infinity``: Python's reader takes them, JSON has none."""


def _refuse_constant(literal: str) -> Any:
    raise _NotJsonNumber(literal)


def parse_json_object(body: bytes, what: str) -> dict[str, Any]:
    """Decode ``body`` as a UTF-8 JSON object; anything else is a BadRequest about ``what``."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        # orjson is strict JSON too, but words its errors for programmers: the standard
        # library reads the body again to say what is wrong (or reads what orjson cannot, an
        # integer beyond 64 bits, for the checks below to judge).
        value = _parse_slowly(body, what)
    if not isinstance(value, dict):
        raise BadRequest(f"{what} must be a JSON object, got {_json_type(value)}")
    return value


def _parse_slowly(body: bytes, what: str) -> Any:
    try:
        value = json.loads(body.decode("utf-8"), parse_constant=_refuse_constant)
    except UnicodeDecodeError as e:
        raise BadRequest(f"{what} is not valid JSON: it is not UTF-8 text ({e})") from None
    except _NotJsonNumber as e:
        raise BadRequest(
            f"{what} holds {e}, which JSON does not allow (it has no NaN or Infinity); send "
            "non-finite values as binary data (the binary tensor extension)"
        ) from None
    except json.JSONDecodeError as e:
        raise BadRequest(f"{what} is not valid JSON: {e}") from None
    except ValueError:
        # The one other ValueError json.loads raises: an integer literal longer than Python
        # converts (sys.set_int_max_str_digits); before the fix it escaped as a 500.
        raise BadRequest(
            f"{what} holds an integer literal longer than {sys.get_int_max_str_digits()} "
            "digits; no tensor datatype or parameter can hold it"
        ) from None
    except RecursionError:
        raise BadRequest(f"{what} is not valid JSON: it is nested too deeply") from None
    _check_unicode(value, what)
    return value


def _check_unicode(value: Any, what: str) -> None:
    """Refuse a document holding a string that is not Unicode text: a ``\\uXXXX`` escape of a
    lone surrogate (orjson refuses them, the standard library reads them). Such a name or id
    could not even be written into the error that names it (it was a 500, issue #21); tensor
    bytes that are not text travel as binary data."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(
            f"{what} holds the escape \\u{ord(e.object[e.start]):04x}, an unpaired surrogate, "
            "which is not valid Unicode text: names, ids and strings must be; send such data "
            "as binary data"
        ) from None
    except RecursionError:
        raise BadRequest(f"{what} is not valid JSON: it is nested too deeply") from None


def check_nesting(value: Any, what: str, limit: int = MAX_NESTING) -> None:
    """Refuse lists and objects nested deeper than ``limit`` in ``value`` (without recursing:
    the point is a document too deep to recurse into)."""
    level: list[Any] = [value]
    for _ in range(limit):
        inner: list[Any] = []
        for item in level:
            if isinstance(item, dict):
                inner.extend(item.values())
            elif isinstance(item, list):
                inner.extend(item)
        if not inner:
            return
        level = [i for i in inner if isinstance(i, dict | list)]
        if not level:
            return
    raise BadRequest(f"{what} nests lists or objects more than {limit} deep")


def parse_infer_request(
    body: bytes, header_length: int | None, model: ModelMetadata
) -> InferRequestBody:
    """Parse and validate a V2 inference request for ``model``.

    ``header_length`` is the ``Inference-Header-Content-Length`` header (``None`` when absent:
    the whole body is JSON). Raises BadRequest for anything malformed or not matching the model.
    """
    if header_length is None:
        header = body
        binary_end = pos = len(body)
        what = "request body"
    else:
        if header_length < 0 or header_length > len(body):
            raise BadRequest(
                f"Inference-Header-Content-Length is {header_length} but the request body has "
                f"{len(body)} bytes"
            )
        header = body[:header_length]
        pos = header_length
        binary_end = len(body)
        what = f"request body (its JSON header, the first {header_length} bytes)"
    request = parse_json_object(header, what)

    client_id = request.get("id")
    if client_id is not None and not isinstance(client_id, str):
        raise BadRequest(f"request 'id' must be a string, got {_json_type(client_id)}")

    parameters = request.get("parameters")
    if parameters is None:
        parameters = {}
    elif not isinstance(parameters, dict):
        raise BadRequest(f"request 'parameters' must be an object, got {_json_type(parameters)}")
    check_nesting(parameters, "request 'parameters'")
    binary_data_output = parameters.get("binary_data_output", False)
    if not isinstance(binary_data_output, bool):
        raise BadRequest("request parameter 'binary_data_output' must be true or false")

    raw_inputs = request.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise_no_inputs(model)

    specs = {s.name: s for s in model.inputs}
    inputs: list[Tensor] = []
    seen: set[str] = set()
    for index, raw in enumerate(raw_inputs):
        if not isinstance(raw, dict):
            raise BadRequest(f"inputs[{index}] must be an object, got {_json_type(raw)}")
        name, datatype, shape = check_tensor_header(raw, index, specs, model)
        if name in seen:
            raise BadRequest(f"input '{name}' appears more than once in the request")
        seen.add(name)

        params = raw.get("parameters")
        if params is None:
            params = {}
        elif not isinstance(params, dict):
            raise BadRequest(f"input '{name}': 'parameters' must be an object")
        check_nesting(params, f"input '{name}': 'parameters'")
        check_input_parameters(name, params)
        size = params.get("binary_data_size")
        if size is not None:
            if "data" in raw:
                raise BadRequest(f"input '{name}' has both 'data' and a binary_data_size")
            if type(size) is not int or size < 0:
                raise BadRequest(f"input '{name}': binary_data_size must be a non-negative integer")
            if pos + size > binary_end:
                raise BadRequest(_short_binary_message(name, size, binary_end - pos, header_length))
            try:
                tensor = Tensor.checked(name, datatype, shape, body[pos : pos + size])
            except ProtocolError as e:
                raise BadRequest(f"input '{name}': binary data does not fit: {e}") from None
            pos += size
        else:
            if "data" not in raw:
                raise BadRequest(
                    f"input '{name}' has no 'data' (and no binary_data_size for binary data)"
                )
            tensor = Tensor(name, datatype, shape, _json_tensor_data(name, datatype, shape, raw))
        inputs.append(tensor)

    check_inputs_complete(seen, model)
    check_rows(inputs)
    if pos != binary_end:
        raise BadRequest(
            f"request has {binary_end - pos} bytes of binary data after the JSON header that no "
            "input claims (the inputs' binary_data_size values add up to less)"
        )

    outputs, binary_outputs, binary_all = requested_outputs(
        request.get("outputs"), model, binary_data_output
    )
    return InferRequestBody(
        client_id=client_id,
        inputs=inputs,
        outputs=outputs,
        binary_outputs=binary_outputs,
        binary_all=binary_all,
        parameters=parameters,
    )


# --- requests: tensor headers -------------------------------------------------------------


def check_tensor_header(
    raw: dict[str, Any], index: int, specs: dict[str, TensorSpec], model: ModelMetadata
) -> tuple[str, str, tuple[int, ...]]:
    """Check an input's name, datatype and shape (``raw`` holds them under the V2 JSON keys)
    against the model; ``specs`` are the model's inputs by name."""
    name = raw.get("name")
    if not isinstance(name, str):
        raise BadRequest(f"inputs[{index}] needs a string 'name'")
    spec = specs.get(name)
    if spec is None:
        raise BadRequest(
            f"model '{model.name}' has no input '{name}'; its inputs are {_names(model.inputs)}"
        )
    datatype = raw.get("datatype")
    if not isinstance(datatype, str):
        raise BadRequest(
            f"input '{name}' needs a string 'datatype' ({spec.datatype} for this model)"
        )
    if datatype != spec.datatype:
        if datatype not in DATATYPES:
            raise BadRequest(
                f"input '{name}' has unknown datatype {datatype!r} (V2 datatypes are "
                f"{_DATATYPE_LIST}); model '{model.name}' expects {spec.datatype}"
            )
        raise BadRequest(
            f"input '{name}' has datatype {datatype} but model '{model.name}' expects "
            f"{spec.datatype}"
        )
    shape = raw.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise BadRequest(
            f"input '{name}': 'shape' must be a list of non-negative integers, got "
            f"{json.dumps(shape)}"
        )
    declared = spec.shape
    if len(shape) != len(declared) or any(
        d != want for d, want in zip(shape, declared, strict=True) if want >= 0
    ):
        raise BadRequest(
            f"input '{name}' has shape {shape} but model '{model.name}' expects {list(declared)}"
        )
    if 0 in shape:
        axis = shape.index(0)
        what = "0 rows (its first dimension)" if axis == 0 else f"dimension {axis} of size 0"
        raise BadRequest(
            f"input '{name}' has shape {shape}: {what}; model '{model.name}' takes at least one "
            f"element in every dimension of {list(declared)} (-1 is any size from 1)"
        )
    return name, datatype, tuple(shape)


def check_rows(inputs: list[Tensor]) -> None:
    """Every input has the same number of rows (its first dimension, the batch axis)."""
    first = inputs[0]
    for tensor in inputs[1:]:
        if tensor.shape[:1] != first.shape[:1]:
            raise BadRequest(
                f"input '{tensor.name}' has shape {list(tensor.shape)} but input '{first.name}' "
                f"has {list(first.shape)}: every input of a request has the same number of rows "
                "(the first dimension, along which requests are batched)"
            )


def raise_no_inputs(model: ModelMetadata) -> NoReturn:
    raise BadRequest(
        f"request needs 'inputs', a non-empty list of input tensors (model '{model.name}' "
        f"takes {_names(model.inputs)})"
    )


def check_input_parameters(name: str, params: dict[str, Any]) -> None:
    """Reject the input parameters of extensions this server does not implement."""
    if "shared_memory_region" in params:
        raise BadRequest(
            f"input '{name}': shared memory is not supported by this server; send the "
            "tensor in 'data' or as binary data"
        )


def check_inputs_complete(seen: set[str], model: ModelMetadata) -> None:
    """Every input of the model was given (``seen`` holds the names of those that were)."""
    if len(seen) != len(model.inputs):
        missing = [s.name for s in model.inputs if s.name not in seen]
        raise BadRequest(
            f"model '{model.name}' needs input{'s' if len(missing) > 1 else ''} "
            f"{_quoted(missing)}, missing from the request"
        )


def _short_binary_message(name: str, size: int, left: int, header_length: int | None) -> str:
    if header_length is None:
        return (
            f"input '{name}' has binary_data_size {size} but the request has no binary data "
            "(send the Inference-Header-Content-Length header with the JSON header's length)"
        )
    return (
        f"input '{name}' has binary_data_size {size} but only {left} bytes of binary data "
        "remain after the JSON header and the inputs before it"
    )


# --- requests: JSON data ------------------------------------------------------------------


def _json_tensor_data(
    name: str, datatype: str, shape: tuple[int, ...], raw: dict[str, Any]
) -> bytes:
    """The wire bytes of an input given as JSON ``data`` (flat or nested, row-major)."""
    data = raw["data"]
    if not isinstance(data, list):
        raise BadRequest(f"input '{name}': 'data' must be a list, got {_json_type(data)}")
    need = math.prod(shape)
    if datatype == BYTES:
        elements = _json_strings(name, data)
        check_element_count(name, shape, need, len(elements))
        try:
            encoded = [e.encode("utf-8") for e in elements]
        except UnicodeEncodeError:
            raise BadRequest(
                f"input '{name}': a string holds an unpaired surrogate escape and is not valid "
                "Unicode; send such data as binary data"
            ) from None
        return pack_bytes_elements(encoded)
    return _json_numbers(name, datatype, shape, need, data).tobytes()


def check_element_count(name: str, shape: tuple[int, ...], need: int, got: int) -> None:
    if got != need:
        raise BadRequest(
            f"input '{name}': shape {list(shape)} needs {need} "
            f"element{'' if need == 1 else 's'}, got {got}"
        )


def _json_strings(name: str, data: list[Any]) -> list[str]:
    for item in data:
        if type(item) is not str:
            break
    else:
        return data  # the common case: a flat list of strings
    try:
        flat = np.array(data, dtype=object).ravel().tolist()
    except ValueError:
        raise BadRequest(f"input '{name}': 'data' nested lists are ragged") from None
    for item in flat:
        if isinstance(item, list):
            raise BadRequest(
                f"input '{name}': 'data' nested lists are ragged (every row must have the "
                "same length)"
            )
        if not isinstance(item, str):
            raise BadRequest(
                f"input '{name}': BYTES data must be strings, found {_json_type(item)}"
            )
    return flat


def _json_numbers(
    name: str, datatype: str, shape: tuple[int, ...], need: int, data: list[Any]
) -> npt.NDArray[Any]:
    """Convert numeric JSON data to a flat little-endian array, vectorised."""
    try:
        arr = np.array(data)
    except ValueError:
        raise BadRequest(
            f"input '{name}': 'data' nested lists are ragged (every row must have the same length)"
        ) from None
    check_element_count(name, shape, need, arr.size)
    dtype = DTYPES[datatype]
    if arr.size == 0:
        return np.empty(0, dtype=dtype)
    arr = arr.reshape(-1)
    kind = arr.dtype.kind
    if datatype == "BOOL":
        if kind != "b":
            raise BadRequest(
                f"input '{name}': BOOL data must be true or false, "
                f"found {_KIND_WORDS.get(kind, 'other values')}"
            )
        return arr
    if kind == "O":
        arr = _object_numbers(name, datatype, arr)
        kind = arr.dtype.kind
    elif kind not in "iuf":
        raise BadRequest(
            f"input '{name}': {datatype} data must be numbers, "
            f"found {_KIND_WORDS.get(kind, 'other values')}"
        )
    if kind in _FLOAT_KINDS and datatype in _FLOAT_TYPES:
        # The common case, JSON numbers for a float input, in one reduction: when the largest
        # magnitude is finite and within the datatype's range, every value is, and the cast
        # below can neither overflow nor warn (NaN propagates, so it fails the test too). Else
        # the checks below find what is wrong, as they always have.
        if np.maximum.reduce(np.abs(arr)) <= _FLOAT_MAX[datatype]:
            return arr if arr.dtype == dtype else arr.astype(dtype)
    if kind in _FLOAT_KINDS and not np.isfinite(arr).all():
        # NaN and Infinity were refused by the reader: this is a literal such as 1e999.
        raise BadRequest(
            f"input '{name}': a value is too large to be a finite number; JSON carries finite "
            "numbers only, send non-finite values as binary data"
        )

    if datatype in _FLOAT_TYPES:
        if arr.dtype == dtype:
            return arr
        with np.errstate(over="ignore", invalid="ignore"):
            out = arr.astype(dtype)
        if not np.isfinite(out).all() and (np.isinf(out) & np.isfinite(arr)).any():
            raise BadRequest(
                f"input '{name}': a value is out of range for {datatype} "
                f"(largest magnitude {float(np.finfo(dtype).max):g})"
            )
        return out

    lo, hi = _INT_RANGES[datatype]
    if kind == "f":
        if not (arr == np.trunc(arr)).all():
            raise BadRequest(
                f"input '{name}': {datatype} data must be whole numbers, found a fraction or NaN"
            )
        low, high = float(arr.min()), float(arr.max())  # Python compares float and int exactly
        if max(-low, high) > _EXACT_FLOAT_INT:
            # numpy turns integers mixed with floats, or int64 mixed with uint64 values, into
            # float64: beyond 2**53 that loses digits, so check the values as sent, exactly.
            return _object_numbers(name, datatype, np.array(data, dtype=object).reshape(-1))
    else:
        low, high = int(arr.min()), int(arr.max())
    if low < lo or high > hi:
        raise BadRequest(
            f"input '{name}': a value is out of range for {datatype} ({lo} to {hi}), "
            f"found {_number(low if low < lo else high)}"
        )
    return arr.astype(dtype, copy=False)


def _object_numbers(name: str, datatype: str, arr: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """The slow path for what numpy could not type: huge integers, nulls, objects."""
    items = arr.tolist()
    for item in items:
        if type(item) is bool or not isinstance(item, int | float):
            raise BadRequest(
                f"input '{name}': {datatype} data must be numbers, found {_json_type(item)}"
            )
    if datatype in _INT_RANGES:
        lo, hi = _INT_RANGES[datatype]
        for item in items:
            if isinstance(item, float) and not item.is_integer():
                raise BadRequest(
                    f"input '{name}': {datatype} data must be whole numbers, found {item!r}"
                )
            if not lo <= item <= hi:
                raise BadRequest(
                    f"input '{name}': a value is out of range for {datatype} ({lo} to {hi}), "
                    f"found {_number(item)}"
                )
        return np.array([int(i) for i in items], dtype=DTYPES[datatype])
    try:
        return np.array([float(i) for i in items], dtype=np.float64)
    except OverflowError:
        raise BadRequest(f"input '{name}': a value is out of range for {datatype}") from None


# --- requests: outputs --------------------------------------------------------------------


def requested_outputs(
    raw_outputs: Any, model: ModelMetadata, binary_data_output: bool
) -> tuple[list[str] | None, frozenset[str], bool]:
    """The requested outputs' names (``None``: all), those to send as binary data, and whether
    every output is (see :class:`InferRequestBody`); ``raw_outputs`` is the request's
    ``outputs`` list of ``{"name": ..., "parameters": {...}}`` objects."""
    if raw_outputs is None or raw_outputs == []:
        if binary_data_output:
            return None, frozenset(s.name for s in model.outputs), True
        return None, frozenset(), False
    if not isinstance(raw_outputs, list):
        raise BadRequest(f"request 'outputs' must be a list, got {_json_type(raw_outputs)}")
    known = {s.name for s in model.outputs}
    names: list[str] = []
    binary: set[str] = set()
    opted_out = False
    for index, raw in enumerate(raw_outputs):
        if not isinstance(raw, dict):
            raise BadRequest(f"outputs[{index}] must be an object, got {_json_type(raw)}")
        name = raw.get("name")
        if not isinstance(name, str):
            raise BadRequest(f"outputs[{index}] needs a string 'name'")
        if name not in known:
            raise BadRequest(
                f"model '{model.name}' has no output '{name}'; its outputs are "
                f"{_names(model.outputs)}"
            )
        if name in names:
            raise BadRequest(f"output '{name}' is requested more than once")
        params = raw.get("parameters")
        if params is None:
            params = {}
        elif not isinstance(params, dict):
            raise BadRequest(f"output '{name}': 'parameters' must be an object")
        check_nesting(params, f"output '{name}': 'parameters'")
        if params.get("classification", 0) not in (0, None):
            raise BadRequest(
                f"output '{name}': the classification extension is not supported by this server"
            )
        if "shared_memory_region" in params:
            raise BadRequest(f"output '{name}': shared memory is not supported by this server")
        want_binary = params.get("binary_data")
        if want_binary is None:
            want_binary = binary_data_output
        elif not isinstance(want_binary, bool):
            raise BadRequest(f"output '{name}': parameter 'binary_data' must be true or false")
        else:
            opted_out = opted_out or not want_binary
        if want_binary:
            binary.add(name)
        names.append(name)
    return names, frozenset(binary), binary_data_output and not opted_out


# --- messages -----------------------------------------------------------------------------


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _number(value: float) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else repr(value)


def _quoted(names: list[str]) -> str:
    return ", ".join(f"'{n}'" for n in names)


def _names(specs: tuple[TensorSpec, ...]) -> str:
    if not specs:
        return "none"
    return ", ".join(f"'{s.name}' ({s.datatype} {list(s.shape)})" for s in specs)

"""Request bodies for a V2 model: generated from its metadata, or read from a file.

Generated inputs follow ``GET /v2/models/{m}[/versions/{v}]``: each input's shape with its
first ``-1`` dimension set to ``rows`` (the batch) and any other ``-1`` to 1, unless a shape is
given explicitly; data is random and seeded, per datatype:

* ``BOOL``: true/false; integer types: integers in [0, 100) (valid for every integer type,
  and as indices into any table of 100 entries or more); ``FP16``/``BF16``/``FP32``/``FP64``:
  uniform in [0, 1); ``BYTES``: 8 random lowercase ASCII letters per element.

Bodies are V2 JSON (``data`` flattened, row-major), or Triton's binary tensor extension
(``binary=True``): the JSON header lists each input with ``parameters.binary_data_size``, the raw
little-endian data follows in order (``BOOL`` one byte each, ``BF16`` the upper 16 bits of the
float32, ``BYTES`` 4-byte little-endian length prefixes), ``Inference-Header-Content-Length``
gives the header's length, and ``binary_data_output`` asks for binary outputs too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from loadgen.http import PreparedRequest
from protocol.tensor import BYTES, DTYPES

__all__ = [
    "DATATYPES",
    "InputSpec",
    "ModelRef",
    "Tensor",
    "build_requests",
    "concrete_shape",
    "generate_tensors",
    "generated_bodies",
    "input_specs",
    "parse_model_url",
    "random_tensor",
    "tensors_from_body",
]

#: numpy dtypes of the fixed-size V2 datatypes: the wire contract's, plus ``BF16``, which the
#: load generator sends as raw 16-bit words (``BYTES`` apart).
DATATYPES: dict[str, np.dtype[Any]] = {**DTYPES, "BF16": np.dtype("<u2")}
#: Integers are drawn from [0, INT_HIGH).
INT_HIGH = 100
BYTES_LENGTH = 8

_MODEL_PATH = re.compile(r"^(?P<prefix>.*?)/v2/models/(?P<model>[^/]+)(?:/versions/(?P<v>[^/]+))?")


@dataclass(frozen=True, slots=True)
class ModelRef:
    """Where a model lives: ``server`` (``http://host:port`` plus any path prefix) and names."""

    server: str
    model: str | None = None
    version: str | None = None

    def path(self, suffix: str = "") -> str:
        """``{prefix}/v2/models/{m}[/versions/{v}]{suffix}`` (path only, for requests)."""
        if not self.model:
            raise ValueError("no model given: pass --model or a /v2/models/NAME URL")
        prefix = _path_of(self.server)
        base = f"{prefix}/v2/models/{self.model}"
        if self.version:
            base += f"/versions/{self.version}"
        return base + suffix

    def url(self, suffix: str = "") -> str:
        scheme, _, rest = self.server.partition("://")
        netloc = rest.split("/", 1)[0]
        return f"{scheme}://{netloc}{self.path(suffix)}"


def _path_of(server: str) -> str:
    rest = server.partition("://")[2]
    _, slash, path = rest.partition("/")
    return ("/" + path).rstrip("/") if slash else ""


def parse_model_url(url: str) -> ModelRef:
    """``http://h:p``, ``http://h:p/prefix`` or ``http://h:p[/prefix]/v2/models/m[/versions/v]
    [/infer|/jobs]``: the server and whatever model and version the URL names."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"{url!r}: expected an http:// URL")
    netloc, _, path = rest.partition("/")
    path = "/" + path.split("?", 1)[0]
    match = _MODEL_PATH.match(path)
    if match is None:
        prefix = path.rstrip("/")
        return ModelRef(f"{scheme}://{netloc}{prefix}")
    prefix = match.group("prefix").rstrip("/")
    return ModelRef(f"{scheme}://{netloc}{prefix}", match.group("model"), match.group("v"))


@dataclass(frozen=True, slots=True)
class InputSpec:
    """One input as model metadata describes it (``-1`` marks variable dimensions)."""

    name: str
    datatype: str
    shape: tuple[int, ...]


def input_specs(metadata: Mapping[str, Any]) -> list[InputSpec]:
    """The inputs of a V2 model metadata document, checked."""
    raw = metadata.get("inputs")
    if not isinstance(raw, list) or not raw:
        raise ValueError("model metadata lists no inputs")
    specs = []
    for item in raw:
        try:
            name = item["name"]
            datatype = item["datatype"]
            shape = tuple(int(d) for d in item["shape"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"model metadata has a malformed input: {item!r}") from None
        if datatype not in DATATYPES and datatype != BYTES:
            raise ValueError(f"input {name!r}: unsupported datatype {datatype!r}")
        specs.append(InputSpec(str(name), str(datatype), shape))
    return specs


def concrete_shape(
    spec: InputSpec, rows: int = 1, overrides: Mapping[str, Sequence[int]] | None = None
) -> tuple[int, ...]:
    """The shape to send: an override if given, else the first ``-1`` as ``rows``, others 1."""
    if overrides and spec.name in overrides:
        shape = tuple(int(d) for d in overrides[spec.name])
        if any(d < 0 for d in shape):
            raise ValueError(f"input {spec.name!r}: shape {list(shape)} has a negative dimension")
        return shape
    out = []
    first = True
    for d in spec.shape:
        if d < 0:
            out.append(rows if first else 1)
            first = False
        else:
            out.append(d)
    return tuple(out)


@dataclass(frozen=True)
class Tensor:
    """An input ready to encode: ``data`` is a numpy array, or a list of bytes for BYTES."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: npt.NDArray[Any] | list[bytes]

    def json_data(self) -> list[Any]:
        if isinstance(self.data, list):
            return [b.decode("utf-8", "replace") for b in self.data]
        if self.datatype == "BF16":
            return list(_bf16_to_float(self.data).tolist())
        return list(self.data.reshape(-1).tolist())

    def raw(self) -> bytes:
        if isinstance(self.data, list):
            return b"".join(len(b).to_bytes(4, "little") + b for b in self.data)
        return np.ascontiguousarray(self.data, dtype=DATATYPES[self.datatype]).tobytes()


def _bf16_to_float(bits: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    return (bits.astype("<u4") << 16).view("<f4").reshape(-1)


def _float_to_bf16(values: npt.NDArray[Any]) -> npt.NDArray[np.uint16]:
    return (np.asarray(values, dtype="<f4").view("<u4") >> 16).astype("<u2")


def random_tensor(
    name: str, datatype: str, shape: tuple[int, ...], rng: np.random.Generator
) -> Tensor:
    """Seeded random data of ``datatype`` (see the module docstring for the ranges)."""
    count = int(np.prod(shape, dtype=np.int64))
    if datatype == BYTES:
        letters = rng.integers(97, 123, size=(count, BYTES_LENGTH), dtype=np.uint8)
        return Tensor(name, datatype, shape, [row.tobytes() for row in letters])
    if datatype == "BF16":
        data: npt.NDArray[Any] = _float_to_bf16(rng.random(count, dtype=np.float32))
    elif datatype == "BOOL":
        data = rng.integers(0, 2, size=count).astype(bool)
    else:
        dtype = DATATYPES[datatype]
        if dtype.kind in "iu":
            data = rng.integers(0, INT_HIGH, size=count).astype(dtype)
        else:
            data = rng.random(count).astype(dtype)
    return Tensor(name, datatype, shape, data.reshape(shape))


def generate_tensors(
    specs: Sequence[InputSpec],
    *,
    rows: int = 1,
    rng: np.random.Generator,
    overrides: Mapping[str, Sequence[int]] | None = None,
) -> list[Tensor]:
    """One random tensor per input of ``specs``."""
    if rows < 1:
        raise ValueError("rows must be at least 1")
    unknown = set(overrides or ()) - {s.name for s in specs}
    if unknown:
        names = ", ".join(sorted(unknown))
        raise ValueError(f"--shape names inputs the model does not have: {names}")
    return [
        random_tensor(s.name, s.datatype, concrete_shape(s, rows, overrides), rng) for s in specs
    ]


def tensors_from_body(body: Mapping[str, Any]) -> list[Tensor]:
    """The inputs of a V2 JSON inference request (for re-encoding as binary)."""
    inputs = body.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise ValueError("the request has no 'inputs' list")
    tensors = []
    for item in inputs:
        try:
            name, datatype = str(item["name"]), str(item["datatype"])
            shape = tuple(int(d) for d in item["shape"])
            values = item["data"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(
                "each input needs 'name', 'datatype', 'shape' and 'data' to be sent as binary"
            ) from None
        flat = np.asarray(values, dtype=object).reshape(-1).tolist()
        if datatype == BYTES:
            data: npt.NDArray[Any] | list[bytes] = [
                v.encode() if isinstance(v, str) else bytes(v) for v in flat
            ]
        elif datatype == "BF16":
            data = _float_to_bf16(np.asarray(flat, dtype=np.float32)).reshape(shape)
        elif datatype in DATATYPES:
            data = np.asarray(flat, dtype=DATATYPES[datatype]).reshape(shape)
        else:
            raise ValueError(f"input {name!r}: unsupported datatype {datatype!r}")
        tensors.append(Tensor(name, datatype, shape, data))
    return tensors


def _compact(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def encode_body(
    tensors: Sequence[Tensor],
    *,
    binary: bool = False,
    parameters: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> tuple[bytes, dict[str, str]]:
    """A V2 inference body for ``tensors`` and the headers that describe it.

    ``extra`` holds other top-level fields to keep (``id``, ``outputs``...); ``parameters`` are
    the request-level parameters."""
    request: dict[str, Any] = dict(extra or {})
    params = dict(parameters or {})
    if not binary:
        request["inputs"] = [
            {"name": t.name, "datatype": t.datatype, "shape": list(t.shape), "data": t.json_data()}
            for t in tensors
        ]
        if params:
            request["parameters"] = params
        return _compact(request), {"content-type": "application/json"}
    raws = [t.raw() for t in tensors]
    request["inputs"] = [
        {
            "name": t.name,
            "datatype": t.datatype,
            "shape": list(t.shape),
            "parameters": {"binary_data_size": len(raw)},
        }
        for t, raw in zip(tensors, raws, strict=True)
    ]
    params.setdefault("binary_data_output", True)
    request["parameters"] = params
    header = _compact(request)
    headers = {
        "content-type": "application/octet-stream",
        "inference-header-content-length": str(len(header)),
    }
    return header + b"".join(raws), headers


def generated_bodies(
    metadata: Mapping[str, Any],
    *,
    count: int,
    rows: int = 1,
    seed: int = 0,
    binary: bool = False,
    parameters: Mapping[str, Any] | None = None,
    overrides: Mapping[str, tuple[int, ...]] | None = None,
) -> list[tuple[bytes, dict[str, str]]]:
    """``count`` distinct random V2 bodies (with their headers) for the model that
    ``metadata`` describes: ``rows`` per request, or the exact shapes in ``overrides``."""
    specs = input_specs(metadata)
    rng = np.random.default_rng(seed)
    return [
        encode_body(
            generate_tensors(specs, rows=rows, rng=rng, overrides=overrides),
            binary=binary,
            parameters=parameters,
        )
        for _ in range(count)
    ]


def build_requests(
    path: str,
    bodies: Sequence[tuple[bytes, Mapping[str, str]]],
    headers: Mapping[str, str] | None = None,
) -> list[PreparedRequest]:
    """POSTs of ``bodies`` to ``path``; ``headers`` (the user's) win over the body's own."""
    out = []
    for body, own in bodies:
        merged = {k.lower(): v for k, v in own.items()}
        merged.update({k.lower(): v for k, v in (headers or {}).items()})
        out.append(PreparedRequest("POST", path, body, merged))
    return out


def bodies_from_file(
    document: Any, *, binary: bool, parameters: Mapping[str, Any] | None = None
) -> list[tuple[bytes, dict[str, str]]]:
    """Bodies from a parsed ``--input-file``: one V2 request object, or a list of them."""
    items = document if isinstance(document, list) else [document]
    if not items or not all(isinstance(i, dict) for i in items):
        raise ValueError("the input file must hold a V2 inference request object or a list of them")
    out = []
    for item in items:
        params = {**(item.get("parameters") or {}), **(parameters or {})}
        extra = {k: v for k, v in item.items() if k not in ("inputs", "parameters")}
        if binary:
            out.append(
                encode_body(tensors_from_body(item), binary=True, parameters=params, extra=extra)
            )
        else:
            if not isinstance(item.get("inputs"), list):
                raise ValueError("the request has no 'inputs' list")
            request = {**extra, "inputs": item["inputs"]}
            if params:
                request["parameters"] = params
            out.append((_compact(request), {"content-type": "application/json"}))
    return out

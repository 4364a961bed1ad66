"""The sans-I/O core of ``inferq.client``: every request built and every answer read once.

- The V2 codec: ``infer_body`` (numpy arrays to JSON or binary tensors), ``read_response`` and
  ``read_result`` (answers to arrays; ``InferqError`` for 4xx/5xx), ``EventParser`` (SSE).
- The operations, as generators: each yields a ``Call`` (a request, as data) or a ``Sleep``
  (a pause), is sent back the ``httpx.Response`` or thrown the ``httpx.TransportError``, and
  returns its result. ``retried`` is the 429/503 Retry-After rule, ``idempotent`` adds the
  lost-connection retry of a submission; ``_JobOps`` and ``_BatchOps`` are the handles' long
  poll, wait and cancel. ``Stream`` is a streamed GET and how its lines are read.

Nothing here sends or sleeps: ``inferq.client``'s two clients drive these operations, one with
``httpx.Client`` and ``time.sleep``, the other with ``httpx.AsyncClient`` and ``asyncio.sleep``,
so a rule changes in one place and is tested without a server.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias, TypeVar

import httpx
import numpy as np

DEFAULT_RETRIES = 5
MAX_RETRY_AFTER_S = 30.0
"""A Retry-After longer than this is waited this long (then asked again)."""
FINAL_JOB = frozenset({"succeeded", "failed", "expired", "cancelled"})
FINAL_BATCH = frozenset({"completed", "failed", "expired", "cancelled"})
RETRIED = frozenset({429, 503})

_DATATYPES = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}
_OF_DTYPE = {np.dtype(t): name for name, t in _DATATYPES.items()}

Inputs = Mapping[str, Any]
"""Input name -> array (anything ``numpy.asarray`` takes)."""


class InferqError(Exception):
    """The gateway refused or failed a request: ``status`` and its message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class InferResult:
    """A V2 response: its outputs as numpy arrays, and the document as sent."""

    outputs: dict[str, np.ndarray]
    model_name: str
    model_version: str | None
    raw: dict[str, Any] = field(repr=False)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.outputs[name]


# -- the V2 codec: building requests and reading answers ------------------------------------


def datatype_of(array: np.ndarray) -> str:
    try:
        return _OF_DTYPE[array.dtype]
    except KeyError:
        raise TypeError(f"no V2 datatype for numpy dtype {array.dtype}") from None


def infer_body(
    inputs: Inputs,
    *,
    binary: bool = False,
    outputs: Iterable[str] | None = None,
    parameters: Mapping[str, Any] | None = None,
    request_id: str | None = None,
) -> tuple[bytes, dict[str, str]]:
    """A V2 request (body, headers): JSON data, or with ``binary`` the binary tensor extension
    for inputs and outputs."""
    tensors, blobs = [], []
    for name, value in inputs.items():
        array = np.asarray(value)
        tensor: dict[str, Any] = {
            "name": name,
            "datatype": datatype_of(array),
            "shape": list(array.shape),
        }
        if binary:
            blob = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
            tensor["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            tensor["data"] = array.reshape(-1).tolist()
        tensors.append(tensor)
    doc: dict[str, Any] = {"inputs": tensors}
    params = dict(parameters or {})
    if binary:
        params["binary_data_output"] = True
    if params:
        doc["parameters"] = params
    if outputs is not None:
        doc["outputs"] = [{"name": n} for n in outputs]
    if request_id is not None:
        doc["id"] = request_id
    header = json.dumps(doc, separators=(",", ":")).encode()
    if not binary:
        return header, {"content-type": "application/json"}
    return b"".join([header, *blobs]), {
        "content-type": "application/octet-stream",
        "inference-header-content-length": str(len(header)),
    }


def read_result(doc: dict[str, Any], blobs: bytes = b"") -> InferResult:
    """A V2 response document (and the binary data after its JSON) as arrays."""
    outputs, pos = {}, 0
    for tensor in doc.get("outputs", []):
        datatype = tensor["datatype"]
        shape = tensor["shape"]
        size = (tensor.get("parameters") or {}).get("binary_data_size")
        if datatype == "BYTES":
            outputs[tensor["name"]] = np.array(tensor.get("data", []), dtype=object).reshape(shape)
            continue
        dtype = np.dtype(_DATATYPES[datatype]).newbyteorder("<")
        if size is not None:
            array = np.frombuffer(blobs[pos : pos + size], dtype=dtype).reshape(shape)
            pos += size
        else:
            array = np.asarray(tensor["data"], dtype=dtype).reshape(shape)
        outputs[tensor["name"]] = array
    return InferResult(outputs, doc.get("model_name", ""), doc.get("model_version"), doc)


def read_response(response: httpx.Response) -> tuple[dict[str, Any], bytes]:
    """The JSON document of an answer and the binary data after it; InferqError for 4xx/5xx."""
    if response.status_code >= 400:
        try:
            message = response.json().get("error", response.text)
        except ValueError:
            message = response.text
        raise InferqError(response.status_code, message)
    length = response.headers.get("inference-header-content-length")
    content = response.content
    if length is None:
        return json.loads(content), b""
    return json.loads(content[: int(length)]), content[int(length) :]


def retry_after_s(response: httpx.Response) -> float | None:
    """How long to wait before retrying this answer; None: do not retry it."""
    if response.status_code not in RETRIED:
        return None
    raw = response.headers.get("retry-after")
    try:
        return min(MAX_RETRY_AFTER_S, max(0.0, float(raw))) if raw is not None else 1.0
    except ValueError:
        return 1.0


def batch_body(lines: Iterable[Mapping[str, Any] | bytes | str]) -> bytes:
    """JSONL of the lines (dicts, or lines already encoded)."""
    out = []
    for item in lines:
        if isinstance(item, bytes):
            out.append(item.rstrip(b"\n"))
        elif isinstance(item, str):
            out.append(item.rstrip("\n").encode())
        else:
            out.append(json.dumps(item, separators=(",", ":")).encode())
    return b"\n".join(out) + b"\n"


def batch_params(
    model: str | None, completion_window: str | None, metadata: Mapping[str, str] | None
) -> dict[str, str]:
    params = {}
    if model:
        params["model"] = model
    if completion_window:
        params["completion_window"] = completion_window
    if metadata:
        params["metadata"] = json.dumps(dict(metadata))
    return params


class EventParser:
    """``text/event-stream`` lines in, events (id, parsed data) out; comments (heartbeats)
    skipped."""

    def __init__(self) -> None:
        self._data: list[str] = []
        self._id: str | None = None
        self.last_id: str | None = None

    def feed(self, line: str) -> dict[str, Any] | None:
        if line == "":
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            self.last_id = self._id or self.last_id
            return {"id": self._id, "data": json.loads(data)}
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "id":
            self._id = value
        return None


def _headers(webhook: str | None, webhook_events: Iterable[str] | None) -> dict[str, str]:
    out = {}
    if webhook:
        out["inferq-webhook"] = webhook
    if webhook_events is not None:
        out["inferq-webhook-events"] = ",".join(webhook_events)
    return out


# -- the operations: generators of calls and pauses -----------------------------------------

LOST_CONNECTION_RETRY_S = 0.5
"""The pause before an idempotent call is sent again after a lost connection."""
LONG_POLL_S = 30.0
"""The longest ``wait`` one job long poll asks the gateway for."""


@dataclass(frozen=True, slots=True)
class Call:
    """One HTTP request, as data."""

    method: str
    path: str
    params: Mapping[str, Any] | None = None
    headers: Mapping[str, str] | None = None
    content: bytes | None = None
    timeout: Any = httpx.USE_CLIENT_DEFAULT

    def options(self) -> dict[str, Any]:
        """The keyword arguments of ``httpx.Client.request`` (and ``stream``) for it."""
        return {
            "params": self.params,
            "headers": self.headers,
            "content": self.content,
            "timeout": self.timeout,
        }


@dataclass(frozen=True, slots=True)
class Sleep:
    """A pause of ``seconds`` before the next call."""

    seconds: float


T = TypeVar("T")
Op: TypeAlias = Generator[Call | Sleep, Any, T]
"""An operation: yields calls and pauses, is sent each call's response, returns its result."""


@dataclass(frozen=True, slots=True)
class Stream:
    """A streamed GET: its call, and how each line of its body is read (None: skip the line)."""

    call: Call
    parse: Callable[[str], dict[str, Any] | None]

    @staticmethod
    def opened(response: httpx.Response) -> bool:
        """Whether the answer (its body read if it is an error) has lines to read: False on
        204, InferqError on 4xx/5xx."""
        if response.status_code >= 400:
            read_response(response)
        return response.status_code != 204


def event_stream(path: str, last_event_id: str | None) -> Stream:
    """The server-sent events at ``path``, after ``last_event_id``; never timed out."""
    headers = {"last-event-id": last_event_id} if last_event_id else {}
    return Stream(Call("GET", path, headers=headers, timeout=None), EventParser().feed)


def _json_line(line: str) -> dict[str, Any] | None:
    return json.loads(line) if line.strip() else None


def retried(call: Call, retries: int) -> Op[httpx.Response]:
    """``call``'s response, sent again after ``Retry-After`` while the gateway asks to retry
    (``retries`` times at most)."""
    for _ in range(retries):
        response: httpx.Response = yield call
        wait = retry_after_s(response)
        if wait is None:
            return response
        yield Sleep(wait)
    last: httpx.Response = yield call
    return last


def idempotent(call: Call, retries: int) -> Op[httpx.Response]:
    """``retried``, and also sent again after a lost connection: for a call that carries an
    Idempotency-Key, so that a repeat can never run it twice."""
    for _ in range(retries):
        try:
            return (yield from retried(call, retries))
        except httpx.TransportError:
            yield Sleep(LOST_CONNECTION_RETRY_S)
    return (yield from retried(call, retries))


def document(call: Call, retries: int) -> Op[dict[str, Any]]:
    """The JSON document ``call`` answers (retried); InferqError for 4xx/5xx."""
    doc, _ = read_response((yield from retried(call, retries)))
    return doc


def infer_op(
    retries: int,
    model: str,
    inputs: Inputs,
    version: str | None,
    binary: bool,
    outputs: Iterable[str] | None,
    parameters: Mapping[str, Any] | None,
) -> Op[InferResult]:
    body, headers = infer_body(inputs, binary=binary, outputs=outputs, parameters=parameters)
    call = Call("POST", _model_path(model, version) + "/infer", headers=headers, content=body)
    return read_result(*read_response((yield from retried(call, retries))))


def submit_op(
    retries: int,
    model: str,
    inputs: Inputs,
    version: str | None,
    binary: bool,
    parameters: Mapping[str, Any] | None,
    idempotency_key: str | None,
    webhook: str | None,
    webhook_events: Iterable[str] | None,
) -> Op[dict[str, Any]]:
    """The new job's document."""
    body, headers = infer_body(inputs, binary=binary, parameters=parameters)
    headers["idempotency-key"] = idempotency_key or uuid.uuid4().hex
    headers.update(_headers(webhook, webhook_events))
    call = Call("POST", _model_path(model, version) + "/jobs", headers=headers, content=body)
    doc, _ = read_response((yield from idempotent(call, retries)))
    return doc


def batch_op(
    retries: int,
    lines: Iterable[Mapping[str, Any] | bytes | str],
    model: str | None,
    completion_window: str | None,
    metadata: Mapping[str, str] | None,
    webhook: str | None,
    webhook_events: Iterable[str] | None,
) -> Op[dict[str, Any]]:
    """The new batch's document."""
    call = Call(
        "POST",
        "/v2/batches",
        params=batch_params(model, completion_window, metadata),
        headers={"content-type": "application/jsonl", **_headers(webhook, webhook_events)},
        content=batch_body(lines),
    )
    return (yield from document(call, retries))


class _Handle:
    """What a job or batch handle is, sync or async: its client, id, path and last document
    read; its operations update ``last``."""

    _PREFIX = ""

    def __init__(self, client: Any, ident: str, doc: dict[str, Any]) -> None:
        self.client, self.id, self.last = client, ident, doc

    @property
    def _path(self) -> str:
        return f"{self._PREFIX}/{self.id}"

    def _read(self, call: Call) -> Op[dict[str, Any]]:
        self.last = yield from document(call, self.client.retries)
        return self.last

    def _events(self, last_event_id: str | None) -> Stream:
        return event_stream(f"{self._path}/events", last_event_id)


class _JobOps(_Handle):
    _PREFIX = "/v2/jobs"

    def _status(self, wait_s: float) -> Op[dict[str, Any]]:
        return self._read(Call("GET", self._path, params={"wait": wait_s}))

    def _result(self, timeout: float | None) -> Op[InferResult]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = LONG_POLL_S if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"job {self.id} did not end within {timeout} s")
            call = Call("GET", self._path, params={"wait": min(left, LONG_POLL_S)})
            doc, blobs = read_response((yield from retried(call, self.client.retries)))
            self.last = doc
            if doc["status"] == "succeeded":
                return read_result(doc["result"], blobs)
            if doc["status"] in FINAL_JOB:
                raise InferqError(500, f"job {self.id} {doc['status']}: {doc.get('error', '')}")

    def _cancel(self) -> Op[dict[str, Any]]:
        return self._read(Call("DELETE", self._path))


class _BatchOps(_Handle):
    _PREFIX = "/v2/batches"

    def _status(self) -> Op[dict[str, Any]]:
        return self._read(Call("GET", self._path))

    def _wait(
        self,
        timeout: float | None,
        progress: Callable[[dict[str, Any]], None] | None,
        poll_s: float,
    ) -> Op[dict[str, Any]]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            doc = yield from self._status()
            if progress is not None:
                progress(doc)
            if doc["status"] in FINAL_BATCH:
                return doc
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"batch {self.id} did not end within {timeout} s")
            yield Sleep(poll_s)

    def _lines(self, part: str) -> Stream:
        return Stream(Call("GET", f"{self._path}/{part}"), _json_line)

    def _cancel(self) -> Op[dict[str, Any]]:
        return self._read(Call("POST", f"{self._path}/cancel"))

    def _delete(self) -> Op[dict[str, Any]]:
        return document(Call("DELETE", self._path), self.client.retries)


def _model_path(model: str, version: str | None) -> str:
    return f"/v2/models/{model}" + (f"/versions/{version}" if version else "")

"""A Python client of the inferq gateway, sync (``Client``) and asyncio (``AsyncClient``), on
httpx.

- ``infer(model, inputs)``: submit and wait; numpy arrays in and out, as JSON or as binary
  tensors (``binary=True``: the binary tensor extension both ways).
- ``submit(model, inputs)`` -> ``Job``: ``status()``, ``result(timeout)``, ``cancel()``,
  ``events()`` (the server-sent events of ``GET /v2/jobs/{id}/events``).
- ``batch(lines)`` -> ``Batch``: ``status()``, ``wait(progress=...)``, ``output()``,
  ``errors()``, ``cancel()``, ``events()``.

Refusals the gateway asks to retry (429 and 503 with ``Retry-After``) are retried after the
time it names, ``retries`` times. A job submission carries an ``Idempotency-Key`` (one per call,
or the caller's), so retrying it after a lost answer can never queue it twice. Errors raise
``InferqError`` with the gateway's message and status.

The two clients share everything but the I/O: requests are built and answers read by the
functions of this module, each once.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

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


# -- building requests and reading answers (shared by both clients) ---------------------------


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


# -- the sync client ------------------------------------------------------------------------


class Client:
    """The gateway at ``url``, over one pooled httpx client; use as a context manager."""

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        *,
        timeout: float = 60.0,
        retries: int = DEFAULT_RETRIES,
        http: httpx.Client | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.http = http or httpx.Client(base_url=url, timeout=timeout)
        self.retries = retries
        self._sleep = sleep

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One call, retried after ``Retry-After`` while the gateway asks to retry."""
        for _ in range(self.retries):
            response = self.http.request(method, path, **kwargs)
            wait = retry_after_s(response)
            if wait is None:
                return response
            self._sleep(wait)
        return self.http.request(method, path, **kwargs)

    def _json(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        doc, _ = read_response(self.request(method, path, **kwargs))
        return doc

    def infer(
        self,
        model: str,
        inputs: Inputs,
        *,
        version: str | None = None,
        binary: bool = False,
        outputs: Iterable[str] | None = None,
        parameters: Mapping[str, Any] | None = None,
    ) -> InferResult:
        body, headers = infer_body(inputs, binary=binary, outputs=outputs, parameters=parameters)
        path = _model_path(model, version) + "/infer"
        response = self.request("POST", path, content=body, headers=headers)
        return read_result(*read_response(response))

    def submit(
        self,
        model: str,
        inputs: Inputs,
        *,
        version: str | None = None,
        binary: bool = False,
        parameters: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
        webhook: str | None = None,
        webhook_events: Iterable[str] | None = None,
    ) -> Job:
        body, headers = infer_body(inputs, binary=binary, parameters=parameters)
        headers["idempotency-key"] = idempotency_key or uuid.uuid4().hex
        headers.update(_headers(webhook, webhook_events))
        path = _model_path(model, version) + "/jobs"
        doc, _ = read_response(self._send_idempotent("POST", path, body, headers))
        return Job(self, doc["id"], doc)

    def _send_idempotent(
        self, method: str, path: str, body: bytes, headers: dict[str, str]
    ) -> httpx.Response:
        """A call that carries an Idempotency-Key: also retried after a lost connection."""
        for _ in range(self.retries):
            try:
                return self.request(method, path, content=body, headers=headers)
            except httpx.TransportError:
                self._sleep(0.5)
        return self.request(method, path, content=body, headers=headers)

    def job(self, job_id: str) -> Job:
        return Job(self, job_id, {})

    def batch(
        self,
        lines: Iterable[Mapping[str, Any] | bytes | str],
        *,
        model: str | None = None,
        completion_window: str | None = None,
        metadata: Mapping[str, str] | None = None,
        webhook: str | None = None,
        webhook_events: Iterable[str] | None = None,
    ) -> Batch:
        """Create a batch of ``lines`` (OpenAI-style lines, or bare V2 requests for ``model``)."""
        headers = {"content-type": "application/jsonl", **_headers(webhook, webhook_events)}
        doc = self._json(
            "POST",
            "/v2/batches",
            content=batch_body(lines),
            params=batch_params(model, completion_window, metadata),
            headers=headers,
        )
        return Batch(self, doc["id"], doc)

    def get_batch(self, batch_id: str) -> Batch:
        return Batch(self, batch_id, self._json("GET", f"/v2/batches/{batch_id}"))

    def events(self, path: str, last_event_id: str | None = None) -> Iterator[dict[str, Any]]:
        headers = {"last-event-id": last_event_id} if last_event_id else {}
        with self.http.stream("GET", path, headers=headers, timeout=None) as response:
            if response.status_code == 204:
                return
            if response.status_code >= 400:
                response.read()
                read_response(response)
            parser = EventParser()
            for line in response.iter_lines():
                event = parser.feed(line)
                if event is not None:
                    yield event


class Job:
    """One async job."""

    def __init__(self, client: Client, job_id: str, doc: dict[str, Any]) -> None:
        self.client, self.id, self.last = client, job_id, doc

    def status(self, wait_s: float = 0.0) -> dict[str, Any]:
        self.last = self.client._json("GET", f"/v2/jobs/{self.id}", params={"wait": wait_s})
        return self.last

    def result(self, timeout: float | None = None) -> InferResult:
        """The result once it succeeded; InferqError if it failed, expired or was cancelled;
        TimeoutError if it has not ended within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 30.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"job {self.id} did not end within {timeout} s")
            response = self.client.request(
                "GET", f"/v2/jobs/{self.id}", params={"wait": min(left, 30.0)}
            )
            doc, blobs = read_response(response)
            self.last = doc
            if doc["status"] == "succeeded":
                return read_result(doc["result"], blobs)
            if doc["status"] in FINAL_JOB:
                raise InferqError(500, f"job {self.id} {doc['status']}: {doc.get('error', '')}")

    def cancel(self) -> dict[str, Any]:
        self.last = self.client._json("DELETE", f"/v2/jobs/{self.id}")
        return self.last

    def events(self, last_event_id: str | None = None) -> Iterator[dict[str, Any]]:
        return self.client.events(f"/v2/jobs/{self.id}/events", last_event_id)


class Batch:
    """One batch."""

    def __init__(self, client: Client, batch_id: str, doc: dict[str, Any]) -> None:
        self.client, self.id, self.last = client, batch_id, doc

    def status(self) -> dict[str, Any]:
        self.last = self.client._json("GET", f"/v2/batches/{self.id}")
        return self.last

    def wait(
        self,
        timeout: float | None = None,
        *,
        progress: Callable[[dict[str, Any]], None] | None = None,
        poll_s: float = 0.5,
    ) -> dict[str, Any]:
        """Until the batch is final, calling ``progress`` with each state read."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            doc = self.status()
            if progress is not None:
                progress(doc)
            if doc["status"] in FINAL_BATCH:
                return doc
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"batch {self.id} did not end within {timeout} s")
            self.client._sleep(poll_s)

    def output(self) -> Iterator[dict[str, Any]]:
        return self._lines("output")

    def errors(self) -> Iterator[dict[str, Any]]:
        return self._lines("errors")

    def _lines(self, part: str) -> Iterator[dict[str, Any]]:
        with self.client.http.stream("GET", f"/v2/batches/{self.id}/{part}") as response:
            if response.status_code >= 400:
                response.read()
                read_response(response)
            for line in response.iter_lines():
                if line.strip():
                    yield json.loads(line)

    def cancel(self) -> dict[str, Any]:
        self.last = self.client._json("POST", f"/v2/batches/{self.id}/cancel")
        return self.last

    def delete(self) -> dict[str, Any]:
        return self.client._json("DELETE", f"/v2/batches/{self.id}")

    def events(self, last_event_id: str | None = None) -> Iterator[dict[str, Any]]:
        return self.client.events(f"/v2/batches/{self.id}/events", last_event_id)


# -- the asyncio client ---------------------------------------------------------------------


class AsyncClient:
    """``Client`` for asyncio: the same calls, awaited."""

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        *,
        timeout: float = 60.0,
        retries: int = DEFAULT_RETRIES,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.http = http or httpx.AsyncClient(base_url=url, timeout=timeout)
        self.retries = retries

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        for _ in range(self.retries):
            response = await self.http.request(method, path, **kwargs)
            wait = retry_after_s(response)
            if wait is None:
                return response
            await asyncio.sleep(wait)
        return await self.http.request(method, path, **kwargs)

    async def _json(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        doc, _ = read_response(await self.request(method, path, **kwargs))
        return doc

    async def infer(
        self,
        model: str,
        inputs: Inputs,
        *,
        version: str | None = None,
        binary: bool = False,
        outputs: Iterable[str] | None = None,
        parameters: Mapping[str, Any] | None = None,
    ) -> InferResult:
        body, headers = infer_body(inputs, binary=binary, outputs=outputs, parameters=parameters)
        path = _model_path(model, version) + "/infer"
        response = await self.request("POST", path, content=body, headers=headers)
        return read_result(*read_response(response))

    async def submit(
        self,
        model: str,
        inputs: Inputs,
        *,
        version: str | None = None,
        binary: bool = False,
        parameters: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
        webhook: str | None = None,
        webhook_events: Iterable[str] | None = None,
    ) -> AsyncJob:
        body, headers = infer_body(inputs, binary=binary, parameters=parameters)
        headers["idempotency-key"] = idempotency_key or uuid.uuid4().hex
        headers.update(_headers(webhook, webhook_events))
        path = _model_path(model, version) + "/jobs"
        for _ in range(self.retries):
            try:
                response = await self.request("POST", path, content=body, headers=headers)
                break
            except httpx.TransportError:
                await asyncio.sleep(0.5)
        else:
            response = await self.request("POST", path, content=body, headers=headers)
        doc, _ = read_response(response)
        return AsyncJob(self, doc["id"], doc)

    async def batch(
        self,
        lines: Iterable[Mapping[str, Any] | bytes | str],
        *,
        model: str | None = None,
        completion_window: str | None = None,
        metadata: Mapping[str, str] | None = None,
        webhook: str | None = None,
        webhook_events: Iterable[str] | None = None,
    ) -> AsyncBatch:
        headers = {"content-type": "application/jsonl", **_headers(webhook, webhook_events)}
        doc = await self._json(
            "POST",
            "/v2/batches",
            content=batch_body(lines),
            params=batch_params(model, completion_window, metadata),
            headers=headers,
        )
        return AsyncBatch(self, doc["id"], doc)

    async def events(
        self, path: str, last_event_id: str | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        headers = {"last-event-id": last_event_id} if last_event_id else {}
        async with self.http.stream("GET", path, headers=headers, timeout=None) as response:
            if response.status_code == 204:
                return
            if response.status_code >= 400:
                await response.aread()
                read_response(response)
            parser = EventParser()
            async for line in response.aiter_lines():
                event = parser.feed(line)
                if event is not None:
                    yield event


class AsyncJob:
    def __init__(self, client: AsyncClient, job_id: str, doc: dict[str, Any]) -> None:
        self.client, self.id, self.last = client, job_id, doc

    async def status(self, wait_s: float = 0.0) -> dict[str, Any]:
        self.last = await self.client._json("GET", f"/v2/jobs/{self.id}", params={"wait": wait_s})
        return self.last

    async def result(self, timeout: float | None = None) -> InferResult:  # noqa: ASYNC109
        # ``timeout`` as in the sync handle: the same call, awaited (issue 24's contract).
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 30.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"job {self.id} did not end within {timeout} s")
            response = await self.client.request(
                "GET", f"/v2/jobs/{self.id}", params={"wait": min(left, 30.0)}
            )
            doc, blobs = read_response(response)
            self.last = doc
            if doc["status"] == "succeeded":
                return read_result(doc["result"], blobs)
            if doc["status"] in FINAL_JOB:
                raise InferqError(500, f"job {self.id} {doc['status']}: {doc.get('error', '')}")

    async def cancel(self) -> dict[str, Any]:
        self.last = await self.client._json("DELETE", f"/v2/jobs/{self.id}")
        return self.last

    def events(self, last_event_id: str | None = None) -> AsyncIterator[dict[str, Any]]:
        return self.client.events(f"/v2/jobs/{self.id}/events", last_event_id)


class AsyncBatch:
    def __init__(self, client: AsyncClient, batch_id: str, doc: dict[str, Any]) -> None:
        self.client, self.id, self.last = client, batch_id, doc

    async def status(self) -> dict[str, Any]:
        self.last = await self.client._json("GET", f"/v2/batches/{self.id}")
        return self.last

    async def wait(
        self,
        timeout: float | None = None,  # noqa: ASYNC109 - as the sync handle's
        *,
        progress: Callable[[dict[str, Any]], None] | None = None,
        poll_s: float = 0.5,
    ) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            while True:
                doc = await self.status()
                if progress is not None:
                    progress(doc)
                if doc["status"] in FINAL_BATCH:
                    return doc
                await asyncio.sleep(poll_s)

    async def output(self) -> AsyncIterator[dict[str, Any]]:
        async for doc in self._lines("output"):
            yield doc

    async def errors(self) -> AsyncIterator[dict[str, Any]]:
        async for doc in self._lines("errors"):
            yield doc

    async def _lines(self, part: str) -> AsyncIterator[dict[str, Any]]:
        async with self.client.http.stream("GET", f"/v2/batches/{self.id}/{part}") as response:
            if response.status_code >= 400:
                await response.aread()
                read_response(response)
            async for line in response.aiter_lines():
                if line.strip():
                    yield json.loads(line)

    async def cancel(self) -> dict[str, Any]:
        self.last = await self.client._json("POST", f"/v2/batches/{self.id}/cancel")
        return self.last

    def events(self, last_event_id: str | None = None) -> AsyncIterator[dict[str, Any]]:
        return self.client.events(f"/v2/batches/{self.id}/events", last_event_id)


def _model_path(model: str, version: str | None) -> str:
    return f"/v2/models/{model}" + (f"/versions/{version}" if version else "")

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

Each operation is written once, without I/O, in ``inferq.clientcore``; the classes here only
send its calls and sleep its pauses (``_run``) and read streamed lines (``_stream``), the sync
ones with ``httpx.Client``, the async ones with ``httpx.AsyncClient``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from typing import Any

import httpx

from inferq.clientcore import (
    DEFAULT_RETRIES,
    FINAL_BATCH,
    FINAL_JOB,
    MAX_RETRY_AFTER_S,
    RETRIED,
    Call,
    EventParser,
    InferqError,
    InferResult,
    Inputs,
    Op,
    Sleep,
    Stream,
    T,
    _BatchOps,
    _JobOps,
    batch_body,
    batch_op,
    batch_params,
    datatype_of,
    event_stream,
    infer_body,
    infer_op,
    read_response,
    read_result,
    retried,
    retry_after_s,
    submit_op,
)

__all__ = [
    "DEFAULT_RETRIES",
    "FINAL_BATCH",
    "FINAL_JOB",
    "MAX_RETRY_AFTER_S",
    "RETRIED",
    "AsyncBatch",
    "AsyncClient",
    "AsyncJob",
    "Batch",
    "Call",
    "Client",
    "EventParser",
    "InferResult",
    "InferqError",
    "Inputs",
    "Job",
    "Sleep",
    "Stream",
    "batch_body",
    "batch_params",
    "datatype_of",
    "infer_body",
    "read_response",
    "read_result",
    "retried",
    "retry_after_s",
]


# -- the sync client: sends and sleeps -------------------------------------------------------


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

    def _run(self, op: Op[T]) -> T:
        """Drive ``op``: send its calls, sleep its pauses, hand it each answer or lost
        connection."""
        reply: httpx.Response | None = None
        lost: httpx.TransportError | None = None
        while True:
            try:
                step = op.send(reply) if lost is None else op.throw(lost)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            reply, lost = None, None
            if isinstance(step, Sleep):
                self._sleep(step.seconds)
                continue
            try:
                reply = self.http.request(step.method, step.path, **step.options())
            except httpx.TransportError as e:
                lost = e

    def _stream(self, stream: Stream) -> Iterator[dict[str, Any]]:
        call = stream.call
        with self.http.stream(call.method, call.path, **call.options()) as response:
            if response.status_code >= 400:
                response.read()
            if not stream.opened(response):
                return
            for line in response.iter_lines():
                item = stream.parse(line)
                if item is not None:
                    yield item

    def request(self, method: str, path: str, **call: Any) -> httpx.Response:
        """One call (``params``, ``headers``, ``content``, ``timeout``), retried after
        ``Retry-After`` while the gateway asks to retry."""
        return self._run(retried(Call(method, path, **call), self.retries))

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
        return self._run(
            infer_op(self.retries, model, inputs, version, binary, outputs, parameters)
        )

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
        doc = self._run(
            submit_op(
                self.retries,
                model,
                inputs,
                version,
                binary,
                parameters,
                idempotency_key,
                webhook,
                webhook_events,
            )
        )
        return Job(self, doc["id"], doc)

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
        doc = self._run(
            batch_op(
                self.retries, lines, model, completion_window, metadata, webhook, webhook_events
            )
        )
        return Batch(self, doc["id"], doc)

    def get_batch(self, batch_id: str) -> Batch:
        batch = Batch(self, batch_id, {})
        batch.status()
        return batch

    def events(self, path: str, last_event_id: str | None = None) -> Iterator[dict[str, Any]]:
        return self._stream(event_stream(path, last_event_id))


class Job(_JobOps):
    """One async job."""

    client: Client

    def status(self, wait_s: float = 0.0) -> dict[str, Any]:
        return self.client._run(self._status(wait_s))

    def result(self, timeout: float | None = None) -> InferResult:
        """The result once it succeeded; InferqError if it failed, expired or was cancelled;
        TimeoutError if it has not ended within ``timeout`` seconds."""
        return self.client._run(self._result(timeout))

    def cancel(self) -> dict[str, Any]:
        return self.client._run(self._cancel())

    def events(self, last_event_id: str | None = None) -> Iterator[dict[str, Any]]:
        return self.client._stream(self._events(last_event_id))


class Batch(_BatchOps):
    """One batch."""

    client: Client

    def status(self) -> dict[str, Any]:
        return self.client._run(self._status())

    def wait(
        self,
        timeout: float | None = None,
        *,
        progress: Callable[[dict[str, Any]], None] | None = None,
        poll_s: float = 0.5,
    ) -> dict[str, Any]:
        """Until the batch is final, calling ``progress`` with each state read; TimeoutError
        if it is not final after ``timeout`` seconds."""
        return self.client._run(self._wait(timeout, progress, poll_s))

    def output(self) -> Iterator[dict[str, Any]]:
        return self.client._stream(self._lines("output"))

    def errors(self) -> Iterator[dict[str, Any]]:
        return self.client._stream(self._lines("errors"))

    def cancel(self) -> dict[str, Any]:
        return self.client._run(self._cancel())

    def delete(self) -> dict[str, Any]:
        return self.client._run(self._delete())

    def events(self, last_event_id: str | None = None) -> Iterator[dict[str, Any]]:
        return self.client._stream(self._events(last_event_id))


# -- the asyncio client: sends and sleeps, awaited -------------------------------------------


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

    async def _run(self, op: Op[T]) -> T:
        """``Client._run``, awaited."""
        reply: httpx.Response | None = None
        lost: httpx.TransportError | None = None
        while True:
            try:
                step = op.send(reply) if lost is None else op.throw(lost)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            reply, lost = None, None
            if isinstance(step, Sleep):
                await asyncio.sleep(step.seconds)
                continue
            try:
                reply = await self.http.request(step.method, step.path, **step.options())
            except httpx.TransportError as e:
                lost = e

    async def _stream(self, stream: Stream) -> AsyncIterator[dict[str, Any]]:
        call = stream.call
        async with self.http.stream(call.method, call.path, **call.options()) as response:
            if response.status_code >= 400:
                await response.aread()
            if not stream.opened(response):
                return
            async for line in response.aiter_lines():
                item = stream.parse(line)
                if item is not None:
                    yield item

    async def request(self, method: str, path: str, **call: Any) -> httpx.Response:
        return await self._run(retried(Call(method, path, **call), self.retries))

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
        return await self._run(
            infer_op(self.retries, model, inputs, version, binary, outputs, parameters)
        )

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
        doc = await self._run(
            submit_op(
                self.retries,
                model,
                inputs,
                version,
                binary,
                parameters,
                idempotency_key,
                webhook,
                webhook_events,
            )
        )
        return AsyncJob(self, doc["id"], doc)

    def job(self, job_id: str) -> AsyncJob:
        return AsyncJob(self, job_id, {})

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
        doc = await self._run(
            batch_op(
                self.retries, lines, model, completion_window, metadata, webhook, webhook_events
            )
        )
        return AsyncBatch(self, doc["id"], doc)

    async def get_batch(self, batch_id: str) -> AsyncBatch:
        batch = AsyncBatch(self, batch_id, {})
        await batch.status()
        return batch

    def events(self, path: str, last_event_id: str | None = None) -> AsyncIterator[dict[str, Any]]:
        return self._stream(event_stream(path, last_event_id))


class AsyncJob(_JobOps):
    """``Job`` for asyncio."""

    client: AsyncClient

    async def status(self, wait_s: float = 0.0) -> dict[str, Any]:
        return await self.client._run(self._status(wait_s))

    async def result(self, timeout: float | None = None) -> InferResult:  # noqa: ASYNC109
        # ``timeout`` as in the sync handle: the same call, awaited (issue 24's contract).
        return await self.client._run(self._result(timeout))

    async def cancel(self) -> dict[str, Any]:
        return await self.client._run(self._cancel())

    def events(self, last_event_id: str | None = None) -> AsyncIterator[dict[str, Any]]:
        return self.client._stream(self._events(last_event_id))


class AsyncBatch(_BatchOps):
    """``Batch`` for asyncio."""

    client: AsyncClient

    async def status(self) -> dict[str, Any]:
        return await self.client._run(self._status())

    async def wait(
        self,
        timeout: float | None = None,  # noqa: ASYNC109 - as the sync handle's
        *,
        progress: Callable[[dict[str, Any]], None] | None = None,
        poll_s: float = 0.5,
    ) -> dict[str, Any]:
        return await self.client._run(self._wait(timeout, progress, poll_s))

    def output(self) -> AsyncIterator[dict[str, Any]]:
        return self.client._stream(self._lines("output"))

    def errors(self) -> AsyncIterator[dict[str, Any]]:
        return self.client._stream(self._lines("errors"))

    async def cancel(self) -> dict[str, Any]:
        return await self.client._run(self._cancel())

    async def delete(self) -> dict[str, Any]:
        return await self.client._run(self._delete())

    def events(self, last_event_id: str | None = None) -> AsyncIterator[dict[str, Any]]:
        return self.client._stream(self._events(last_event_id))

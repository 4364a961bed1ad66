"""The inference route, served without Starlette's routing, Request and middleware layers.

``POST /v2/models/{model}[/versions/{version}]/infer`` is nearly all of a gateway's traffic.
Profiled at concurrency 64 (BENCHMARKS.md, issue #14), Starlette's routing, its Request object,
its exception wrappers and the metrics middleware's wrapped ``send`` took about a quarter of the
gateway's CPU. ``GatewayApp`` (``producer.app``) hands this one route to ``InferFastPath``
straight from the server's ASGI call, and the fast path does what those layers did for it,
once and in the same order: the request metrics and, when tracing is on, the request's server
span (``producer.instrument``), and the V2 error bodies of ``producer.app``'s exception handlers.

Every other request, and an infer request whose path the fast path does not recognise (under a
root path, say), goes through Starlette to ``endpoint``: the same ``respond`` behind the
ordinary middleware and exception handlers, so both ways answer alike.
"""

from __future__ import annotations

import functools
import json
import re
import time
from typing import TYPE_CHECKING, Any

import structlog
from starlette.datastructures import Headers
from starlette.types import Receive, Scope, Send

from producer.errors import INTERNAL_MESSAGE, ClientClosedRequest, GatewayError
from producer.httpbody import caller_traceparent, header_length, no_cache, read_body
from producer.instrument import observe, open_trace
from producer.routing import ROUTED_VERSION
from producer.v2 import encode_infer_response
from runtime.tracing import REQUEST_TRACE, Tracer

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from producer.gateway import Gateway

log = structlog.get_logger("inferq.gateway")

INFER_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")
"""The two infer paths of ``producer.app.routes``, as Starlette matches them."""

_JSON = b"application/json"
_BINARY = b"application/octet-stream"


async def _chunks(receive: Receive) -> AsyncIterator[bytes]:
    """The request body as it arrives (what Starlette's ``Request.stream`` does)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientClosedRequest("the client went away while sending its request")
        yield message.get("body", b"")
        if not message.get("more_body", False):
            return


async def _disconnect(receive: Receive) -> None:
    """Returns once the client has hung up. Only once the body is read: uvicorn's ``receive``
    then blocks until the connection is lost (or the response is complete)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def respond(
    gateway: Gateway, scope: Scope, receive: Receive, send: Send, model: str, version: str | None
) -> None:
    """Answer one infer request with its outputs (JSON, or binary tensors when asked for).
    Refusals raise ``GatewayError``; the caller turns them into V2 error bodies."""
    headers = Headers(scope=scope)
    service = gateway.service
    settings = gateway.settings
    with service.hold_body() as hold:
        length = header_length(headers)  # before reading: a bad Content-Type is 415 at once
        raw = await read_body(
            headers,
            _chunks(receive),
            settings.max_body_bytes,
            hold=hold,
            timeout_s=settings.body_timeout_s,
        )
        trace_context = caller_traceparent(headers)
        outcome = await service.infer(
            model,
            version,
            raw,
            length,
            no_cache=no_cache(headers),
            traceparent=trace_context,
            disconnected=functools.partial(_disconnect, receive),
        )
        result = outcome.result
        with REQUEST_TRACE.get().span("encode response"):
            body, json_length = encode_infer_response(
                client_id=outcome.body.client_id,
                model_name=result.model,
                model_version=result.version,
                outputs=result.outputs,
                binary_outputs=outcome.body.binary_outputs,
                binary_all=outcome.body.binary_all,
            )
    response_headers = [
        (b"content-length", str(len(body)).encode()),
        (b"content-type", _JSON if json_length is None else _BINARY),
        (b"traceparent", trace_context.encode()),
        (b"x-inferq-cache", b"hit" if outcome.cached else b"miss"),
    ]
    if json_length is not None:
        response_headers.append((b"inference-header-content-length", str(json_length).encode()))
    await send({"type": "http.response.start", "status": 200, "headers": response_headers})
    await send({"type": "http.response.body", "body": body})


async def send_error(
    send: Send, status: int, message: str, headers: dict[str, str] | None = None
) -> None:
    """A V2 error body, byte for byte what Starlette's ``JSONResponse`` sends."""
    body = json.dumps(
        {"error": message}, ensure_ascii=False, allow_nan=False, separators=(",", ":")
    ).encode()
    raw = [(b"content-length", str(len(body)).encode()), (b"content-type", _JSON)]
    raw += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class InferFastPath:
    """The infer route with its metrics, trace and error handling (see the module docstring)."""

    def __init__(self, gateway: Gateway, tracer: Tracer | None) -> None:
        self.gateway = gateway
        self.tracer = tracer
        """Set only when tracing is on."""

    def match(self, scope: Scope) -> tuple[str, str | None] | None:
        """(model, version) when ``scope`` is an infer request this path serves."""
        if scope["type"] != "http" or scope["method"] != "POST" or scope.get("root_path"):
            return None
        found = INFER_PATH.fullmatch(scope["path"])
        return None if found is None else (found[1], found[2])

    async def serve(
        self, scope: Scope, receive: Receive, send: Send, model: str, version: str | None
    ) -> None:
        started = time.perf_counter()
        trace = None
        if self.tracer is not None:
            trace = open_trace(self.tracer, scope, "infer", model, version)
            traced = REQUEST_TRACE.set(trace)
        routed = ROUTED_VERSION.set(None)
        status = 500
        try:
            status = await self._answer(scope, receive, send, model, version)
        finally:
            if trace is not None:
                REQUEST_TRACE.reset(traced)
                trace.end(status)
            observe(
                self.gateway,
                scope,
                ("infer", model, version),
                status,
                time.perf_counter() - started,
                routed=ROUTED_VERSION.get(),
                exemplars=trace is not None,
            )
            ROUTED_VERSION.reset(routed)

    async def _answer(
        self, scope: Scope, receive: Receive, send: Send, model: str, version: str | None
    ) -> int:
        try:
            await respond(self.gateway, scope, receive, send, model, version)
        except GatewayError as e:
            await send_error(send, e.status, e.message, e.headers())
            return e.status
        except Exception:
            log.exception("unhandled error", path=scope["path"])
            await send_error(send, 500, INTERNAL_MESSAGE)
            return 500
        return 200


class _Endpoint:
    """The infer route as Starlette serves it (where the fast path does not): ``respond``
    behind the ordinary middleware and exception handlers. An ASGI app, not a function, so
    that Starlette's route calls it with the raw scope."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        params: dict[str, Any] = scope["path_params"]
        gateway: Gateway = scope["app"].state.gateway
        await respond(gateway, scope, receive, send, params["model"], params.get("version"))


endpoint = _Endpoint()

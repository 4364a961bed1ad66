"""The Starlette application: V2 routes that parse HTTP, delegate, and format the answer.

This is the one route table (OpenAPI and the request metrics derive from it), with each route's
thin handler beside its declaration; that keeps every path written once, at the cost of a module
just over 500 lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive

import runtime
from producer import openapi as api
from producer.errors import (
    INTERNAL_MESSAGE,
    BadRequest,
    GatewayError,
    PayloadTooLarge,
    RequestTimeout,
    Unauthorized,
    UnsupportedMediaType,
)
from producer.gateway import Gateway
from producer.inflight import BodyHold
from producer.instrument import RequestMetrics, RequestTracing
from producer.jobs import render as render_job
from producer.metrics import metrics_response
from producer.openapi import ApiRoute
from producer.openapi import document as openapi_document
from producer.settings import GatewaySettings
from producer.traceparent import traceparent
from producer.v2 import encode_infer_response
from protocol.jobs import JobRecord
from runtime.tracing import REQUEST_TRACE, Tracer

log = structlog.get_logger("inferq.gateway")

EXTENSIONS = ["binary_tensor_data", "schedule_policy", "async_jobs"]
JSON_TYPES = ("application/json",)
BINARY_TYPES = ("application/octet-stream",)


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


def _traceparent(request: Request) -> str:
    """The caller's W3C trace context, or a new one, so logs on every hop join up. Traced,
    it is the request's server span (a child of the caller's)."""
    traced = REQUEST_TRACE.get().traceparent
    if traced is not None:
        return traced
    return traceparent(request.headers.get("traceparent"))


def _digits(raw: str | None) -> int | None:
    """A header's non-negative integer value; None unless it is plain ASCII digits. Over 18
    digits (more than any body) reads as the largest int64, never as a 4,300-digit int()."""
    if raw is None:
        return None
    raw = raw.strip()
    if not (raw.isascii() and raw.isdigit()):
        return None
    return int(raw) if len(raw) <= 18 else 2**63 - 1


async def _read_body(
    request: Request,
    limit: int,
    *,
    hold: BodyHold | None = None,
    timeout_s: float | None = None,
) -> bytes:
    """The whole body, decompressed: 413 past ``limit``; with a ``hold``, its bytes are held
    against the gateway's in-flight cap as they arrive (429 before reading the rest); 408 when
    it has not arrived within ``timeout_s``."""
    declared = _digits(request.headers.get("content-length"))
    if declared is not None and declared > limit:
        raise PayloadTooLarge(
            f"request body of {declared} bytes exceeds the limit of {limit} bytes"
        )
    if hold is not None and declared is not None:
        hold.grow_to(declared)
    chunks = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
                if hold is not None:
                    hold.grow_to(size)
                chunks.append(chunk)
    except TimeoutError:
        raise RequestTimeout(
            f"the request body did not arrive within {timeout_s:g} s (received {size} bytes)"
        ) from None
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise UnsupportedMediaType(
            f"Content-Encoding '{encoding}' is not supported (use gzip, deflate or none)"
        )
    wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
    inflater = zlib.decompressobj(wbits)
    try:
        plain = inflater.decompress(body, limit + 1)
    except zlib.error as e:
        raise BadRequest(f"request body is not valid {encoding} data: {e}") from None
    if len(plain) > limit or inflater.unconsumed_tail:
        raise PayloadTooLarge(f"decompressed request body exceeds the limit of {limit} bytes")
    if hold is not None:
        hold.grow_to(len(plain))
    return plain


def _header_length(request: Request) -> int | None:
    raw = request.headers.get("inference-header-content-length")
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if raw is None:
        if content_type in BINARY_TYPES:
            raise BadRequest(
                "binary request bodies need an Inference-Header-Content-Length header "
                "giving the length of the JSON part"
            )
        if content_type and content_type not in JSON_TYPES:
            raise UnsupportedMediaType(
                f"Content-Type '{content_type}' is not supported: send JSON with "
                "'Content-Type: application/json', or the binary tensor extension with "
                "'Content-Type: application/octet-stream' and Inference-Header-Content-Length"
            )
        return None
    if content_type and content_type not in (*BINARY_TYPES, *JSON_TYPES):
        raise UnsupportedMediaType(
            f"Content-Type '{content_type}' is not supported with the binary tensor extension; "
            "use application/octet-stream"
        )
    length = _digits(raw)
    if length is None:
        raise BadRequest("Inference-Header-Content-Length must be a non-negative integer")
    return length


def _no_cache(request: Request) -> bool:
    directives = request.headers.get("cache-control", "").lower()
    return "no-cache" in directives or "no-store" in directives


async def live(request: Request) -> Response:
    return JSONResponse({"live": True})


async def ready(request: Request) -> Response:
    ok, problems = await _gateway(request).ready()
    if ok:
        return JSONResponse({"ready": True})
    return JSONResponse({"ready": False, "problems": problems}, status_code=503)


async def server_metadata(request: Request) -> Response:
    return JSONResponse(
        {"name": "inferq", "version": runtime.__version__, "extensions": EXTENSIONS}
    )


def _spec(spec: Any) -> dict[str, Any]:
    return {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.shape)}


async def model_metadata(request: Request) -> Response:
    p = request.path_params
    entry, _ = await _gateway(request).service.model(p["model"], p.get("version"), route=False)
    meta = entry.metadata
    return JSONResponse(
        {
            "name": meta.name,
            "versions": list(meta.versions),
            "platform": meta.platform,
            "inputs": [_spec(s) for s in meta.inputs],
            "outputs": [_spec(s) for s in meta.outputs],
            "parameters": {
                "default_version": meta.default_version,
                "max_batch_size": meta.max_batch,
                "default_timeout_ms": meta.default_timeout_ms,
                "cache": meta.cache_enabled,
                "workers": entry.workers,
                "traffic": entry.traffic,
            },
        }
    )


async def model_ready(request: Request) -> Response:
    p = request.path_params
    entry, version = await _gateway(request).service.model(
        p["model"], p.get("version"), route=False
    )
    ok = entry.workers > 0 and not entry.unloaded
    return JSONResponse(
        {"name": entry.metadata.name, "version": version, "ready": ok},
        status_code=200 if ok else 503,
    )


@dataclass(frozen=True, slots=True)
class _InferenceCall:
    """What every inference-shaped route reads from HTTP before delegating."""

    model: str
    version: str | None
    body: bytes
    header_length: int | None
    traceparent: str


async def _inference_call(request: Request, hold: BodyHold) -> _InferenceCall:
    p = request.path_params
    header_length = _header_length(request)  # before reading: a bad Content-Type is 415 at once
    settings = _gateway(request).settings
    raw = await _read_body(
        request, settings.max_body_bytes, hold=hold, timeout_s=settings.body_timeout_s
    )
    return _InferenceCall(p["model"], p.get("version"), raw, header_length, _traceparent(request))


async def _disconnect(receive: Receive) -> None:
    """Returns once the client has hung up. Only once the body is read: uvicorn's ``receive``
    then blocks until the connection is lost (or the response is complete)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _binary_or_json(
    body: bytes, json_length: int | None, headers: dict[str, str], status_code: int = 200
) -> Response:
    """A V2 body: plain JSON, or JSON plus binary tensors (the binary tensor extension)."""
    if json_length is None:
        return Response(body, status_code, headers, media_type="application/json")
    headers["inference-header-content-length"] = str(json_length)
    return Response(body, status_code, headers, media_type="application/octet-stream")


async def infer(request: Request) -> Response:
    service = _gateway(request).service
    with service.hold_body() as hold:
        call = await _inference_call(request, hold)
        outcome = await service.infer(
            call.model,
            call.version,
            call.body,
            call.header_length,
            no_cache=_no_cache(request),
            traceparent=call.traceparent,
            disconnected=functools.partial(_disconnect, request.receive),
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
    headers = {
        "traceparent": call.traceparent,
        "x-inferq-cache": "hit" if outcome.cached else "miss",
    }
    return _binary_or_json(body, json_length, headers)


def _job_response(
    record: JobRecord, status_code: int = 200, headers: dict[str, str] | None = None
) -> Response:
    body, json_length = render_job(record)
    return _binary_or_json(body, json_length, dict(headers or {}), status_code)


async def submit_job(request: Request) -> Response:
    gateway = _gateway(request)
    with gateway.service.hold_body() as hold:
        call = await _inference_call(request, hold)
        submitted = await gateway.jobs.submit(
            call.model,
            call.version,
            call.body,
            call.header_length,
            idempotency_key=request.headers.get("idempotency-key"),
            traceparent=call.traceparent,
        )
    record = submitted.record
    headers = {"location": f"/v2/jobs/{record.id}", "traceparent": call.traceparent}
    if submitted.replayed:
        headers["idempotent-replayed"] = "true"
    return _job_response(record, 202, headers)


async def get_job(request: Request) -> Response:
    raw_wait = request.query_params.get("wait", "0")
    try:
        wait_s = float(raw_wait)
    except ValueError:
        raise BadRequest(f"'wait' must be a number of seconds, got {raw_wait!r}") from None
    if not wait_s >= 0:
        raise BadRequest("'wait' must be a non-negative number of seconds")
    record = await _gateway(request).jobs.get(request.path_params["job"], wait_s)
    return _job_response(record)


async def cancel_job(request: Request) -> Response:
    record = await _gateway(request).jobs.cancel(request.path_params["job"])
    return _job_response(record)


ADMIN_BODY_LIMIT = 64 * 1024


async def _admin_body(request: Request) -> dict[str, Any]:
    """The JSON object of a model-control call (an empty body is ``{}``), after the token."""
    _gateway(request).admin.authorize(request.headers.get("authorization"))
    raw = await _read_body(
        request, ADMIN_BODY_LIMIT, timeout_s=_gateway(request).settings.body_timeout_s
    )
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


async def repository_index(request: Request) -> Response:
    body = await _admin_body(request)
    ready = body.get("ready", False)
    if not isinstance(ready, bool):
        raise BadRequest("'ready' must be true or false")
    return JSONResponse(await _gateway(request).admin.index(ready_only=ready))


async def repository_load(request: Request) -> Response:
    body = await _admin_body(request)
    model = request.path_params["model"]
    return JSONResponse(await _gateway(request).admin.load(model, body.get("parameters")))


async def repository_unload(request: Request) -> Response:
    body = await _admin_body(request)
    model = request.path_params["model"]
    return JSONResponse(await _gateway(request).admin.unload(model, body.get("parameters")))


async def metrics(request: Request) -> Response:
    return metrics_response(_gateway(request).metrics.registry, request.headers.get("accept"))


async def openapi(request: Request) -> Response:
    return JSONResponse(request.app.state.openapi)


async def gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    headers = {}
    if exc.retry_after_s is not None:
        headers["retry-after"] = str(max(1, round(exc.retry_after_s)))
    if isinstance(exc, Unauthorized):
        headers["www-authenticate"] = 'Bearer realm="inferq"'  # RFC 6750
    if isinstance(exc, RequestTimeout):
        headers["connection"] = "close"  # the rest of the body may still be on its way
    return JSONResponse({"error": exc.message}, status_code=exc.status, headers=headers)


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = {
        404: f"no such endpoint: {request.method} {request.url.path}",
        405: f"method {request.method} is not allowed on {request.url.path}",
    }
    return JSONResponse(
        {"error": message.get(exc.status_code, exc.detail)},
        status_code=exc.status_code,
        headers=exc.headers,
    )


async def internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error", path=request.url.path)
    return JSONResponse({"error": INTERNAL_MESSAGE}, status_code=500)


def routes(tracer: Tracer | None = None) -> list[Route]:
    """The HTTP surface, each path once: Starlette routes it, :mod:`producer.instrument` labels
    its metrics by the route's name, and :func:`producer.openapi.document` describes it from the
    route's :class:`~producer.openapi.Operation`."""
    model = "/v2/models/{model}"
    versioned = "/v2/models/{model}/versions/{version}"

    def traced(endpoint: str) -> list[Middleware] | None:
        """With a tracer, the inference routes open each request's trace (nothing else is
        traced: health checks, scrapes and polls would only add noise)."""
        if tracer is None:
            return None
        return [Middleware(RequestTracing, tracer=tracer, endpoint=endpoint)]

    per_model: list[Route] = []
    for base in (model, versioned):
        per_model += [
            ApiRoute(base, model_metadata, api.MODEL_METADATA, name="model_metadata"),
            ApiRoute(base + "/ready", model_ready, api.MODEL_READY, name="model_ready"),
            ApiRoute(
                base + "/infer",
                infer,
                api.INFER,
                name="infer",
                methods=["POST"],
                middleware=traced("infer"),
            ),
            ApiRoute(
                base + "/jobs",
                submit_job,
                api.SUBMIT_JOB,
                name="job_submit",
                methods=["POST"],
                middleware=traced("job_submit"),
            ),
        ]
    repository = "/v2/repository"
    return [
        ApiRoute("/v2/health/live", live, api.LIVENESS, name="health_live"),
        ApiRoute("/v2/health/ready", ready, api.READINESS, name="health_ready"),
        ApiRoute("/v2", server_metadata, api.SERVER_METADATA, name="server_metadata"),
        Route("/openapi.json", openapi, name="openapi"),
        Route("/metrics", metrics, name="metrics"),
        *per_model,
        ApiRoute("/v2/jobs/{job}", get_job, api.JOB_STATUS, name="job_status", methods=["GET"]),
        ApiRoute(
            "/v2/jobs/{job}", cancel_job, api.JOB_CANCEL, name="job_cancel", methods=["DELETE"]
        ),
        ApiRoute(
            repository + "/index",
            repository_index,
            api.REPOSITORY_INDEX,
            name="repository_index",
            methods=["POST"],
        ),
        ApiRoute(
            repository + "/models/{model}/load",
            repository_load,
            api.REPOSITORY_LOAD,
            name="repository_load",
            methods=["POST"],
        ),
        ApiRoute(
            repository + "/models/{model}/unload",
            repository_unload,
            api.REPOSITORY_UNLOAD,
            name="repository_unload",
            methods=["POST"],
        ),
    ]


def create_app(settings: GatewaySettings) -> Starlette:
    gateway = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        grpc_server = None
        try:
            if settings.grpc_port:
                from producer.grpc_server import GrpcServer  # grpc loads only when it serves

                grpc_server = GrpcServer(gateway)
                await grpc_server.start()
            yield
        finally:
            if grpc_server is not None:
                await grpc_server.stop()
            await gateway.stop()

    traced = gateway.tracer if gateway.tracer.enabled else None
    table = routes(traced)
    app = Starlette(
        routes=table,
        lifespan=lifespan,
        middleware=[
            Middleware(RequestMetrics, gateway=gateway, routes=table, exemplars=bool(traced))
        ],
        exception_handlers={
            GatewayError: gateway_error,
            HTTPException: http_error,
            Exception: internal_error,
        },
    )
    app.state.gateway = gateway
    app.state.openapi = openapi_document(table)
    return app

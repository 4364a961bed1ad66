"""The Starlette application: V2 routes that parse HTTP, delegate, and format the answer.

This is the one route table (OpenAPI and the request metrics derive from it), with each route's
thin handler beside its declaration; that keeps every path written once, at the cost of a module
just over 500 lines.
"""

from __future__ import annotations

import contextlib
import json
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
from starlette.types import Receive, Scope, Send

import runtime
from producer import docs, fastpath
from producer import openapi as api
from producer.errors import (
    INTERNAL_MESSAGE,
    BadRequest,
    GatewayError,
)
from producer.gateway import Gateway
from producer.httpbody import caller_traceparent, header_length, read_body
from producer.inflight import BodyHold
from producer.instrument import RequestMetrics, RequestTracing
from producer.jobs import render as render_job
from producer.metrics import metrics_response
from producer.openapi import ApiRoute
from producer.openapi import document as openapi_document
from producer.settings import GatewaySettings
from protocol.jobs import JobRecord
from runtime.tracing import Tracer

log = structlog.get_logger("inferq.gateway")

EXTENSIONS = ["binary_tensor_data", "schedule_policy", "async_jobs"]


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


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
    length = header_length(request.headers)  # before reading: a bad Content-Type is 415 at once
    settings = _gateway(request).settings
    raw = await read_body(
        request.headers,
        request.stream(),
        settings.max_body_bytes,
        hold=hold,
        timeout_s=settings.body_timeout_s,
    )
    return _InferenceCall(
        p["model"], p.get("version"), raw, length, caller_traceparent(request.headers)
    )


def _binary_or_json(
    body: bytes, json_length: int | None, headers: dict[str, str], status_code: int = 200
) -> Response:
    """A V2 body: plain JSON, or JSON plus binary tensors (the binary tensor extension)."""
    if json_length is None:
        return Response(body, status_code, headers, media_type="application/json")
    headers["inference-header-content-length"] = str(json_length)
    return Response(body, status_code, headers, media_type="application/octet-stream")


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
    raw = await read_body(
        request.headers,
        request.stream(),
        ADMIN_BODY_LIMIT,
        timeout_s=_gateway(request).settings.body_timeout_s,
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
    return JSONResponse({"error": exc.message}, status_code=exc.status, headers=exc.headers())


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
                fastpath.endpoint,
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
        *docs.routes(),
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


class GatewayApp(Starlette):
    """Starlette, with the inference route served first by ``producer.fastpath`` (the hot
    path skips Starlette's routing and middleware; it does their work for that one route)."""

    def __init__(self, fast: fastpath.InferFastPath, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fast = fast

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        infer = self.fast.match(scope)
        if infer is not None:
            await self.fast.serve(scope, receive, send, *infer)
        else:
            await super().__call__(scope, receive, send)


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
    app = GatewayApp(
        fastpath.InferFastPath(gateway, traced),
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

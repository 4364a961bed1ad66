"""The Starlette application: the one route table, and the thin handlers of every route but
infer (``producer.fastpath`` serves that one). Handlers read HTTP, delegate to the gateway's
services, and format the answer; refusals become V2 error bodies in the exception handlers
(``producer.errors.http_form``). OpenAPI and the request metrics derive from the table.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

import runtime
from producer import console, docs, fastpath
from producer import openapi as api
from producer.console_views import ConsoleViews
from producer.errors import (
    BadRequest,
    GatewayError,
    NotFound,
    PayloadTooLarge,
    answer_for,
    error_body,
    http_form,
)
from producer.gateway import Gateway
from producer.httpbody import (
    body_chunks,
    caller_traceparent,
    header_bytes,
    read_body,
    read_inference_body,
)
from producer.instrument import Instrument, RequestMetrics, observation
from producer.jobs import render as render_job
from producer.metrics import metrics_response
from producer.openapi import ApiRoute
from producer.openapi import document as openapi_document
from producer.settings import GatewaySettings
from producer.sse import last_event_id, open_stream
from producer.v2_request import check_nesting, parse_infer_request, parse_json_object
from protocol.jobs import JobRecord

EXTENSIONS = [
    "binary_tensor_data",
    "schedule_policy",
    "async_jobs",
    "batches",
    "model_repository",
    "model_configuration",
    "statistics",
]


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
    ok = entry.ready
    return JSONResponse(
        {"name": entry.metadata.name, "version": version, "ready": ok, "state": entry.state},
        status_code=200 if ok else 503,
    )


async def model_config(request: Request) -> Response:
    p = request.path_params
    return JSONResponse(await _gateway(request).introspection.config(p["model"], p.get("version")))


async def model_stats(request: Request) -> Response:
    p = request.path_params
    stats = await _gateway(request).introspection.statistics(p.get("model"), p.get("version"))
    return JSONResponse(stats)


def _job_response(
    record: JobRecord, status_code: int = 200, headers: dict[str, str] | None = None
) -> Response:
    """A job document: plain JSON, or JSON plus binary tensors when its result has them."""
    body, json_length = render_job(record)
    headers = dict(headers or {})
    if json_length is None:
        return Response(body, status_code, headers, media_type="application/json")
    headers["inference-header-content-length"] = str(json_length)
    return Response(body, status_code, headers, media_type="application/octet-stream")


async def submit_job(request: Request) -> Response:
    gateway = _gateway(request)
    p = request.path_params
    seen = observation(request.scope)
    if seen is not None:
        seen.trace_http(request.scope, "job_submit", p["model"], p.get("version"))
    with gateway.service.hold_body(header_bytes(request.scope)) as hold:
        raw, length = await read_inference_body(
            request.headers, request.receive, hold, gateway.settings
        )
        trace_context = caller_traceparent(request.headers)
        submitted = await gateway.jobs.submit(
            p["model"],
            p.get("version"),
            functools.partial(parse_infer_request, raw, length),
            idempotency_key=request.headers.get("idempotency-key"),
            traceparent=trace_context,
            headers=request.headers,
        )
    record = submitted.record
    if seen is not None:
        seen.routed = record.version
    headers = {"location": f"/v2/jobs/{record.id}", "traceparent": trace_context}
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


def events_of(path: str, param: str) -> Callable[[Request], Awaitable[Response]]:
    """The handler of ``GET /v2/{path}/{id}/events``: the event stream of one object of the kind
    the gateway's registry serves under ``path`` (``producer.sse``)."""

    async def events(request: Request) -> Response:
        gateway = _gateway(request)
        resume_from = last_event_id(request.headers.get("last-event-id"))
        watched = gateway.watched.at(path)
        if watched is None:
            raise NotFound(f"this gateway serves no {path}")
        return await open_stream(
            watched,
            gateway.replies.events,
            gateway.redis,
            gateway.keys.job_events,
            request.path_params[param],
            resume_from,
            gateway.settings.sse_heartbeat_s,
        )

    return events


async def create_batch(request: Request) -> Response:
    """A JSONL body (options in the query), or a JSON object with the lines under
    ``requests`` (objects) or ``input`` (JSONL text) and the options beside them."""
    gateway = _gateway(request)
    batches = gateway.batches
    try:
        raw = await read_body(
            request.headers,
            body_chunks(request.receive),
            gateway.settings.max_batch_bytes,
            timeout_s=gateway.settings.body_timeout_s,
        )
    except PayloadTooLarge as e:
        raise batches.too_large(e) from None
    options: dict[str, object] = dict(request.query_params)
    lines = raw.split(b"\n")
    if request.headers.get("content-type", "").split(";")[0].strip() == "application/json":
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise BadRequest("the batch body is not valid JSON: it is nested too deeply") from None
        if not isinstance(doc, dict):
            raise BadRequest("a JSON batch body must be an object with 'requests' or 'input'")
        options = {k: v for k, v in doc.items() if k not in ("requests", "input")}
        if isinstance(doc.get("requests"), list):
            lines = [json.dumps(r).encode() for r in doc["requests"]]
        elif isinstance(doc.get("input"), str):
            lines = doc["input"].encode().split(b"\n")
        else:
            raise BadRequest("'requests' (a list of lines) or 'input' (JSONL text) is required")
    batch = await batches.create(lines, await batches.options(options, request.headers))
    return JSONResponse(batch, 202, {"location": f"/v2/batches/{batch['id']}"})


async def list_batches(request: Request) -> Response:
    raw_limit = request.query_params.get("limit", "20")
    if not raw_limit.isdigit():
        raise BadRequest(f"'limit' must be a whole number, got {raw_limit!r}")
    after = request.query_params.get("after")
    return JSONResponse(await _gateway(request).batches.list(after, int(raw_limit)))


async def get_batch(request: Request) -> Response:
    return JSONResponse(await _gateway(request).batches.document(request.path_params["batch"]))


async def cancel_batch(request: Request) -> Response:
    return JSONResponse(await _gateway(request).batches.cancel(request.path_params["batch"]))


async def delete_batch(request: Request) -> Response:
    return JSONResponse(await _gateway(request).batches.delete(request.path_params["batch"]))


def answers_of(part: str) -> Callable[[Request], Awaitable[Response]]:
    """``GET /v2/batches/{id}/output`` or ``/errors``: JSONL, in input order, as far as the
    batch has got (complete once it is final)."""

    async def answers(request: Request) -> Response:
        batches = _gateway(request).batches
        record, _ = await batches.read(request.path_params["batch"])
        return StreamingResponse(batches.answers(record, part), media_type="application/jsonl")

    return answers


job_events = events_of("jobs", "job")
batch_events = events_of("batches", "batch")


ADMIN_BODY_LIMIT = 64 * 1024


async def _admin_body(request: Request) -> dict[str, Any]:
    """The JSON object of a model-control call (an empty body is ``{}``), after the token."""
    _gateway(request).admin.authorize(request.headers.get("authorization"))
    raw = await read_body(
        request.headers,
        body_chunks(request.receive),
        ADMIN_BODY_LIMIT,
        timeout_s=_gateway(request).settings.body_timeout_s,
    )
    if not raw.strip():
        return {}
    body = parse_json_object(raw, "the request body")
    check_nesting(body, "the request body")
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


async def repository_reset(request: Request) -> Response:
    await _admin_body(request)
    return JSONResponse(await _gateway(request).admin.reset(request.path_params["model"]))


async def repository_unload(request: Request) -> Response:
    body = await _admin_body(request)
    model = request.path_params["model"]
    return JSONResponse(await _gateway(request).admin.unload(model, body.get("parameters")))


async def metrics(request: Request) -> Response:
    return metrics_response(_gateway(request).metrics.registry, request.headers.get("accept"))


async def openapi(request: Request) -> Response:
    return JSONResponse(request.app.state.openapi)


def _error_response(error: GatewayError) -> Response:
    status, body, headers = http_form(error)
    return Response(body, status, headers, media_type="application/json")


async def gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    seen = observation(request.scope)
    if seen is not None and exc.routed is not None:
        seen.routed = exc.routed
    return _error_response(exc)


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no route for the path, a method the route lacks)."""
    assert isinstance(exc, HTTPException)
    message = {
        404: f"no such endpoint: {request.method} {request.url.path}",
        405: f"method {request.method} is not allowed on {request.url.path}",
    }
    body = error_body(message.get(exc.status_code, exc.detail))
    return Response(body, exc.status_code, exc.headers, media_type="application/json")


async def internal_error(request: Request, exc: Exception) -> Response:
    return _error_response(answer_for(exc, path=request.url.path))


def routes() -> list[Route]:
    """The HTTP surface, each path once: Starlette routes it (the infer POSTs are matched by
    ``producer.fastpath`` with these same routes' patterns), :mod:`producer.instrument` labels
    its metrics by the route's name, and :func:`producer.openapi.document` describes it from
    the route's :class:`~producer.openapi.Operation`."""
    model = "/v2/models/{model}"
    versioned = "/v2/models/{model}/versions/{version}"
    per_model: list[Route] = []
    for base in (model, versioned):
        per_model += [
            ApiRoute(base, model_metadata, api.MODEL_METADATA, name="model_metadata"),
            ApiRoute(base + "/ready", model_ready, api.MODEL_READY, name="model_ready"),
            ApiRoute(base + "/config", model_config, api.MODEL_CONFIG, name="model_config"),
            ApiRoute(base + "/stats", model_stats, api.MODEL_STATS, name="model_stats"),
            ApiRoute(
                base + "/infer",
                fastpath.starlette_endpoint,
                api.INFER,
                name="infer",
                methods=["POST"],
            ),
            ApiRoute(
                base + "/jobs", submit_job, api.SUBMIT_JOB, name="job_submit", methods=["POST"]
            ),
        ]
    repository = "/v2/repository"
    return [
        ApiRoute("/v2/health/live", live, api.LIVENESS, name="health_live"),
        ApiRoute("/v2/health/ready", ready, api.READINESS, name="health_ready"),
        ApiRoute("/v2", server_metadata, api.SERVER_METADATA, name="server_metadata"),
        Route("/openapi.json", openapi, name="openapi"),
        *docs.routes(),
        *console.routes(),
        Route("/metrics", metrics, name="metrics"),
        # Before the models' own paths, as Triton matches it: a model named "stats" has its
        # metadata at /v2/models/stats/versions/{v} (docs/model-control.md, Limits).
        ApiRoute("/v2/models/stats", model_stats, api.MODEL_STATS, name="model_stats"),
        *per_model,
        ApiRoute("/v2/jobs/{job}", get_job, api.JOB_STATUS, name="job_status", methods=["GET"]),
        ApiRoute(
            "/v2/jobs/{job}", cancel_job, api.JOB_CANCEL, name="job_cancel", methods=["DELETE"]
        ),
        ApiRoute("/v2/jobs/{job}/events", job_events, api.JOB_EVENTS, name="job_events"),
        ApiRoute(
            "/v2/batches", create_batch, api.CREATE_BATCH, name="batch_create", methods=["POST"]
        ),
        ApiRoute("/v2/batches", list_batches, api.LIST_BATCHES, name="batch_list", methods=["GET"]),
        ApiRoute(
            "/v2/batches/{batch}", get_batch, api.BATCH_STATUS, name="batch_status", methods=["GET"]
        ),
        ApiRoute(
            "/v2/batches/{batch}",
            delete_batch,
            api.BATCH_DELETE,
            name="batch_delete",
            methods=["DELETE"],
        ),
        ApiRoute(
            "/v2/batches/{batch}/cancel",
            cancel_batch,
            api.BATCH_CANCEL,
            name="batch_cancel",
            methods=["POST"],
        ),
        ApiRoute(
            "/v2/batches/{batch}/output",
            answers_of("output"),
            api.BATCH_OUTPUT,
            name="batch_output",
        ),
        ApiRoute(
            "/v2/batches/{batch}/errors",
            answers_of("errors"),
            api.BATCH_ERRORS,
            name="batch_errors",
        ),
        ApiRoute("/v2/batches/{batch}/events", batch_events, api.BATCH_EVENTS, name="batch_events"),
        ApiRoute(
            repository + "/index",
            repository_index,
            api.REPOSITORY_INDEX,
            name="repository_index",
            methods=["GET", "POST"],
        ),
        ApiRoute(
            repository + "/models/{model}/load",
            repository_load,
            api.REPOSITORY_LOAD,
            name="repository_load",
            methods=["POST"],
        ),
        ApiRoute(
            repository + "/models/{model}/reset",
            repository_reset,
            api.REPOSITORY_RESET,
            name="repository_reset",
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
    """Starlette, with the infer route served first by ``producer.fastpath`` (the hot path
    skips Starlette's routing and middleware; it does their work for that one route)."""

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

    instrument = Instrument(gateway, gateway.tracer if gateway.tracer.enabled else None)
    table = routes()
    app = GatewayApp(
        fastpath.InferFastPath(gateway, instrument, table),
        routes=table,
        lifespan=lifespan,
        middleware=[Middleware(RequestMetrics, instrument=instrument, routes=table)],
        exception_handlers={
            GatewayError: gateway_error,
            HTTPException: http_error,
            Exception: internal_error,
        },
    )
    app.state.gateway = gateway
    app.state.console = ConsoleViews(gateway)
    app.state.openapi = openapi_document(table)
    return app

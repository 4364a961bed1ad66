"""The OpenAPI 3 description of the gateway's HTTP API, served at ``GET /openapi.json``.

Derived, not written out: every documented route of the table in :mod:`producer.app` is an
:class:`ApiRoute` that carries its :class:`Operation` (summary, request body, answers, error
statuses, query and header parameters), and :func:`document` walks that table. A path, its
methods and its path parameters therefore exist once, in the route. The schemas of the Open
Inference Protocol (KServe V2) messages and of inferq's async jobs are defined once, below.
The fuzz tests generate requests from the document and check that no input makes the gateway
answer 5xx or hang.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.middleware import Middleware
from starlette.routing import BaseRoute, Route

import runtime
from protocol.tensor import DATATYPES

__all__ = ["SCHEMAS", "ApiRoute", "Operation", "Reply", "document"]

#: Why the gateway answers each error status (the body is always ``{"error": "..."}``).
ERROR_REASONS = {
    400: "invalid request (a readable message says what)",
    401: "no admin token sent (model-control API)",
    403: "wrong admin token, or the model-control API is disabled",
    404: "unknown model, version, job, batch or endpoint",
    408: "the request's headers or body did not arrive in time; the connection is closed",
    409: "the job has already started or finished; or another load of the model is running",
    410: "the job was accepted within its retention, but Redis lost its record (submit it again)",
    413: "request body too large (or larger than the gateway admits in flight)",
    415: "unsupported Content-Type or Content-Encoding",
    422: "the Idempotency-Key was already used for this model with a different request",
    429: "overloaded, backlog full, or too many bytes in flight; see Retry-After",
    500: "the model failed",
    503: "no live worker, Redis unreachable or refusing writes, Redis lost the request, or the "
    "model's breaker is open; see Retry-After",
    504: "the request's deadline passed; or Redis did not confirm that the request or job was "
    "queued (a stall, a restart): it may have run, see the message",
}

_ERROR = {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}
_JOB_STATUSES = ["queued", "running", "succeeded", "failed", "expired", "cancelled"]
_BATCH_STATUSES = [
    "validating",
    "in_progress",
    "finalizing",
    "completed",
    "failed",
    "expired",
    "cancelling",
    "cancelled",
]

_TENSOR: dict[str, Any] = {
    "type": "object",
    "required": ["name", "datatype", "shape"],
    "properties": {
        "name": {"type": "string"},
        "datatype": {"type": "string", "enum": sorted(DATATYPES)},
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "data": {"type": "array", "items": {}},
        "parameters": {"type": "object"},
    },
}
SCHEMAS: dict[str, Any] = {
    "Error": _ERROR,
    "InferInput": _TENSOR,
    "InferRequest": {
        "type": "object",
        "required": ["inputs"],
        "properties": {
            "id": {"type": "string"},
            "parameters": {
                "type": "object",
                "properties": {
                    "timeout": {
                        "type": "integer",
                        "minimum": 0,
                        "description": "deadline in microseconds",
                    },
                    "priority": {
                        "type": "integer",
                        "minimum": 0,
                        "description": "1 highest; 0 default; 2+ low",
                    },
                    "cache": {"type": "boolean"},
                    "binary_data_output": {"type": "boolean"},
                    "webhook": {
                        "type": "string",
                        "description": "jobs: the URL told of the job's changes (docs/webhooks.md)",
                    },
                    "webhook_events": {
                        "description": "jobs: the statuses the webhook is told of, a list or "
                        "comma-separated (default: the final ones)",
                        "oneOf": [
                            {"type": "string"},
                            {"type": "array", "items": {"type": "string", "enum": _JOB_STATUSES}},
                        ],
                    },
                },
            },
            "inputs": {"type": "array", "items": {"$ref": "#/components/schemas/InferInput"}},
            "outputs": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": {"type": "string"},
                        "parameters": {"type": "object"},
                    },
                },
            },
        },
    },
    "InferResponse": {
        "type": "object",
        "required": ["model_name", "outputs"],
        "properties": {
            "id": {"type": "string"},
            "model_name": {"type": "string"},
            "model_version": {"type": "string"},
            "outputs": {"type": "array", "items": {"type": "object"}},
        },
    },
    "ModelMetadata": {
        "type": "object",
        "required": ["name", "versions", "platform", "inputs", "outputs"],
        "properties": {
            "name": {"type": "string"},
            "versions": {"type": "array", "items": {"type": "string"}},
            "platform": {"type": "string"},
            "inputs": {"type": "array", "items": {"type": "object"}},
            "outputs": {"type": "array", "items": {"type": "object"}},
        },
    },
    "Job": {
        "type": "object",
        "required": ["id", "model_name", "status"],
        "properties": {
            "id": {"type": "string"},
            "model_name": {"type": "string"},
            "model_version": {"type": "string"},
            "status": {"type": "string", "enum": _JOB_STATUSES},
            "created_at": {"type": "string", "nullable": True},
            "started_at": {"type": "string", "nullable": True},
            "finished_at": {"type": "string", "nullable": True},
            "result": {"$ref": "#/components/schemas/InferResponse"},
            "error": {"type": "string"},
            "webhook": {
                "type": "object",
                "properties": {
                    "url": {"type": "string"},
                    "events": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
    "Batch": {
        "type": "object",
        "required": ["id", "status", "request_counts"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": ["batch"]},
            "status": {"type": "string", "enum": _BATCH_STATUSES},
            "model": {"type": "string", "nullable": True},
            "completion_window": {"type": "string"},
            "request_counts": {
                "type": "object",
                "properties": {
                    "total": {"type": "integer"},
                    "completed": {"type": "integer"},
                    "failed": {"type": "integer"},
                },
            },
            **{f"{s}_at": {"type": "string", "nullable": True} for s in _BATCH_STATUSES},
            "created_at": {"type": "string"},
            "expires_at": {"type": "string"},
            "output_url": {"type": "string"},
            "errors_url": {"type": "string"},
            "metadata": {"type": "object"},
        },
    },
    "BatchRequest": {
        "type": "object",
        "description": "the JSON form; or send JSONL (one line per request) with the options "
        "as query parameters (docs/batches.md)",
        "properties": {
            "requests": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "custom_id": {"type": "string"},
                        "method": {"type": "string", "enum": ["POST"]},
                        "url": {"type": "string"},
                        "body": {"$ref": "#/components/schemas/InferRequest"},
                    },
                },
            },
            "input": {"type": "string", "description": "JSONL text"},
            "model": {"type": "string", "description": "the model of bare V2 lines"},
            "version": {"type": "string"},
            "completion_window": {"type": "string", "description": "e.g. 24h, 30m, 3600"},
            "metadata": {"type": "object"},
            "webhook": {"type": "string"},
            "webhook_events": {"type": "string"},
        },
    },
}
#: Inline schemas of the bodies that are not V2 messages.
OBJECT: dict[str, Any] = {"type": "object"}
INDEX_REQUEST: dict[str, Any] = {"type": "object", "properties": {"ready": {"type": "boolean"}}}
INDEX_RESPONSE: dict[str, Any] = {"type": "array", "items": {"type": "object"}}
MODEL_CONTROL: dict[str, Any] = {
    "type": "object",
    "properties": {
        "parameters": {
            "type": "object",
            "description": "'version' (serve only that version) or 'weights' "
            "(version -> relative share of requests that name no version); "
            "neither: as the repository config says",
            "properties": {
                "version": {"type": "string"},
                "weights": {
                    "type": "object",
                    "additionalProperties": {"type": "number", "minimum": 0},
                },
            },
        }
    },
}

Schema = str | Mapping[str, Any]
"""A component of :data:`SCHEMAS` by name, or an inline JSON schema."""


@dataclass(frozen=True, slots=True)
class Reply:
    """One documented answer: a description and, when it has a JSON body, its schema."""

    description: str
    schema: Schema | None = None


@dataclass(frozen=True, slots=True)
class Operation:
    """What the OpenAPI document says about one route, beside what the route itself says
    (its path, path parameters and methods)."""

    summary: str
    replies: Mapping[int, Reply]
    errors: tuple[int, ...] = ()
    body: Schema | None = None
    body_required: bool = True
    query: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    headers: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    admin: bool = False


class ApiRoute(Route):
    """A Starlette route that also carries its :class:`Operation`; ``name`` is the endpoint
    label of the gateway's request metrics."""

    def __init__(
        self,
        path: str,
        endpoint: Callable[..., Any],
        operation: Operation,
        *,
        name: str,
        methods: list[str] | None = None,
        middleware: Sequence[Middleware] | None = None,
    ) -> None:
        super().__init__(path, endpoint, methods=methods, name=name, middleware=middleware)
        self.operation = operation


# What each operation of the route table (producer.app.routes) says, beside its path and methods.
INFER = Operation(
    "Inference (JSON, or the binary tensor extension)",
    {200: Reply("outputs", "InferResponse")},
    errors=(400, 404, 408, 413, 415, 429, 500, 503, 504),
    body="InferRequest",
)
SUBMIT_JOB = Operation(
    "Submit an async job",
    {202: Reply("queued", "Job")},
    errors=(400, 404, 408, 413, 415, 422, 429, 503, 504),
    body="InferRequest",
    headers={
        "Idempotency-Key": {"type": "string"},
        "Inferq-Webhook": {"type": "string", "description": "as parameters.webhook"},
        "Inferq-Webhook-Events": {"type": "string", "description": "as parameters.webhook_events"},
    },
)
MODEL_METADATA = Operation(
    "Model metadata", {200: Reply("metadata", "ModelMetadata")}, errors=(404,)
)
MODEL_READY = Operation(
    "Model readiness", {200: Reply("ready"), 503: Reply("not ready")}, errors=(404,)
)
LIVENESS = Operation("Liveness", {200: Reply("live", OBJECT)})
READINESS = Operation("Readiness", {200: Reply("ready", OBJECT), 503: Reply("not ready", OBJECT)})
SERVER_METADATA = Operation("Server metadata", {200: Reply("name, version and extensions", OBJECT)})
JOB_STATUS = Operation(
    "A job, long-polled with ?wait=",
    {200: Reply("the job", "Job")},
    errors=(400, 404, 410, 503),
    query={"wait": {"type": "number", "minimum": 0, "maximum": 1}},
)
JOB_CANCEL = Operation(
    "Cancel a job that has not started",
    {200: Reply("the cancelled job", "Job")},
    errors=(404, 409, 410, 503),
)
_EVENTS = {
    200: Reply(
        "text/event-stream: one event per state (data: the object as GET shows it; id: to "
        "resume with Last-Event-ID on any gateway), ending after the final one (docs/events.md)"
    ),
    204: Reply("a resume whose client has already seen the final state: nothing more to send"),
}
JOB_EVENTS = Operation(
    "The job's states as server-sent events",
    _EVENTS,
    errors=(400, 404, 503),
    headers={"Last-Event-ID": {"type": "string"}},
)
BATCH_EVENTS = Operation(
    "The batch's states and progress as server-sent events",
    _EVENTS,
    errors=(400, 404, 503),
    headers={"Last-Event-ID": {"type": "string"}},
)
_BATCH_QUERY = {
    "model": {"type": "string"},
    "version": {"type": "string"},
    "completion_window": {"type": "string"},
    "metadata": {"type": "string", "description": "a JSON object of strings"},
}
CREATE_BATCH = Operation(
    "Create a batch from JSONL (or JSON) lines: each runs as a low-lane job",
    {202: Reply("accepted: the batch", "Batch")},
    errors=(400, 408, 413, 415, 429, 503),
    body="BatchRequest",
    query=_BATCH_QUERY,
    headers={
        "Inferq-Webhook": {"type": "string", "description": "as the webhook option"},
        "Inferq-Webhook-Events": {"type": "string", "description": "as webhook_events"},
    },
)
LIST_BATCHES = Operation(
    "Batches, newest first, a page at a time",
    {200: Reply("object list, data, first_id, last_id, has_more", OBJECT)},
    errors=(400, 503),
    query={
        "after": {"type": "string", "description": "the last id of the previous page"},
        "limit": {"type": "integer", "minimum": 1, "maximum": 100},
    },
)
BATCH_STATUS = Operation(
    "A batch: status and request counts", {200: Reply("the batch", "Batch")}, errors=(404, 503)
)
BATCH_CANCEL = Operation(
    "Cancel a batch: lines not started are not run",
    {200: Reply("the batch, cancelling or cancelled", "Batch")},
    errors=(404, 409, 503),
)
BATCH_DELETE = Operation(
    "Delete a finished batch and its output",
    {200: Reply("deleted", OBJECT)},
    errors=(404, 409, 503),
)
BATCH_OUTPUT = Operation(
    "The lines the model answered, JSONL in input order: custom_id, line, response "
    "{status_code, body}",
    {200: Reply("application/jsonl")},
    errors=(404, 503),
)
BATCH_ERRORS = Operation(
    "The lines that failed or were malformed, JSONL in input order: custom_id, line, error "
    "{code, message}",
    {200: Reply("application/jsonl")},
    errors=(404, 503),
)
REPOSITORY_INDEX = Operation(
    "Every model version and its state (Triton's repository index)",
    {200: Reply("name, version, state (READY or UNAVAILABLE), reason, traffic", INDEX_RESPONSE)},
    errors=(400, 401, 403, 503),
    body=INDEX_REQUEST,
    body_required=False,
    admin=True,
)
REPOSITORY_LOAD = Operation(
    "Load versions on every worker, warm them, then switch traffic",
    {200: Reply("the committed policy and each worker's load time")},
    errors=(400, 401, 403, 404, 409, 503),
    body=MODEL_CONTROL,
    body_required=False,
    admin=True,
)
MODEL_CONFIG = Operation(
    "Model configuration (Triton's JSON: platform, backend, max_batch_size, input, output, "
    "dynamic_batching)",
    {200: Reply("the configuration", OBJECT)},
    errors=(404,),
)
MODEL_STATS = Operation(
    "Inference statistics per model version (Triton's shape), summed over the live workers",
    {200: Reply("model_stats", OBJECT)},
    errors=(404, 503),
)
REPOSITORY_RESET = Operation(
    "Return a model to its repository config's policy (loaded everywhere, then the admin "
    "policy is deleted)",
    {200: Reply("the versions served now")},
    errors=(400, 401, 403, 404, 409, 503),
    admin=True,
)
REPOSITORY_UNLOAD = Operation(
    "Unload the model, or one version with {'parameters': {'version': v}}",
    {200: Reply("the policy left")},
    errors=(400, 401, 403, 404, 409, 503),
    body=MODEL_CONTROL,
    body_required=False,
    admin=True,
)


def _schema(schema: Schema) -> dict[str, Any]:
    if isinstance(schema, str):
        if schema not in SCHEMAS:
            raise KeyError(f"no schema named {schema!r}")
        return {"$ref": f"#/components/schemas/{schema}"}
    return dict(schema)


def _json(schema: Schema) -> dict[str, Any]:
    return {"application/json": {"schema": _schema(schema)}}


def _reply(reply: Reply) -> dict[str, Any]:
    out: dict[str, Any] = {"description": reply.description}
    if reply.schema is not None:
        out["content"] = _json(reply.schema)
    return out


def _parameters(where: str, params: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"name": name, "in": where, "required": False, "schema": dict(schema)}
        for name, schema in params.items()
    ]


def operation_object(op: Operation) -> dict[str, Any]:
    """The OpenAPI operation object of ``op``."""
    out: dict[str, Any] = {"summary": op.summary}
    if op.admin:
        out["security"] = [{"adminToken": []}]
    parameters = _parameters("query", op.query) + _parameters("header", op.headers)
    if parameters:
        out["parameters"] = parameters
    if op.body is not None:
        out["requestBody"] = {"required": op.body_required, "content": _json(op.body)}
    responses = {str(status): _reply(reply) for status, reply in op.replies.items()}
    for status in op.errors:
        responses[str(status)] = _reply(Reply(ERROR_REASONS[status], "Error"))
    out["responses"] = responses
    return out


def document(routes: Iterable[BaseRoute]) -> dict[str, Any]:
    """The OpenAPI document of every :class:`ApiRoute` in ``routes`` (others are left out)."""
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        if not isinstance(route, ApiRoute):
            continue
        item = paths.setdefault(route.path, {})
        if route.param_convertors:
            item["parameters"] = [
                {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                for name in route.param_convertors
            ]
        for method in sorted(route.methods or {"GET"}):
            if method != "HEAD":  # Starlette answers HEAD wherever GET is routed
                item[method.lower()] = operation_object(route.operation)
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "inferq",
            "version": runtime.__version__,
            "description": "Open Inference Protocol (KServe V2) over Redis Streams, "
            "with async jobs.",
        },
        "paths": paths,
        "components": {
            "schemas": copy.deepcopy(SCHEMAS),
            "securitySchemes": {"adminToken": {"type": "http", "scheme": "bearer"}},
        },
    }

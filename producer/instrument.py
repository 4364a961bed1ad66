"""ASGI middleware that counts and times every HTTP request, errors included, and (only when
tracing is on) opens each inference request's trace.

Exception handlers turn errors into responses below this layer, so one place sees every status.
Model and version labels are set only for models the registry knows: a label never carries a
name a client made up (which would let anyone grow the metric's series without bound).
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from producer.routing import ROUTED_VERSION
from runtime.tracing import REQUEST_TRACE, Tracer

if TYPE_CHECKING:
    from producer.gateway import Gateway

_MODEL_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?(/ready|/infer|/jobs)?$")
_FIXED = {
    "/v2/health/live": "health_live",
    "/v2/health/ready": "health_ready",
    "/v2": "server_metadata",
    "/metrics": "metrics",
    "/openapi.json": "openapi",
}
TRACED_ENDPOINTS = frozenset({"infer", "job_submit"})
"""Endpoints that get a trace; health checks, scrapes and polls would only add noise."""
_MODEL_ENDPOINTS = {
    None: "model_metadata",
    "/ready": "model_ready",
    "/infer": "infer",
    "/jobs": "job_submit",
}


def classify(path: str, method: str) -> tuple[str, str | None, str | None]:
    """(endpoint, model, version) as named in the path, before any check that they exist."""
    if path in _FIXED:
        return _FIXED[path], None, None
    if path.startswith("/v2/jobs/"):
        return ("job_cancel" if method == "DELETE" else "job_status"), None, None
    m = _MODEL_PATH.match(path)
    if m is None:
        return "other", None, None
    return _MODEL_ENDPOINTS[m.group(3)], m.group(1), m.group(2)


def _header(scope: Scope, wanted: bytes) -> str | None:
    for name, value in scope["headers"]:
        if name == wanted:
            return str(value.decode("latin-1"))
    return None


class RequestTracing:
    """Starts the server span of each inference request, the caller's ``traceparent`` its
    parent, and makes it the request's ``REQUEST_TRACE`` for the handlers below. Installed
    outside ``RequestMetrics`` (which reads the trace id for its exemplar), and only when
    tracing is on."""

    def __init__(self, app: ASGIApp, tracer: Tracer) -> None:
        self.app = app
        self.tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = classify(scope["path"], scope["method"]) if scope["type"] == "http" else None
        if endpoint is None or endpoint[0] not in TRACED_ENDPOINTS:
            await self.app(scope, receive, send)
            return
        name, model, version = endpoint
        attributes = {
            "http.request.method": scope["method"],
            "url.path": scope["path"],
            "inferq.endpoint": name,
            "inferq.model": model or "",
        }
        if version:
            attributes["inferq.version"] = version
        trace = self.tracer.request(
            f"{scope['method']} {name}", _header(scope, b"traceparent"), attributes
        )
        status = 500

        async def send_and_watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        token = REQUEST_TRACE.set(trace)
        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            REQUEST_TRACE.reset(token)
            trace.end(status)


class RequestMetrics:
    def __init__(self, app: ASGIApp, gateway: Gateway, *, exemplars: bool = False) -> None:
        self.app = app
        self.gateway = gateway
        self.exemplars = exemplars
        """Tracing is on: label latency observations of sampled requests with their trace id."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_and_watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        routed = ROUTED_VERSION.set(None)
        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            self._observe(scope, status, time.perf_counter() - started, ROUTED_VERSION.get())
            ROUTED_VERSION.reset(routed)

    def _observe(self, scope: Scope, status: int, seconds: float, routed: str | None) -> None:
        endpoint, model, version = classify(scope["path"], scope["method"])
        entry = self.gateway.registry.models.get(model) if model else None
        if entry is None:
            model = version = None
        elif routed is not None:
            version = routed  # a version the registry knew when the request was routed
        elif version not in entry.metadata.versions:
            version = entry.metadata.default_version if version is None else None
        body_bytes = None
        if endpoint in ("infer", "job_submit"):
            for name, value in scope["headers"]:
                if name == b"content-length" and value.isdigit():
                    body_bytes = int(value)
        exemplar = REQUEST_TRACE.get().exemplar() if self.exemplars else None
        self.gateway.metrics.observe_request(
            model, version, endpoint, status, seconds, body_bytes=body_bytes, exemplar=exemplar
        )

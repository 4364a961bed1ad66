"""ASGI middleware that counts and times every HTTP request, errors included, and (only when
tracing is on) opens the trace of each inference request.

Exception handlers turn errors into responses below this layer, so one place sees every status.
The endpoint label is the name of the route Starlette matched (the route table in
:mod:`producer.app` is the only place a path is written).
Model and version labels are set only for models the registry knows: a label never carries a
name a client made up (which would let anyone grow the metric's series without bound).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from producer.metrics import ENDPOINTS
from producer.routing import ROUTED_VERSION
from runtime.tracing import REQUEST_TRACE, RequestTrace, Tracer

if TYPE_CHECKING:
    from producer.gateway import Gateway
    from producer.registry import ModelRegistry


def endpoint_names(routes: Iterable[BaseRoute]) -> dict[Callable[..., Any], str]:
    """Each route's endpoint function to the route's name: the ``endpoint`` label."""
    return {route.endpoint: route.name for route in routes if isinstance(route, Route)}


def classify(
    scope: Scope, names: dict[Callable[..., Any], str]
) -> tuple[str, str | None, str | None]:
    """(endpoint, model, version) of a request Starlette has routed, as named in its path and
    before any check that they exist: the router leaves the matched route's ``endpoint`` and
    ``path_params`` in the scope (for a wrong method too), nothing when no path matched."""
    endpoint = names.get(scope.get("endpoint"), "other")  # type: ignore[arg-type]
    if endpoint not in ENDPOINTS:
        return "other", None, None
    params = scope.get("path_params", {})
    return endpoint, params.get("model"), params.get("version")


def known_labels(
    registry: ModelRegistry, model: str | None, version: str | None, routed: str | None
) -> tuple[str | None, str | None]:
    """The (model, version) labels of a request that named ``model`` and ``version``: None for
    names the registry does not know; the version the request was routed to, if any."""
    entry = registry.models.get(model) if model else None
    if entry is None:
        return None, None
    if routed is not None:
        return model, routed  # a version the registry knew when the request was routed
    if version not in entry.metadata.versions:
        return model, entry.metadata.default_version if version is None else None
    return model, version


TRACE_KEY = "inferq.trace"
"""Where ``RequestTracing`` leaves the request's trace in the ASGI scope, for the exemplar."""


def _header(scope: Scope, wanted: bytes) -> str | None:
    for name, value in scope["headers"]:
        if name == wanted:
            return str(value.decode("latin-1"))
    return None


def open_trace(
    tracer: Tracer, scope: Scope, endpoint: str, model: str, version: str | None
) -> RequestTrace:
    """The server span of one inference request, a child of the caller's ``traceparent``; left
    in the scope for the latency exemplar."""
    attributes = {
        "http.request.method": scope["method"],
        "url.path": scope["path"],
        "inferq.endpoint": endpoint,
        "inferq.model": model,
    }
    if version is not None:
        attributes["inferq.version"] = version
    trace = tracer.request(
        f"{scope['method']} {endpoint}", _header(scope, b"traceparent"), attributes
    )
    scope[TRACE_KEY] = trace
    return trace


def observe(
    gateway: Gateway,
    scope: Scope,
    labels: tuple[str, str | None, str | None],
    status: int,
    seconds: float,
    *,
    routed: str | None,
    exemplars: bool,
) -> None:
    """Count and time one answered request. ``labels``: (endpoint, model, version) as the
    request named them; ``routed``: the version it was routed to, if any."""
    endpoint, named_model, named_version = labels
    model, version = known_labels(gateway.registry, named_model, named_version, routed)
    body_bytes = None
    if endpoint in ("infer", "job_submit"):
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit():
                body_bytes = int(value)
    exemplar = None
    if exemplars:
        trace: RequestTrace | None = scope.get(TRACE_KEY)
        exemplar = trace.exemplar() if trace is not None else None
    gateway.metrics.observe_request(
        model, version, endpoint, status, seconds, body_bytes=body_bytes, exemplar=exemplar
    )


class SentStatus:
    """Wraps an ASGI ``send`` to remember the status of the response it started (500 until
    one starts: an exception before the response is what the client gets as a 500)."""

    __slots__ = ("_send", "status")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.status = 500

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self._send(message)


class RequestTracing:
    """Route middleware of the inference routes (only when tracing is on): starts the
    request's server span, a child of the caller's ``traceparent``, and makes it the
    ``REQUEST_TRACE`` of the handlers below. It wraps the route with its exception handlers, so
    the span ends with the status the client gets."""

    def __init__(self, app: ASGIApp, tracer: Tracer, endpoint: str) -> None:
        self.app = app
        self.tracer = tracer
        self.endpoint = endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        params = scope.get("path_params", {})
        trace = open_trace(
            self.tracer, scope, self.endpoint, params.get("model", ""), params.get("version")
        )
        sent = SentStatus(send)
        token = REQUEST_TRACE.set(trace)
        try:
            await self.app(scope, receive, sent.send)
        finally:
            REQUEST_TRACE.reset(token)
            trace.end(sent.status)


class RequestMetrics:
    def __init__(
        self,
        app: ASGIApp,
        gateway: Gateway,
        routes: Iterable[BaseRoute],
        *,
        exemplars: bool = False,
    ) -> None:
        self.app = app
        self.gateway = gateway
        self.names = endpoint_names(routes)
        self.exemplars = exemplars
        """Tracing is on: label latency observations of sampled requests with their trace id."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        sent = SentStatus(send)
        routed = ROUTED_VERSION.set(None)
        try:
            await self.app(scope, receive, sent.send)
        finally:
            self._observe(scope, sent.status, time.perf_counter() - started, ROUTED_VERSION.get())
            ROUTED_VERSION.reset(routed)

    def _observe(self, scope: Scope, status: int, seconds: float, routed: str | None) -> None:
        labels = classify(scope, self.names)
        observe(
            self.gateway, scope, labels, status, seconds, routed=routed, exemplars=self.exemplars
        )

"""One wrapper counts, times and traces every request the gateway answers, over any transport.

A transport starts an ``Observation`` when a request arrives and ends it once with the status of
its answer (``end``; ``failed`` also maps an exception to that answer, ``errors.answer_for``).
The infer fast path and gRPC use it directly, the Starlette routes through ``RequestMetrics``.
Labels name only models the registry knows (a client cannot grow a series), with the version
the request was routed to when the service says; ``trace`` opens the server span, a child of
the caller's ``traceparent``, as the ``REQUEST_TRACE`` of the handlers below.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from contextvars import Token
from typing import TYPE_CHECKING, Any

from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from producer.errors import GatewayError, answer_for
from producer.metrics import ENDPOINTS
from runtime.tracing import REQUEST_TRACE, RequestTrace, Tracer

if TYPE_CHECKING:
    from producer.gateway import Gateway
    from producer.registry import ModelRegistry

OBSERVATION = "inferq.observation"
"""Where ``RequestMetrics`` leaves a Starlette request's ``Observation`` in the ASGI scope."""


class Instrument:
    """Starts the observations of one transport (the gateway's metrics, and its tracer when
    tracing is on)."""

    def __init__(self, gateway: Gateway, tracer: Tracer | None) -> None:
        self.gateway = gateway
        """Read per request: the registry and metrics exist once the gateway has started."""
        self.tracer = tracer
        """Set only when tracing is on."""

    def start(
        self,
        endpoint: str,
        model: str | None = None,
        version: str | None = None,
        *,
        protocol: str = "http",
        body_bytes: int | None = None,
    ) -> Observation:
        return Observation(self, endpoint, model, version, protocol, body_bytes)


class Observation:
    """One request from its arrival to its answer (see the module docstring)."""

    __slots__ = (
        "_instrument",
        "_started",
        "_token",
        "_trace",
        "body_bytes",
        "endpoint",
        "model",
        "protocol",
        "routed",
        "version",
    )

    def __init__(
        self,
        instrument: Instrument,
        endpoint: str,
        model: str | None,
        version: str | None,
        protocol: str,
        body_bytes: int | None,
    ) -> None:
        self._instrument = instrument
        self._started = time.perf_counter()
        self._trace: RequestTrace | None = None
        self._token: Token[RequestTrace] | None = None
        self.endpoint = endpoint
        """The ``endpoint`` label; model and version as the request named them."""
        self.model = model
        self.version = version
        self.protocol = protocol
        self.body_bytes = body_bytes
        self.routed: str | None = None
        """The version the service routed the request to (from its answer, or its error)."""

    def trace(self, name: str, parent: str | None, attributes: Mapping[str, str]) -> None:
        """Open the request's server span (only when tracing is on)."""
        tracer = self._instrument.tracer
        if tracer is not None:
            self._trace = tracer.request(name, parent, attributes)
            self._token = REQUEST_TRACE.set(self._trace)

    def trace_http(self, scope: Scope, endpoint: str, model: str, version: str | None) -> None:
        """The server span of an HTTP inference request (``POST infer``, ``POST job_submit``)."""
        if self._instrument.tracer is None:
            return
        attributes = {
            "http.request.method": scope["method"],
            "url.path": scope["path"],
            "inferq.endpoint": endpoint,
            "inferq.model": model,
        }
        if version is not None:
            attributes["inferq.version"] = version
        self.trace(f"{scope['method']} {endpoint}", _header(scope, b"traceparent"), attributes)

    def end(self, status: int) -> None:
        """Count and time the answered request; close its span with ``status``."""
        trace = self._trace
        exemplar = None
        if trace is not None:
            if self._token is not None:
                REQUEST_TRACE.reset(self._token)
            trace.end(status)
            exemplar = trace.exemplar()
        gateway = self._instrument.gateway
        model, version = known_labels(gateway.registry, self.model, self.version, self.routed)
        gateway.metrics.observe_request(
            model,
            version,
            self.endpoint,
            status,
            time.perf_counter() - self._started,
            body_bytes=self.body_bytes,
            protocol=self.protocol,
            exemplar=exemplar,
        )

    def failed(self, error: BaseException, **where: Any) -> GatewayError:
        """End with the status of what the caller is told of ``error``, and return that."""
        answer = answer_for(error, **where)
        if answer.routed is not None:
            self.routed = answer.routed
        self.end(answer.status)
        return answer


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


def _header(scope: Scope, wanted: bytes) -> str | None:
    """One request header's value, read from the ASGI scope."""
    for name, value in scope["headers"]:
        if name == wanted:
            return str(value.decode("latin-1"))
    return None


def content_length(scope: Scope) -> int | None:
    """The declared body size (the ``inferq_gateway_request_body_bytes`` observation)."""
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit():
            return int(value)
    return None


# -- the Starlette routes ---------------------------------------------------------------------


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


def observation(scope: Scope) -> Observation | None:
    """The observation ``RequestMetrics`` started for this Starlette request."""
    return scope.get(OBSERVATION)


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


class RequestMetrics:
    """ASGI middleware of the Starlette routes: an ``Observation`` per HTTP request, ended
    with the status the client got (the exception handlers answer below this layer) and the
    labels of the route Starlette matched. Handlers find it with ``observation(scope)``."""

    def __init__(self, app: ASGIApp, instrument: Instrument, routes: Iterable[BaseRoute]) -> None:
        self.app = app
        self.instrument = instrument
        self.names = endpoint_names(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        seen = scope[OBSERVATION] = self.instrument.start("other")
        sent = SentStatus(send)
        try:
            await self.app(scope, receive, sent.send)
        finally:
            seen.endpoint, seen.model, seen.version = classify(scope, self.names)
            if seen.endpoint in ("infer", "job_submit"):
                seen.body_bytes = content_length(scope)
            seen.end(sent.status)

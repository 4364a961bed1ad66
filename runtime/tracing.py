"""Tracing: the interface the gateway and the workers call, and the no-op that runs by default.

One trace per request, joined across the queue by the W3C ``traceparent`` the request message
carries:

- gateway: the request's server span, with children *receive and validate*, *cache lookup*,
  *queue wait* (enqueue to reply; its context is what the message carries) and *encode response*;
  a job submission has *enqueue* instead of queue wait and encoding;
- worker, children of the message's context: *batch wait* (read to model call) and *result
  write* per request, and one *inference* span per model call, linked to every sampled request
  it served (parented on the first of them, so it is sampled when any of them is).

``configure`` runs once per process, in the entry point, and picks the tracer: this module's
no-op ``Tracer`` unless the ``otel`` extra is installed and the standard ``OTEL_*`` variables
name an exporter; then ``runtime.otel`` (the only module that imports OpenTelemetry) supplies
one backed by the SDK. Untraced, the gateway installs no tracing middleware and every other call
here is a method that returns at once: the hot paths cost what they did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from typing import Any

import structlog

log = structlog.get_logger("inferq.tracing")

Exemplar = dict[str, str]
"""A Prometheus exemplar's labels: ``{"trace_id": "<32 hex digits>"}``."""

_NULL = contextlib.nullcontext()


class TracingError(ValueError):
    """The ``OTEL_*`` variables name an exporter or protocol that is not available."""


class Stage:
    """An open span whose context travels in a request message (queue wait, enqueue)."""

    __slots__ = ()

    def propagate(self, traceparent: str | None) -> str | None:
        """The traceparent the message carries: this span's, or (untraced) the one given."""
        return traceparent

    def end(self) -> None:
        """Close the span."""


class RequestTrace:
    """One gateway request's spans. This base records nothing."""

    __slots__ = ()

    traceparent: str | None = None
    """The request's server span as a W3C traceparent (the response header); None untraced."""

    def span(self, name: str) -> contextlib.AbstractContextManager[Any]:
        """A child span around a block."""
        return _NULL

    def since_start(self, name: str) -> None:
        """A child span from the request's start to now (receive and validate)."""

    def start(self, name: str) -> Stage:
        """A child span left open, for a stage that crosses the queue."""
        return NO_STAGE

    def exemplar(self) -> Exemplar | None:
        """The trace id for a latency histogram's exemplar, when this request is sampled."""
        return None

    def end(self, status: int) -> None:
        """Close the server span with the HTTP status."""


NO_STAGE = Stage()
NO_REQUEST = RequestTrace()

REQUEST_TRACE: ContextVar[RequestTrace] = ContextVar("inferq_request_trace", default=NO_REQUEST)
"""The current request's trace, set by the gateway's tracing middleware for traced endpoints."""


class Tracer:
    """No tracing. ``runtime.otel.OtelTracer`` overrides every method."""

    enabled = False

    def request(
        self, name: str, traceparent: str | None, attributes: Mapping[str, str]
    ) -> RequestTrace:
        """Start a gateway request's server span, child of the caller's ``traceparent``."""
        return NO_REQUEST

    def batch(
        self,
        *,
        model: str,
        worker: str,
        requests: Sequence[tuple[str | None, float]],
        started: float,
        finished: float,
        rows: int,
        failed: bool,
    ) -> Exemplar | None:
        """One model call's spans: *batch wait* per request (``(traceparent, read_at)``, read
        time monotonic), *inference* from ``started`` to ``finished`` (monotonic). Returns the
        inference span's exemplar when it was sampled."""
        return None

    def result_written(self, traceparent: str | None, finished: float, written: float) -> None:
        """A request's *result write* span, from the end of its model call (monotonic) to the
        completed write of its result and reply."""

    def shutdown(self) -> None:
        """Flush and stop exporting (the SDK also does this at exit)."""


_current: Tracer = Tracer()


def current() -> Tracer:
    """The process's tracer; the gateway and the worker read it once, when they are built."""
    return _current


def install(tracer: Tracer) -> Tracer:
    """Make ``tracer`` the process's tracer (``configure`` does; tests may); returns the old."""
    global _current
    previous, _current = _current, tracer
    return previous


def exporters(environ: Mapping[str, str]) -> list[str]:
    """The span exporters the ``OTEL_*`` variables ask for; empty means tracing is off.

    ``OTEL_TRACES_EXPORTER`` names them (``otlp``, ``console``, ..., ``none``). Unset, an OTLP
    endpoint (``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``) means ``otlp``; with neither, tracing
    stays off rather than exporting to a default endpoint nobody set up. ``OTEL_SDK_DISABLED``
    turns it off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = environ.get("OTEL_TRACES_EXPORTER")
    if names is None:
        endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        return ["otlp"] if endpoint else []
    return [n.strip() for n in names.split(",") if n.strip() and n.strip() != "none"]


def configure(environ: Mapping[str, str], service: str) -> Tracer:
    """Pick this process's tracer from the environment, once, at start-up. Raises
    ``TracingError`` when the variables ask for something that cannot be set up."""
    names = exporters(environ)
    tracer = Tracer()
    if names:
        try:
            from runtime.otel import OtelTracer
        except ImportError:
            log.warning(
                "OTEL_* variables ask for traces but the otel extra is not installed "
                "(pip install 'inferq[otel]'); tracing is off",
                exporters=names,
            )
        else:
            tracer = OtelTracer.from_environ(environ, service, names)
            log.info("tracing on", exporters=names, service=service)
    install(tracer)
    return tracer

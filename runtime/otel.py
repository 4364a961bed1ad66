"""The OpenTelemetry SDK behind ``runtime.tracing``: the only module that imports it.

Imported by ``runtime.tracing.configure`` only when the ``OTEL_*`` variables ask for traces and
the ``otel`` extra (opentelemetry-api, -sdk, -exporter-otlp) is installed. Everything is
configured by the standard variables: the exporters (``OTEL_TRACES_EXPORTER``), the OTLP
endpoint, protocol and headers (read by the exporter), the sampler (``OTEL_TRACES_SAMPLER``,
``OTEL_TRACES_SAMPLER_ARG``, read by ``TracerProvider``), the batch processor
(``OTEL_BSP_*``) and the resource (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``).

Spans of an unsampled request are never built: the gateway's sampling decision travels in the
traceparent's flags, and the worker records nothing for a request whose flags say unsampled.
Worker spans are recorded after the fact with explicit start and end times, from the monotonic
times the worker keeps anyway, so tracing adds no clock reads to the batch loop.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from importlib.metadata import entry_points
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    set_span_in_context,
)

from runtime.tracing import (
    NO_STAGE,
    Exemplar,
    RequestTrace,
    Stage,
    Tracer,
    TracingError,
)

SCOPE = "inferq"
_OTLP_BY_PROTOCOL = {"grpc": "otlp_proto_grpc", "http/protobuf": "otlp_proto_http"}


def parse_traceparent(traceparent: str | None) -> SpanContext | None:
    """A W3C ``traceparent`` (version 00) as a remote span context; None if malformed."""
    if traceparent is None or len(traceparent) != 55 or traceparent[:3] != "00-":
        return None
    try:
        trace_id = int(traceparent[3:35], 16)
        span_id = int(traceparent[36:52], 16)
        flags = int(traceparent[53:55], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags))


def format_traceparent(context: SpanContext) -> str:
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def _sampled(traceparent: str | None) -> SpanContext | None:
    context = parse_traceparent(traceparent)
    return context if context is not None and context.trace_flags.sampled else None


def _under(parent: SpanContext) -> Context:
    return set_span_in_context(NonRecordingSpan(parent))


def _exemplar(context: SpanContext) -> Exemplar:
    return {"trace_id": f"{context.trace_id:032x}"}


def exporter(name: str, environ: Mapping[str, str]) -> SpanExporter:
    """The span exporter an ``OTEL_TRACES_EXPORTER`` name stands for, from the exporters the
    installed packages register (entry point group ``opentelemetry_traces_exporter``). ``otlp``
    follows ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`` (grpc unless it says http/protobuf)."""
    if name == "otlp":
        protocol = (
            environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "grpc"
        )
        if protocol not in _OTLP_BY_PROTOCOL:
            raise TracingError(
                f"OTLP protocol {protocol!r} is not supported (use grpc or http/protobuf)"
            )
        name = _OTLP_BY_PROTOCOL[protocol]
    found = list(entry_points(group="opentelemetry_traces_exporter", name=name))
    if not found:
        raise TracingError(
            f"OTEL_TRACES_EXPORTER names {name!r}, and no installed package provides a span "
            "exporter of that name (otlp and console come with inferq[otel])"
        )
    made: SpanExporter = found[0].load()()
    return made


class _OpenStage(Stage):
    __slots__ = ("_span",)

    def __init__(self, span: Span) -> None:
        self._span = span

    def propagate(self, traceparent: str | None) -> str | None:
        return format_traceparent(self._span.get_span_context())

    def end(self) -> None:
        self._span.end()


class _Unsampled(Stage):
    """Carries an unsampled request's traceparent (flags 00) so the worker records nothing."""

    __slots__ = ("_traceparent",)

    def __init__(self, traceparent: str) -> None:
        self._traceparent = traceparent

    def propagate(self, traceparent: str | None) -> str | None:
        return self._traceparent


class _Request(RequestTrace):
    __slots__ = ("_context", "_recording", "_root", "_tracer", "traceparent")

    def __init__(self, tracer: Any, root: Span) -> None:
        self._tracer = tracer
        self._root = root
        self._recording = root.is_recording()
        # Children are only ever started under a recorded root: skip the context otherwise.
        self._context = set_span_in_context(root) if self._recording else None
        self.traceparent = format_traceparent(root.get_span_context())

    def span(self, name: str) -> Any:
        if not self._recording:
            return super().span(name)
        return self._tracer.start_span(name, self._context)  # ends when the block exits

    def since_start(self, name: str) -> None:
        if self._recording:
            start = getattr(self._root, "start_time", None)
            self._tracer.start_span(name, self._context, start_time=start).end()

    def start(self, name: str) -> Stage:
        if not self._recording:
            return _Unsampled(self.traceparent) if self.traceparent else NO_STAGE
        return _OpenStage(self._tracer.start_span(name, self._context, kind=SpanKind.PRODUCER))

    def exemplar(self) -> Exemplar | None:
        return _exemplar(self._root.get_span_context()) if self._recording else None

    def end(self, status: int) -> None:
        if not self._recording:
            return
        self._root.set_attribute("http.response.status_code", status)
        if status >= 500:
            self._root.set_status(Status(StatusCode.ERROR))
        self._root.end()


class OtelTracer(Tracer):
    enabled = True

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self._tracer = provider.get_tracer(SCOPE)
        # Worker spans are recorded from monotonic times; this maps them to the epoch.
        self._epoch_offset_ns = time.time_ns() - time.monotonic_ns()

    @classmethod
    def from_environ(
        cls, environ: Mapping[str, str], service: str, exporters: Sequence[str]
    ) -> OtelTracer:
        resource = Resource.create()
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            # Only when neither OTEL_SERVICE_NAME nor OTEL_RESOURCE_ATTRIBUTES names one.
            resource = resource.merge(Resource({SERVICE_NAME: service}))
        provider = TracerProvider(resource=resource)  # the sampler comes from OTEL_TRACES_SAMPLER
        for name in exporters:
            provider.add_span_processor(BatchSpanProcessor(exporter(name, environ)))
        return cls(provider)

    def _ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._epoch_offset_ns

    def request(
        self, name: str, traceparent: str | None, attributes: Mapping[str, str]
    ) -> RequestTrace:
        parent = parse_traceparent(traceparent)
        context = _under(parent) if parent is not None else Context()
        root = self._tracer.start_span(name, context, kind=SpanKind.SERVER, attributes=attributes)
        return _Request(self._tracer, root)

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
        sampled = [(c, read_at) for c, read_at in ((_sampled(t), r) for t, r in requests) if c]
        if not sampled:
            return None
        started_ns = self._ns(started)
        for context, read_at in sampled:
            self._tracer.start_span(
                "batch wait",
                _under(context),
                kind=SpanKind.CONSUMER,
                start_time=self._ns(read_at),
                attributes={"inferq.model": model, "inferq.worker": worker},
            ).end(end_time=started_ns)
        inference = self._tracer.start_span(
            "inference",
            _under(sampled[0][0]),
            links=[Link(context) for context, _ in sampled],
            start_time=started_ns,
            attributes={
                "inferq.model": model,
                "inferq.worker": worker,
                "inferq.batch.requests": len(requests),
                "inferq.batch.rows": rows,
            },
        )
        if failed:
            inference.set_status(Status(StatusCode.ERROR, "the model call failed"))
        inference.end(end_time=self._ns(finished))
        context = inference.get_span_context()
        return _exemplar(context) if context.trace_flags.sampled else None

    def result_written(self, traceparent: str | None, finished: float, written: float) -> None:
        context = _sampled(traceparent)
        if context is not None:
            self._tracer.start_span(
                "result write",
                _under(context),
                kind=SpanKind.PRODUCER,
                start_time=self._ns(finished),
            ).end(end_time=self._ns(written))

    def shutdown(self) -> None:
        self.provider.shutdown()

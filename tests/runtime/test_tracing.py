"""Tracing's switch and its two implementations: the no-op that runs unless the OTEL_* variables
ask for traces, and the SDK-backed tracer (sampling, propagation, batch links, exemplars)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from runtime import tracing
from tests.support import missing

try:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

    from runtime.otel import OtelTracer, format_traceparent, parse_traceparent
except ImportError:  # pragma: no cover - the otel extra is part of dev
    missing("the otel extra (pip install -e '.[otel]')", module=True)

SAMPLED = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
UNSAMPLED = "00-5bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"


@pytest.fixture(autouse=True)
def _restore_tracer() -> Iterator[None]:
    previous = tracing.current()
    yield
    tracing.install(previous).shutdown()


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, []),
        ({"OTEL_TRACES_EXPORTER": "none"}, []),
        ({"OTEL_TRACES_EXPORTER": "otlp, console"}, ["otlp", "console"]),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, []),
    ],
)
def test_tracing_is_on_only_when_the_otel_variables_name_an_exporter(environ, expected):
    assert tracing.exporters(environ) == expected


def test_without_otel_variables_the_process_gets_the_no_op_tracer():
    tracer = tracing.configure({}, "inferq-gateway")
    assert tracing.current() is tracer and type(tracer) is tracing.Tracer and not tracer.enabled
    trace = tracing.REQUEST_TRACE.get()
    assert trace is tracing.NO_REQUEST and trace.traceparent is None
    with trace.span("cache lookup"):
        pass
    stage = trace.start("queue wait")
    assert stage.propagate(SAMPLED) == SAMPLED  # untraced, the message carries what it had
    assert trace.exemplar() is None
    assert (
        tracer.batch(
            model="m",
            worker="w",
            requests=[(SAMPLED, 0.0)],
            started=0,
            finished=1,
            rows=1,
            failed=False,
        )
        is None
    )


def test_configured_exporters_give_an_sdk_tracer_named_for_the_process(monkeypatch):
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    tracer = tracing.configure({"OTEL_TRACES_EXPORTER": "console"}, "inferq-worker")
    assert isinstance(tracer, OtelTracer) and tracer.enabled
    assert tracer.provider.resource.attributes["service.name"] == "inferq-worker"


def test_otel_service_name_wins_over_the_default(monkeypatch):
    monkeypatch.setenv("OTEL_SERVICE_NAME", "edge-gateway")
    tracer = tracing.configure({"OTEL_TRACES_EXPORTER": "console"}, "inferq-gateway")
    assert isinstance(tracer, OtelTracer)
    assert tracer.provider.resource.attributes["service.name"] == "edge-gateway"


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin-v9"}, "no installed package provides"),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
            "not supported",
        ),
    ],
)
def test_an_exporter_that_cannot_be_set_up_is_a_clear_error(environ, message):
    with pytest.raises(tracing.TracingError, match=message):
        tracing.configure(environ, "inferq-gateway")


@pytest.mark.parametrize(
    "bad",
    [
        None,
        "",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        "00-4bf92f3577b34da6a3ce929d0e0e473x-00f067aa0ba902b7-01",
    ],
)
def test_malformed_traceparents_are_ignored(bad):
    assert parse_traceparent(bad) is None


def test_a_traceparent_round_trips():
    assert format_traceparent(parse_traceparent(SAMPLED)) == SAMPLED
    assert format_traceparent(parse_traceparent(UNSAMPLED)) == UNSAMPLED


def sdk_tracer(sampler=None) -> tuple[OtelTracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = OtelTracer(provider)
    tracing.install(tracer)
    return tracer, exporter


def test_an_unsampled_request_records_nothing_and_says_so_downstream():
    tracer, exporter = sdk_tracer(ParentBased(ALWAYS_OFF))
    trace = tracer.request("POST infer", None, {})
    assert trace.traceparent is not None
    assert int(trace.traceparent[-2:], 16) & 1 == 0  # the sampled flag is off
    with trace.span("cache lookup"):
        trace.since_start("receive and validate")
    stage = trace.start("queue wait")
    assert stage.propagate(None) == trace.traceparent
    stage.end()
    trace.end(200)
    assert trace.exemplar() is None
    assert exporter.get_finished_spans() == ()


def test_a_batch_is_one_inference_span_linked_to_each_sampled_request():
    tracer, exporter = sdk_tracer()
    other = "00-6bf92f3577b34da6a3ce929d0e0e4736-10f067aa0ba902b7-01"
    exemplar = tracer.batch(
        model="m",
        worker="w1",
        requests=[(UNSAMPLED, 1.0), (SAMPLED, 1.5), (None, 1.5), (other, 2.0)],
        started=3.0,
        finished=3.25,
        rows=7,
        failed=True,
    )
    spans = exporter.get_finished_spans()
    waits = [s for s in spans if s.name == "batch wait"]
    (inference,) = [s for s in spans if s.name == "inference"]
    assert [f"{s.parent.span_id:016x}" for s in waits] == ["00f067aa0ba902b7", "10f067aa0ba902b7"]
    assert [w.end_time - w.start_time for w in waits] == [1_500_000_000, 1_000_000_000]
    assert f"{inference.context.trace_id:032x}" == SAMPLED.split("-")[1]  # the first sampled one
    assert [f"{link.context.trace_id:032x}" for link in inference.links] == [
        SAMPLED.split("-")[1],
        other.split("-")[1],
    ]
    assert inference.end_time - inference.start_time == 250_000_000
    assert inference.attributes["inferq.batch.requests"] == 4
    assert inference.attributes["inferq.batch.rows"] == 7
    assert not inference.status.is_ok
    assert exemplar == {"trace_id": SAMPLED.split("-")[1]}


def test_a_batch_of_unsampled_requests_builds_no_span():
    tracer, exporter = sdk_tracer()
    assert (
        tracer.batch(
            model="m",
            worker="w",
            requests=[(UNSAMPLED, 0.0)],
            started=1,
            finished=2,
            rows=1,
            failed=False,
        )
        is None
    )
    tracer.result_written(UNSAMPLED, 2.0, 2.5)
    assert exporter.get_finished_spans() == ()
    tracer.result_written(SAMPLED, 2.0, 2.5)
    (written,) = exporter.get_finished_spans()
    assert written.name == "result write" and f"{written.parent.span_id:016x}" == "00f067aa0ba902b7"

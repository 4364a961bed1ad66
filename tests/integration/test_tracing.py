"""OpenTelemetry traces across the queue: one connected trace per request (and per job), from
the gateway's server span through the worker's batch, inference and result-write spans.

In-process stacks use the SDK's in-memory exporter; the last test runs real `inferq up`
processes configured only by OTEL_* variables and exporting to an OTLP receiver in this process.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from inferq.redisserver import free_port
from runtime import tracing
from tests.support import (
    GatewayThread,
    Stack,
    WorkerThread,
    missing,
    sim_body,
    wait_until,
    write_simulated_model,
)

try:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind

    from runtime.otel import OtelTracer
    from tests.otlp import OtlpReceiver, ReceivedSpan
except ImportError:  # pragma: no cover - the otel extra is part of dev
    missing("the otel extra (pip install -e '.[otel]')", module=True)

pytestmark = [pytest.mark.integration]

GATEWAY_SPANS = {
    "POST infer",
    "receive and validate",
    "cache lookup",
    "queue wait",
    "encode response",
}
WORKER_SPANS = {"batch wait", "inference", "result write"}
CALLER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    write_simulated_model(tmp_path, "echo", base_ms=1, per_row_ms=0, max_batch=8, cache=True)
    return tmp_path


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    """Every span the gateway and worker built in this process (sampler: parent-based, on)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    previous = tracing.install(OtelTracer(provider))
    yield exporter
    tracing.install(previous)
    provider.shutdown()


@pytest.fixture
def traced_stack(exported, redis_url, namespace, repo) -> Iterator[Stack]:
    started: list[GatewayThread | WorkerThread] = []
    s = Stack(redis_url, namespace, repo, started)
    s.add_worker(("echo",), metrics_port=free_port())
    s.start_gateway(grpc_port=free_port())
    s.wait_ready("echo")
    yield s
    for thing in reversed(started):
        thing.stop()


def hexid(span: ReadableSpan) -> str:
    return f"{span.context.span_id:016x}"


def by_name(spans: list[ReadableSpan]) -> dict[str, ReadableSpan]:
    named = {s.name: s for s in spans}
    assert len(named) == len(spans), [s.name for s in spans]
    return named


def spans_of(exporter: InMemorySpanExporter, trace_id: str, names: set[str]) -> list[ReadableSpan]:
    def mine() -> list[ReadableSpan]:
        return [
            s for s in exporter.get_finished_spans() if f"{s.context.trace_id:032x}" == trace_id
        ]

    wait_until(lambda: {s.name for s in mine()} >= names, what=f"spans {sorted(names)}")
    return mine()


def test_one_request_is_one_trace_from_the_callers_span_through_the_worker(traced_stack, exported):
    r = traced_stack.infer("echo", sim_body(2.0), traceparent=CALLER)
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [8.0]
    trace_id = CALLER.split("-")[1]
    spans = by_name(spans_of(exported, trace_id, GATEWAY_SPANS | WORKER_SPANS))
    assert set(spans) == GATEWAY_SPANS | WORKER_SPANS

    root = spans["POST infer"]
    assert root.kind is SpanKind.SERVER
    assert f"{root.parent.span_id:016x}" == CALLER.split("-")[2]  # the caller's span
    assert root.attributes["http.response.status_code"] == 200
    assert r.headers["traceparent"] == f"00-{trace_id}-{hexid(root)}-01"
    for name in ("receive and validate", "cache lookup", "queue wait", "encode response"):
        assert spans[name].parent.span_id == root.context.span_id, name

    queued = spans["queue wait"]
    for name in WORKER_SPANS:
        assert spans[name].parent.span_id == queued.context.span_id, name
        assert spans[name].parent.is_remote, name  # it came across the queue
    (link,) = spans["inference"].links
    assert link.context.span_id == queued.context.span_id
    assert spans["inference"].attributes["inferq.batch.requests"] == 1
    for s in spans.values():
        assert s.start_time <= s.end_time, s.name


def test_a_cache_hit_is_traced_without_a_queue(traced_stack, exported):
    assert traced_stack.infer("echo", sim_body(3.0)).status_code == 200
    r = traced_stack.infer("echo", sim_body(3.0))
    assert r.headers["x-inferq-cache"] == "hit"
    trace_id = r.headers["traceparent"].split("-")[1]
    names = {"POST infer", "receive and validate", "cache lookup", "encode response"}
    assert {s.name for s in spans_of(exported, trace_id, names)} == names


def test_a_job_is_one_trace_from_submission_to_completion(traced_stack, exported):
    with traced_stack.client() as c:
        r = c.post("/v2/models/echo/jobs", json=sim_body(1.0))
        assert r.status_code == 202
        done = c.get(r.headers["location"], params={"wait": 10}).json()
    assert done["status"] == "succeeded"
    trace_id = r.headers["traceparent"].split("-")[1]
    names = {"POST job_submit", "receive and validate", "enqueue"} | WORKER_SPANS
    spans = by_name(spans_of(exported, trace_id, names))
    root, enqueue = spans["POST job_submit"], spans["enqueue"]
    assert root.parent is None
    assert enqueue.parent.span_id == root.context.span_id
    for name in WORKER_SPANS:
        assert spans[name].parent.span_id == enqueue.context.span_id, name


def test_a_grpc_call_is_one_trace_too(traced_stack, exported):
    import numpy as np
    import tritonclient.grpc as triton

    client = triton.InferenceServerClient(f"127.0.0.1:{traced_stack.gateway.settings.grpc_port}")
    x = triton.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.full((1, 4), 2.5, dtype=np.float32))
    result = client.infer("echo", [x], headers={"traceparent": CALLER})
    assert result.as_numpy("sum").tolist() == [[10.0]]
    client.close()
    names = {"grpc ModelInfer", "receive and validate", "queue wait", "encode response"}
    spans = by_name(spans_of(exported, CALLER.split("-")[1], names | WORKER_SPANS))
    root, queued = spans["grpc ModelInfer"], spans["queue wait"]
    assert f"{root.parent.span_id:016x}" == CALLER.split("-")[2]
    assert queued.parent.span_id == root.context.span_id
    for name in WORKER_SPANS:
        assert spans[name].parent.span_id == queued.context.span_id, name


def test_an_unsampled_caller_gets_no_spans_on_either_side(traced_stack, exported):
    unsampled = "00-5bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
    r = traced_stack.infer("echo", sim_body(4.0), traceparent=unsampled)
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [16.0]
    assert re.fullmatch(
        r"00-5bf92f3577b34da6a3ce929d0e0e4736-[0-9a-f]{16}-00", r.headers["traceparent"]
    )
    # A sampled request after it: once its spans are in, the unsampled one's would be too.
    sampled = traced_stack.infer("echo", sim_body(5.0))
    spans_of(exported, sampled.headers["traceparent"].split("-")[1], WORKER_SPANS)
    assert not [
        s
        for s in exported.get_finished_spans()
        if f"{s.context.trace_id:032x}".startswith("5bf92f")
    ]


def test_sampled_requests_label_the_latency_histograms_with_their_trace_id(traced_stack, exported):
    r = traced_stack.infer("echo", sim_body(6.0))
    trace_id = r.headers["traceparent"].split("-")[1]
    openmetrics = {"accept": "application/openmetrics-text; version=1.0.0"}
    spans_of(exported, trace_id, WORKER_SPANS)

    def exemplars(url: str, metric: str) -> set[str]:
        text = httpx.get(url, headers=openmetrics, timeout=10).text
        return set(
            re.findall(rf'^{metric}_bucket{{.*}} \S+ # {{trace_id="([0-9a-f]{{32}})"}}', text, re.M)
        )

    wait_until(
        lambda: (
            trace_id
            in exemplars(f"{traced_stack.url}/metrics", "inferq_gateway_request_duration_seconds")
        ),
        what="the gateway's exemplar",
    )
    port = traced_stack.workers[0].worker.settings.metrics_port
    assert trace_id in exemplars(
        f"http://127.0.0.1:{port}/metrics", "inferq_worker_inference_seconds"
    )


def render(spans: list[ReceivedSpan]) -> str:
    """The trace as an indented tree: service, span name, span id, parent id, duration."""
    ids = {s.span_id for s in spans}
    children: dict[str, list[ReceivedSpan]] = {}
    for s in sorted(spans, key=lambda s: s.start_ns):
        children.setdefault(s.parent_id if s.parent_id in ids else "", []).append(s)
    lines = [f"trace {spans[0].trace_id}"]

    def walk(parent: str, depth: int) -> None:
        for s in children.get(parent, []):
            link = f"  links {','.join(span for _, span in s.links)}" if s.links else ""
            lines.append(
                f"{'  ' * depth}{s.service:15} {s.name:22} span {s.span_id} "
                f"parent {s.parent_id or '-':16} {(s.end_ns - s.start_ns) / 1e6:7.3f} ms{link}"
            )
            walk(s.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)


@contextlib.contextmanager
def inferq_up(repo: Path, redis_url: str, namespace: str, env: dict[str, str]) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "inferq", "up",
            "--redis", redis_url,
            "--namespace", namespace,
            "--port", str(port),
            "--grpc-port", "0",
            "--metrics-port", "0",
            "--model-repository", str(repo),
            "--log-level", "warning",
        ],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: proc.poll() is not None or _ready(url), timeout_s=40, what="inferq up ready"
        )
        assert proc.poll() is None, "inferq up exited"
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_inferq_up_configured_only_by_otel_variables_exports_one_connected_trace(
    repo, redis_url, namespace
):
    with OtlpReceiver() as receiver:
        env = {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
            "OTEL_BSP_SCHEDULE_DELAY": "50",  # export within 50 ms, not the default 5 s
        }
        with inferq_up(repo, redis_url, namespace, env) as url:
            r = httpx.post(f"{url}/v2/models/echo/infer", json=sim_body(7.0), timeout=10)
            assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [28.0]
            trace_id = r.headers["traceparent"].split("-")[1]

            def mine() -> list[ReceivedSpan]:
                return [s for s in receiver.received() if s.trace_id == trace_id]

            wait_until(
                lambda: {s.name for s in mine()} >= GATEWAY_SPANS | WORKER_SPANS,
                what="the gateway's and the worker's spans at the receiver",
            )
    spans = {s.name: s for s in mine()}
    assert len(spans) == len(mine()) == 8
    root, queued = spans["POST infer"], spans["queue wait"]
    assert root.parent_id == "" and root.service == "inferq-gateway"
    for name in GATEWAY_SPANS - {"POST infer"}:
        assert (spans[name].service, spans[name].parent_id) == ("inferq-gateway", root.span_id)
    for name in WORKER_SPANS:
        assert (spans[name].service, spans[name].parent_id) == ("inferq-worker", queued.span_id)
    assert spans["inference"].links == ((trace_id, queued.span_id),)
    print("\n" + render(mine()))

"""What tracing costs the gateway: CPU per request with tracing off, sampled at 1 %, and at 100 %.

    python bench/tracing_cost.py [--requests 5000] [--concurrency 8] [--rounds 2]

For each mode, a fresh `inferq up` (1 gateway, 1 worker, the real digits model, cache bypassed)
on a private redis-server, configured only through the standard OTEL_* variables:

* ``off``: no OTEL_* variable (the default: the no-op tracer, no tracing middleware);
* ``1 %``: ``OTEL_TRACES_SAMPLER=parentbased_traceidratio``, ``OTEL_TRACES_SAMPLER_ARG=0.01``;
* ``100 %``: the same sampler with ``OTEL_TRACES_SAMPLER_ARG=1.0``;

the traced modes export over OTLP/HTTP (``OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf``) to a
receiver in this process (``bench/otlp.py``), batched every 200 ms. After 1 s of warm-up, a
closed loop sends exactly ``--requests`` requests; the gateway's CPU time (user + system, from
/proc) is read before and after, the "after" once the receiver has stopped getting spans, so the
export of every span is counted. The requests carry no traceparent: the gateway's sampler
decides. Modes alternate over ``--rounds`` so drift on the shared machine hits each alike.

First, the parts in this process (``--parts-only`` stops there), CPU time per request over
20,000 simulated requests, so the end-to-end figures can be told apart from machine noise: the
calls the handlers make when tracing is off; the tracing middleware and the SDK's sampling
decision for an unsampled request (1 % sampler); and a sampled request's five gateway spans
built, then also handed to a batch processor, then also encoded as OTLP protobuf.
Writes bench/results/tracing_cost.json. Loopback only; about 15 s per mode and round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    Service,
    closed_loop,
    cpu_seconds,
    digits_body,
    fmt,
    git_revision,
    infer_request,
    markdown_table,
    save,
    wait_for_quiet,
)
from bench.otlp import OtlpReceiver

MODES: dict[str, dict[str, str]] = {
    "off": {},
    "1 %": {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"},
    "100 %": {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.0"},
}


def otel_environment(receiver: OtlpReceiver, sampler: dict[str, str]) -> dict[str, str]:
    if not sampler:
        return {}
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        **sampler,
    }


def settled(receiver: OtlpReceiver, timeout_s: float = 10.0) -> None:
    """Until no span has arrived for 0.6 s (three export periods)."""
    deadline = time.monotonic() + timeout_s
    seen, quiet_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now = len(receiver.received())
        if now != seen:
            seen, quiet_since = now, time.monotonic()
        elif time.monotonic() - quiet_since >= 0.6:
            return
        time.sleep(0.1)


def measure(mode: str, requests: int, concurrency: int) -> dict[str, Any]:
    request = infer_request("digits", digits_body())
    with OtlpReceiver() as receiver:
        env = otel_environment(receiver, MODES[mode])
        for name in [k for k in os.environ if k.startswith("OTEL_")]:
            del os.environ[name]
        os.environ.update(env)  # `inferq up` hands its environment to the gateway and worker
        try:
            with Service() as service:
                roles = service.processes()
                (gateway,) = [pid for pid, role in roles.items() if role == "gateway"]
                (worker,) = [pid for pid, role in roles.items() if role == "worker"]
                closed_loop(service, request, concurrency=concurrency, duration_s=1, warmup_s=0)
                settled(receiver)
                spans_before = len(receiver.received())
                cpu_before = cpu_seconds(gateway), cpu_seconds(worker)
                result = run_exactly(service, request, requests, concurrency)
                settled(receiver)
                gateway_s = cpu_seconds(gateway) - cpu_before[0]
                worker_s = cpu_seconds(worker) - cpu_before[1]
                spans = receiver.received()[spans_before:]
        finally:
            for name in env:
                del os.environ[name]
    traces = {s.trace_id for s in spans}
    return {
        "mode": mode,
        "requests": result.requests,
        "ok": result.ok,
        "req_per_s": result.ok_rps,
        "p50_ms": (result.latency_ms or {}).get("p50"),
        "gateway_cpu_us_per_request": gateway_s / max(result.requests, 1) * 1e6,
        "worker_cpu_us_per_request": worker_s / max(result.requests, 1) * 1e6,
        "traces_exported": len(traces),
        "spans_exported": len(spans),
        "environment": {k: v for k, v in env.items() if k != "OTEL_EXPORTER_OTLP_ENDPOINT"},
    }


def run_exactly(service: Service, request: Any, requests: int, concurrency: int) -> Any:
    from loadgen.closed import run_closed_loop
    from loadgen.http import run as run_loop
    from loadgen.loop import LoadOptions

    options = LoadOptions(
        service.url + request.path,
        duration_s=120,
        requests=request,
        warmup_s=0,
        max_requests=requests,
    )
    return run_loop(run_closed_loop(options, concurrency))


def _handler_calls() -> None:
    """What the gateway's handlers call on the request's trace, in order (service.py, app.py)."""
    from runtime.tracing import REQUEST_TRACE

    trace = REQUEST_TRACE.get()
    trace.since_start("receive and validate")
    with trace.span("cache lookup"):
        pass
    queued = trace.start("queue wait")
    queued.propagate("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    queued.end()
    with REQUEST_TRACE.get().span("encode response"):
        pass


def in_process_parts(n: int = 20_000) -> dict[str, float]:
    """CPU µs per request of each part of tracing, measured in this process (over what an
    ASGI app that only answers costs)."""
    import asyncio

    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    from producer.instrument import Instrument
    from runtime.otel import OtelTracer

    class Encode(SpanExporter):
        def __init__(self, encode: bool) -> None:
            self.encode = encode

        def export(self, spans: Any) -> SpanExportResult:
            if self.encode:
                encode_spans(spans).SerializeToString()
            return SpanExportResult.SUCCESS

    async def bare(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200})

    async def app(scope: Any, receive: Any, send: Any) -> None:
        _handler_calls()
        await send({"type": "http.response.start", "status": 200})

    async def nothing(*_: Any) -> Any:
        return {}

    scope = {"type": "http", "path": "/v2/models/digits/infer", "method": "POST", "headers": []}

    def cpu_us(asgi: Any, provider: TracerProvider | None = None) -> float:
        async def loop() -> None:
            for _ in range(n):
                await asgi(scope, nothing, nothing)

        started = time.process_time()
        asyncio.run(loop())
        if provider is not None:
            provider.force_flush()
        return (time.process_time() - started) / n * 1e6

    class Uncounted:
        """A gateway whose registry knows no model and whose metrics count nothing: the
        instrumentation below then costs its tracing and no more."""

        registry = type("Registry", (), {"models": {}})()
        metrics = type("Metrics", (), {"observe_request": lambda *_, **__: None})()

    def traced(ratio: float, exporter: SpanExporter | None) -> tuple[Any, TracerProvider]:
        provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(ratio)))
        if exporter is not None:
            # A queue that holds every span: none is dropped, so all are counted.
            batch = BatchSpanProcessor(exporter, max_queue_size=6 * n, schedule_delay_millis=200)
            provider.add_span_processor(batch)
        instrument = Instrument(Uncounted(), OtelTracer(provider))  # type: ignore[arg-type]

        async def observed(scope: Any, receive: Any, send: Any) -> None:
            """What the infer fast path does around the handlers (producer.fastpath)."""
            seen = instrument.start("infer", "digits", None)
            seen.trace_http(scope, "infer", "digits", None)
            await app(scope, receive, send)
            seen.end(200)

        return observed, provider

    baseline = cpu_us(bare)  # the loop and an app that only answers: subtracted from each
    parts = {"off: the handlers' calls (no middleware)": cpu_us(app) - baseline}
    for name, ratio, exporter in [
        ("1 %: middleware and sampling decision (spans not exported)", 0.01, None),
        ("100 %: five spans built, no processor", 1.0, None),
        ("100 %: built and batched (export dropped)", 1.0, Encode(False)),
        ("100 %: built, batched and encoded as OTLP protobuf", 1.0, Encode(True)),
    ]:
        asgi, provider = traced(ratio, exporter)
        parts[name] = cpu_us(asgi, provider) - baseline
        provider.shutdown()
    return parts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--parts-only", action="store_true")
    args = parser.parse_args(argv)
    command = "python bench/tracing_cost.py " + " ".join(argv or sys.argv[1:])
    wait_for_quiet()
    parts = in_process_parts()
    print(markdown_table(["in this process", "CPU µs/request"], [[k, v] for k, v in parts.items()]))
    if args.parts_only:
        return 0
    rows: list[dict[str, Any]] = []
    for round_ in range(1, args.rounds + 1):
        for mode in MODES:
            row = measure(mode, args.requests, args.concurrency) | {"round": round_}
            rows.append(row)
            print(
                f"round {round_} {mode:>5}: {row['gateway_cpu_us_per_request']:.0f} µs gateway "
                f"CPU/request, {row['req_per_s']:.0f} req/s, {row['traces_exported']} traces",
                flush=True,
            )

    def median(mode: str) -> float:
        return float(
            statistics.median(r["gateway_cpu_us_per_request"] for r in rows if r["mode"] == mode)
        )

    baseline = median("off")
    table = markdown_table(
        [
            "round",
            "tracing",
            "requests",
            "req/s",
            "P50 ms",
            "gateway CPU µs/request",
            "vs off",
            "worker CPU µs/request",
            "traces exported",
        ],
        [
            [
                r["round"],
                r["mode"],
                r["requests"],
                r["req_per_s"],
                r["p50_ms"],
                fmt(r["gateway_cpu_us_per_request"], 0),
                f"{r['gateway_cpu_us_per_request'] / baseline:.2f}x",
                fmt(r["worker_cpu_us_per_request"], 0),
                r["traces_exported"],
            ]
            for r in rows
        ],
    )
    summary = markdown_table(
        ["tracing", "gateway CPU µs/request (median)", "vs off", "added µs/request"],
        [
            [
                mode,
                fmt(median(mode), 0),
                f"{median(mode) / median('off'):.2f}x",
                fmt(median(mode) - median("off"), 0),
            ]
            for mode in MODES
        ],
    )
    print(f"\n{table}\n\n{summary}\n\ngit {git_revision()}; command: {command}")
    save(
        "tracing_cost",
        {
            "git": git_revision(),
            "command": command,
            "parts_us": parts,
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

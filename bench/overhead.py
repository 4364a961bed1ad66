"""Queue overhead: P50/P99 at low load through inferq vs the same model called in-process.

    python bench/overhead.py [--duration 8] [--rate 50]

One `inferq up` (1 gateway, 1 worker) on a private redis-server serves two models:

* ``digits``: the real ONNX model (a single row costs microseconds in-process), so what
  inferq adds is almost the whole latency;
* ``gpu``: the simulated backend, 5 ms + 0.05 ms per row (sleeping), a GPU-like model whose
  own cost dominates: what does the queue add on top of a real inference time?

For each model: the backend called in-process on one row (configured as the worker configures
it) for P50/P99; then through HTTP and the queue at low load, two ways: a closed loop with one
connection (each request waits for the previous one), and an open loop of Poisson arrivals at
RATE req/s (latency from the intended send time). Redis commands per request come from
``INFO commandstats`` over the closed-loop run (all commands: gateway, worker, heartbeats),
cache bypassed. Writes bench/results/overhead.json. Loopback only; bounded in time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    DIGITS_SAMPLES,
    Service,
    calls_between,
    closed_loop,
    command_calls,
    digits_body,
    fmt,
    infer_request,
    markdown_table,
    model_repository,
    open_loop,
    save,
    wait_for_quiet,
)
from loadgen.stats import LatencyHistogram
from tests.support import sim_body

GPU = {"base_ms": 5.0, "per_row_ms": 0.05, "max_batch": 32, "flush_ms": 2.0}


def in_process(repo: Path, model: str, seconds: float, max_calls: int) -> dict[str, float]:
    """P50/P99 of the backend's ``predict`` on one row, called in a loop in this process."""
    from consumer.backends import create_backend
    from consumer.repository import load_config

    config = load_config(repo, model)
    backend = create_backend(config, config.versions[-1])
    backend.load()
    spec = config.inputs[0]
    width = int(np.prod([d for d in spec.shape[1:] if d > 0], dtype=np.int64))
    row = DIGITS_SAMPLES["inputs"][0] if model == "digits" else [1.0] * width
    inputs = {spec.name: np.array([row], dtype=np.float32)}
    hist = LatencyHistogram()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end and hist.count < max_calls:
        t = time.perf_counter()
        backend.predict(inputs)
        hist.record(time.perf_counter() - t)
    backend.unload()
    return {
        "calls": hist.count,
        "p50_ms": hist.percentile(50) * 1e3,
        "p99_ms": hist.percentile(99) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per measurement")
    parser.add_argument("--rate", type=float, default=50.0, help="open-loop req/s (low load)")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    bodies = {"digits": digits_body(), "gpu": sim_body(1.0)}
    with model_repository(digits=True, gpu=GPU) as repo:
        ceilings = {m: in_process(repo, m, 3.0, 200_000) for m in bodies}
        idle = wait_for_quiet()
        with Service("--model-repository", str(repo)) as svc:
            for model in bodies:
                svc.wait_for_workers(model, 1)
            for model, body in bodies.items():
                request = infer_request(model, body)
                before = command_calls(svc.redis.url)
                closed = closed_loop(svc, request, concurrency=1, duration_s=args.duration)
                calls = calls_between(before, command_calls(svc.redis.url))
                sent = closed.requests + closed.warmup_requests
                opened = open_loop(svc, request, rate=args.rate, duration_s=args.duration)
                row: dict[str, Any] = {
                    "model": model,
                    "in_process": ceilings[model],
                    "closed_c1": {
                        "rps": closed.ok_rps,
                        "p50_ms": closed.latency_ms["p50"],
                        "p99_ms": closed.latency_ms["p99"],
                        "errors": closed.errors,
                    },
                    "open": {
                        "rate": args.rate,
                        "p50_ms": opened.latency_ms["p50"],
                        "p99_ms": opened.latency_ms["p99"],
                        "service_p50_ms": (opened.service_ms or {}).get("p50"),
                        "service_p99_ms": (opened.service_ms or {}).get("p99"),
                        "send_lag_p99_ms": (opened.send_lag_ms or {}).get("p99"),
                        "errors": opened.errors,
                    },
                    "redis_commands_per_request": sum(calls.values()) / max(sent, 1),
                    "commands": {k: round(v / max(sent, 1), 3) for k, v in calls.items()},
                    "machine_idle_before": idle,
                }
                rows.append(row)
                print(
                    f"{model:<6} in-process p50 {ceilings[model]['p50_ms']:.3f} ms | inferq c=1 "
                    f"p50 {fmt(row['closed_c1']['p50_ms'])} p99 {fmt(row['closed_c1']['p99_ms'])}"
                    f" | open {args.rate:g}/s p50 {fmt(row['open']['p50_ms'])} "
                    f"p99 {fmt(row['open']['p99_ms'])} | "
                    f"{row['redis_commands_per_request']:.2f} Redis cmds/req",
                    flush=True,
                )

    table = [
        [
            r["model"],
            f"{r['in_process']['p50_ms']:.3f}",
            f"{r['in_process']['p99_ms']:.3f}",
            fmt(r["closed_c1"]["p50_ms"]),
            fmt(r["closed_c1"]["p99_ms"]),
            fmt(r["open"]["p50_ms"]),
            fmt(r["open"]["p99_ms"]),
            fmt(r["closed_c1"]["p50_ms"] - r["in_process"]["p50_ms"]),
            f"{r['redis_commands_per_request']:.2f}",
        ]
        for r in rows
    ]
    headers = [
        "model",
        "in-process P50 ms",
        "in-process P99 ms",
        "inferq c=1 P50 ms",
        "inferq c=1 P99 ms",
        f"inferq open {args.rate:g}/s P50 ms",
        f"inferq open {args.rate:g}/s P99 ms",
        "added at P50 ms",
        "Redis cmds / request",
    ]
    print()
    print(markdown_table(headers, table))
    print("\nratios (measured side by side in this run):")
    for r in rows:
        ip, c1 = r["in_process"], r["closed_c1"]
        print(
            f"  {r['model']}: inferq/in-process at P50 {c1['p50_ms'] / ip['p50_ms']:.1f}x "
            f"(+{c1['p50_ms'] - ip['p50_ms']:.2f} ms), at P99 {c1['p99_ms'] / ip['p99_ms']:.1f}x "
            f"(+{c1['p99_ms'] - ip['p99_ms']:.2f} ms); open-loop P99/P50 "
            f"{r['open']['p99_ms'] / r['open']['p50_ms']:.2f}"
        )
    result = {
        "simulated_model": GPU,
        "duration_s": args.duration,
        "rows": rows,
    }
    print(f"\nwrote {save('overhead', result)}")


if __name__ == "__main__":
    main()

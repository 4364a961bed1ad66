"""Dynamic batching: saturation throughput with max_batch 1, 8, 32 and 128.

    python bench/batching.py [--batches 1,8,32,128] [--duration 5] [--concurrency 256]

Two models, each served by `inferq up` (1 gateway, 1 worker) on a private redis-server, restarted
for every max_batch (the worker's ``--max-batch`` flag):

* ``gpu``: the simulated backend with a GPU-like cost, a batch takes 5 ms + 0.05 ms per row,
  sleeping (no CPU), so the model alone could serve ``B / (5 + 0.05 B)`` requests per ms;
* ``digits``: the real ONNX model on the CPU (7 us a row in-process): here the serving layers
  are the cost, and batching amortises the worker's per-batch work;
* ``medium``: a real ONNX network on the CPU (``bench/medium_model.py``, 1024→2048→2048→2048→1000,
  random weights, one intra-op thread), where the model is most of the cost: the real-model
  figure beside the simulated ``gpu`` one (max_batch is capped at the model's 32).

Tables label the simulated model as such.

Saturation is a closed loop at high concurrency (default 256 connections, so at every
max_batch more requests are waiting than one batch takes), 1 s warm-up, then DURATION s
measured, cache bypassed. It prints a table (with the CPU the gateway and the worker used,
in cores, sampled from /proc), the ratios against max_batch 1 and the model-bound ceiling, and
writes bench/results/batching.json. Loopback only; bounded in time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import medium_model
from bench.common import (
    CpuMeter,
    Service,
    closed_loop,
    digits_body,
    fmt,
    infer_request,
    markdown_table,
    model_repository,
    save,
    wait_for_quiet,
)
from tests.support import sim_body

GPU = {"base_ms": 5.0, "per_row_ms": 0.05, "max_batch": 128, "flush_ms": 2.0}


LABELS = {"gpu": "gpu (simulated: sleeps)", "digits": "digits (real)", "medium": "medium (real)"}


def _medium_body() -> dict[str, Any]:
    row = [round(0.001 * (i % 1000), 3) for i in range(medium_model.LAYERS[0])]
    return {
        "inputs": [
            {"name": "input", "datatype": "FP32", "shape": [1, len(row)], "data": row},
        ]
    }


BODIES = {"gpu": lambda: sim_body(1.0), "digits": digits_body, "medium": _medium_body}


def model_ceiling(max_batch: int) -> float:
    """Requests/s the simulated model alone sustains with full batches."""
    return max_batch / (GPU["base_ms"] + GPU["per_row_ms"] * max_batch) * 1000


def measure(
    repo: Path, model: str, body: dict[str, Any], max_batch: int, args: argparse.Namespace
) -> dict[str, Any]:
    extra = ("--model-repository", str(repo), "--models", model, "--max-batch", str(max_batch))
    idle = wait_for_quiet()
    with Service(*extra) as svc:
        svc.wait_for_workers(model, 1)
        meter = CpuMeter(svc.processes())
        meter.start()
        r = closed_loop(
            svc,
            infer_request(model, body),
            concurrency=args.concurrency,
            duration_s=args.duration,
            warmup_s=args.warmup,
        )
        cores = meter.stop()
    row = {
        "model": model,
        "max_batch": max_batch,
        "concurrency": args.concurrency,
        "rps": r.ok_rps,
        "p50_ms": r.latency_ms["p50"],
        "p99_ms": r.latency_ms["p99"],
        "errors": r.errors,
        "client_cpu_share": r.client_cpu_share,
        "gateway_cores": cores.get("gateway", 0.0),
        "worker_cores": cores.get("worker", 0.0),
        "machine_idle_before": idle,
    }
    if model == "gpu":
        row["model_ceiling_rps"] = model_ceiling(max_batch)
    print(
        f"{model:<6} max_batch {max_batch:>3}: {r.ok_rps:8,.0f} req/s  p50 {fmt(row['p50_ms'])} ms"
        f"  p99 {fmt(row['p99_ms'])} ms  gateway {row['gateway_cores']:.2f} cores, worker "
        f"{row['worker_cores']:.2f}  errors {r.errors or 0}",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32,128", help="max_batch values")
    parser.add_argument("--models", default="gpu,digits,medium", help="gpu, digits, medium")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds measured per run")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=256)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    models = [m for m in args.models.split(",") if m]
    rows: list[dict[str, Any]] = []
    with model_repository(digits="digits" in models, medium="medium" in models, gpu=GPU) as repo:
        for model in models:
            for b in batches:
                if model == "medium" and b > medium_model.MAX_BATCH:
                    continue  # the model's own cap: the worker would run it at 32 anyway
                rows.append(measure(repo, model, BODIES[model](), b, args))

    table = []
    for row in rows:
        base = next(x for x in rows if x["model"] == row["model"] and x["max_batch"] == batches[0])
        ceiling = row.get("model_ceiling_rps")
        table.append(
            [
                LABELS[row["model"]],
                row["max_batch"],
                fmt(row["rps"], 0),
                f"{row['rps'] / base['rps']:.1f}x",
                fmt(row["p50_ms"]),
                fmt(row["p99_ms"]),
                fmt(ceiling, 0),
                "-" if ceiling is None else f"{row['rps'] / ceiling:.0%}",
                f"{row['gateway_cores']:.2f}",
                f"{row['worker_cores']:.2f}",
            ]
        )
    headers = [
        "model",
        "max_batch",
        "req/s",
        f"vs max_batch {batches[0]}",
        "P50 ms",
        "P99 ms",
        "model-bound req/s",
        "of model bound",
        "gateway cores",
        "worker cores",
    ]
    print()
    print(markdown_table(headers, table))
    print("\nratios (measured side by side in this run):")
    for model in models:
        by = {r["max_batch"]: r for r in rows if r["model"] == model}
        for b in batches[1:]:
            if b not in by:
                continue
            print(
                f"  {model}: max_batch {b} / max_batch {batches[0]}: "
                f"{by[b]['rps'] / by[batches[0]]['rps']:.1f}x"
            )
    result = {
        "labels": LABELS,
        "simulated_model": GPU,
        "concurrency": args.concurrency,
        "duration_s": args.duration,
        "rows": rows,
    }
    print(f"\nwrote {save('batching', result)}")


if __name__ == "__main__":
    main()

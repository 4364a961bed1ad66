"""Scale-out: throughput and P99 with 1, 2, 4 and 8 workers, against linear.

    python bench/scaleout.py [--workers 1,2,4,8] [--duration 6] [--per-worker-concurrency 32]

Each level is `inferq up --workers N` (1 gateway, N worker processes) on a private redis-server,
serving one simulated model ``accel``: a batch takes 50 ms + 1.25 ms per row with max_batch 8,
spent sleeping (no CPU), as an accelerator would. One worker can then serve at most
8 / 60 ms = 133 requests/s, and 8 workers 1,067 requests/s: about a third of what the gateway
handles on this 2-core machine (~3,500 requests/s of the digits model, bench/core.py), so the
gateway and Redis stay far from saturation and the figure measures the queue's scale-out, not
the shared CPUs. (With 5 ms + 0.05 ms/row and max_batch 32, one worker would already reach
4,800 req/s and every level would measure the gateway instead.)

The load is a closed loop with 32 connections per worker (four full batches each: one running,
one forming, two queued in Redis), so every worker always has a full batch waiting and, if
scaling is linear, latency stays flat (32 / 133 per s = 240 ms) while throughput grows N-fold.
2 s warm-up, DURATION s measured, cache off. Efficiency = throughput(N) / (N x throughput(1)).
CPU used by the gateway and by all workers (in cores) is sampled from /proc over each run.
Writes bench/results/scaleout.json. Loopback only; bounded in time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    CpuMeter,
    Service,
    closed_loop,
    fmt,
    infer_request,
    markdown_table,
    model_repository,
    save,
    wait_for_quiet,
)
from tests.support import sim_body

ACCEL = {"base_ms": 50.0, "per_row_ms": 1.25, "max_batch": 8, "flush_ms": 2.0}


def per_worker_ceiling() -> float:
    """Requests/s one worker serves with full batches (the model's own limit)."""
    b = ACCEL["max_batch"]
    return b / (ACCEL["base_ms"] + ACCEL["per_row_ms"] * b) * 1000


def measure(repo: Path, workers: int, args: argparse.Namespace) -> dict[str, Any]:
    concurrency = args.per_worker_concurrency * workers
    idle = wait_for_quiet()
    extra = ("--model-repository", str(repo), "--models", "accel")
    with Service(*extra, workers=workers) as svc:
        svc.wait_for_workers("accel", workers)
        meter = CpuMeter(svc.processes())
        meter.start()
        r = closed_loop(
            svc,
            infer_request("accel", sim_body(1.0)),
            concurrency=concurrency,
            duration_s=args.duration,
            warmup_s=args.warmup,
        )
        cores = meter.stop()
    row = {
        "workers": workers,
        "concurrency": concurrency,
        "rps": r.ok_rps,
        "p50_ms": r.latency_ms["p50"],
        "p99_ms": r.latency_ms["p99"],
        "errors": r.errors,
        "gateway_cores": cores.get("gateway", 0.0),
        "worker_cores": cores.get("worker", 0.0),
        "client_cores": r.client_cpu_share,
        "machine_idle_before": idle,
    }
    print(
        f"{workers} worker(s), {concurrency} connections: {r.ok_rps:7,.0f} req/s  "
        f"p50 {fmt(row['p50_ms'])} ms  p99 {fmt(row['p99_ms'])} ms  gateway "
        f"{row['gateway_cores']:.2f} cores, workers {row['worker_cores']:.2f}  "
        f"errors {r.errors or 0}",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2,4,8", help="worker counts")
    parser.add_argument("--duration", type=float, default=6.0, help="seconds measured per level")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--per-worker-concurrency", type=int, default=32)
    args = parser.parse_args()
    levels = [int(n) for n in args.workers.split(",")]
    with model_repository(accel=ACCEL) as repo:
        rows = [measure(repo, n, args) for n in levels]

    base = rows[0]
    per_worker_1 = base["rps"] / base["workers"]
    table = []
    for row in rows:
        n = row["workers"]
        table.append(
            [
                n,
                row["concurrency"],
                fmt(row["rps"], 0),
                f"{row['rps'] / base['rps']:.2f}x",
                f"{row['rps'] / (n * per_worker_1):.0%}",
                fmt(per_worker_ceiling() * n, 0),
                fmt(row["p50_ms"], 1),
                fmt(row["p99_ms"], 1),
                f"{row['gateway_cores']:.2f}",
                f"{row['worker_cores']:.2f}",
            ]
        )
    headers = [
        "workers",
        "connections",
        "req/s",
        f"vs {base['workers']} worker",
        "efficiency vs linear",
        "model-bound req/s",
        "P50 ms",
        "P99 ms",
        "gateway cores",
        "worker cores (all)",
    ]
    print()
    print(markdown_table(headers, table))
    print("\nratios (measured side by side in this run):")
    for row in rows[1:]:
        print(
            f"  {row['workers']} workers / {base['workers']}: {row['rps'] / base['rps']:.2f}x "
            f"(linear {row['workers'] / base['workers']:.0f}x); "
            f"P99 {row['p99_ms'] / base['p99_ms']:.2f}x of {base['workers']} worker's"
        )
    result = {
        "simulated_model": ACCEL,
        "per_worker_concurrency": args.per_worker_concurrency,
        "duration_s": args.duration,
        "rows": rows,
    }
    print(f"\nwrote {save('scaleout', result)}")


if __name__ == "__main__":
    main()

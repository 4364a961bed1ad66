"""Latency vs load: open-loop P50 and P99 at 25-120 % of measured capacity.

    python bench/latency_vs_load.py [--levels 25,50,75,90,100,120] [--duration 15]
                                    [--model accel|digits] [--deadline-ms 10000,1000]

`inferq up` (1 gateway, 1 worker) on a private redis-server. The default model ``accel`` is the
simulated backend with a GPU-like cost, 20 ms + 0.5 ms per row with max_batch 16 (at most
16 / 28 ms = 571 requests/s, sleeping, no CPU), so the queue and the batcher are what is
measured, not the two shared cores; ``--model digits`` runs the real ONNX model instead, whose
capacity is the gateway's CPU.

1. Capacity: a closed loop at 4 x max_batch connections (64), 2 s warm-up, 6 s measured;
   capacity = its 2xx throughput.
2. For each level: an open loop of Poisson arrivals at level x capacity, latency measured from
   each request's intended send time (so queueing is counted, not hidden: no coordinated
   omission), 1 s warm-up at the same rate, DURATION s measured. Every request carries a
   deadline (the V2 ``timeout`` parameter): above capacity the queue grows until requests
   miss it (504) or, with admission control, are refused at once (429). The levels run once
   per deadline given: a long one (10 s, the model's default: the queue's own behaviour) and
   a short one (1 s: where admission control has to act within one level's run). At 90 %
   a queue has little spare capacity to recover from a Poisson burst, so P99 over a short
   window hinges on one or two bursts: 15 s per level keeps it repeatable to about +-20 %.

Printed per level: offered and served rates, P50/P99 of the 2xx responses and their ratio,
accepted (2xx) vs rejected (429/503) vs timed out (504) counts. Writes
bench/results/latency_vs_load.json. Loopback only; bounded in time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    Service,
    closed_loop,
    digits_body,
    fmt,
    git_revision,
    infer_request,
    markdown_table,
    model_repository,
    open_loop,
    save,
    wait_for_quiet,
)
from loadgen.result import LoadResult
from tests.support import sim_body

ACCEL = {"base_ms": 20.0, "per_row_ms": 0.5, "max_batch": 16, "flush_ms": 2.0}
REJECTED = ("429", "503")


def body_for(model: str, deadline_ms: int) -> dict[str, Any]:
    params = {"timeout": deadline_ms * 1000}  # V2 timeout is in microseconds
    return digits_body(**params) if model == "digits" else sim_body(1.0, **params)


def level_row(pct: int, rate: float, r: LoadResult, deadline_ms: int) -> dict[str, Any]:
    """One table row from an open-loop result."""
    errors = r.errors
    rejected = sum(errors.get(k, 0) for k in REJECTED)
    timed_out = errors.get("504", 0)
    p50, p99 = r.latency_ms["p50"], r.latency_ms["p99"]
    return {
        "deadline_ms": deadline_ms,
        "percent": pct,
        "target_rps": rate,
        "offered_rps": r.offered_rps,
        "ok_rps": r.ok_rps,
        "p50_ms": p50,
        "p99_ms": p99,
        "p99_over_p50": p99 / p50 if p50 and p99 else None,
        "service_p99_ms": (r.service_ms or {}).get("p99"),
        "send_lag_p99_ms": (r.send_lag_ms or {}).get("p99"),
        "requests": r.requests,
        "accepted": r.ok,
        "rejected": rejected,
        "timed_out": timed_out,
        "other_errors": r.error_count - rejected - timed_out,
        "errors": errors,
        "peak_connections": r.concurrency,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="25,50,75,90,100,120", help="percent of capacity")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per level")
    parser.add_argument("--model", choices=["accel", "digits"], default="accel")
    parser.add_argument(
        "--deadline-ms", default="10000,1000", help="request deadlines: the levels run per each"
    )
    parser.add_argument("--capacity-concurrency", type=int, default=64)
    parser.add_argument(
        "--root",
        type=Path,
        default=None,
        help="a checkout of another revision whose `inferq up` to measure (for an A/B pair)",
    )
    parser.add_argument("--label", default="latency_vs_load", help="result file name")
    args = parser.parse_args()
    levels = [int(p) for p in args.levels.split(",")]
    deadlines = [int(d) for d in args.deadline_ms.split(",")]
    requests = {d: infer_request(args.model, body_for(args.model, d)) for d in deadlines}
    rows: list[dict[str, Any]] = []
    with model_repository(digits=args.model == "digits", accel=ACCEL) as repo:
        idle = wait_for_quiet()
        extra = ("--model-repository", str(repo), "--models", args.model)
        with Service(*extra, **({"root": args.root} if args.root else {})) as svc:
            svc.wait_for_workers(args.model, 1)
            cap = closed_loop(
                svc,
                requests[max(deadlines)],
                concurrency=args.capacity_concurrency,
                duration_s=6.0,
                warmup_s=2.0,
            )
            capacity = cap.ok_rps
            if not cap.ok:
                raise SystemExit(f"the capacity run had no successful request: {cap.errors}")
            print(
                f"capacity (closed loop, {args.capacity_concurrency} connections): "
                f"{capacity:,.0f} req/s, p50 {fmt(cap.latency_ms['p50'])} ms, "
                f"p99 {fmt(cap.latency_ms['p99'])} ms, errors {cap.errors or 0}",
                flush=True,
            )
            for deadline, pct in ((d, p) for d in deadlines for p in levels):
                rate = capacity * pct / 100
                wait_for_quiet(max_wait_s=30)
                res = open_loop(
                    svc, requests[deadline], rate=rate, duration_s=args.duration, seed=pct
                )
                row = level_row(pct, rate, res, deadline)
                rows.append(row)
                print(
                    f"deadline {deadline:>5} ms, {pct:>3} % = {rate:7,.0f} req/s: "
                    f"{res.ok_rps:7,.0f} 2xx/s  "
                    f"p50 {fmt(row['p50_ms'])} ms  p99 {fmt(row['p99_ms'])} ms  "
                    f"accepted {row['accepted']:,} rejected {row['rejected']:,} "
                    f"timed out {row['timed_out']:,} other {row['other_errors']:,}",
                    flush=True,
                )

    table = [
        [
            f"{r['deadline_ms']:,}",
            f"{r['percent']} %",
            fmt(r["offered_rps"], 0),
            fmt(r["ok_rps"], 0),
            fmt(r["p50_ms"], 1),
            fmt(r["p99_ms"], 1),
            "-" if r["p99_over_p50"] is None else f"{r['p99_over_p50']:.2f}",
            f"{r['accepted']:,}",
            f"{r['rejected']:,}",
            f"{r['timed_out']:,}",
            f"{r['other_errors']:,}",
        ]
        for r in rows
    ]
    headers = [
        "deadline ms",
        "load",
        "offered req/s",
        "2xx/s",
        "P50 ms",
        "P99 ms",
        "P99/P50",
        "accepted (2xx)",
        "rejected (429/503)",
        "timed out (504)",
        "other errors",
    ]
    print()
    print(markdown_table(headers, table))
    print("\nratios (measured side by side in this run):")
    for r in rows:
        ratio = "-" if r["p99_over_p50"] is None else f"{r['p99_over_p50']:.2f}"
        share = r["accepted"] / r["requests"] if r["requests"] else 0.0
        print(
            f"  deadline {r['deadline_ms']:>5} ms, {r['percent']:>3} %: P99/P50 {ratio}; "
            f"P99 {(r['p99_ms'] or 0) / r['deadline_ms']:.0%} of the deadline; "
            f"accepted {share:.0%} of requests"
        )
    result = {
        "revision": git_revision(args.root) if args.root else git_revision(),
        "model": args.model,
        "simulated_model": ACCEL if args.model == "accel" else None,
        "deadlines_ms": deadlines,
        "capacity": {
            "rps": capacity,
            "concurrency": args.capacity_concurrency,
            "p50_ms": cap.latency_ms["p50"],
            "p99_ms": cap.latency_ms["p99"],
        },
        "duration_s": args.duration,
        "machine_idle_before": idle,
        "rows": rows,
    }
    print(f"\nwrote {save(args.label, result)}")


if __name__ == "__main__":
    main()

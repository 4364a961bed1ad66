"""Requests/s with 1 vs 2 gateway processes: `inferq up --gateways N`, the digits model.

    python bench/gateways.py [--gateways 1,2] [--rounds 2] [--duration 6] [--warmup 2]
                             [--concurrency 64] [--workers 1]

Each level is `inferq up --workers W --gateways N` on a private redis-server, serving the real
digits model (ONNX Runtime, cache bypassed), under closed-loop HTTP/1.1 keep-alive load from
loadgen in this process. The levels alternate (1, 2, 1, 2, ...) so the drift of a shared
machine falls on both alike. For every run: requests/s, P50/P99, the CPU each role used (the
gateways summed, the workers, this client), and how the requests split over the gateway
processes (results added to each gateway's reply stream). Writes bench/results/gateways.json
with the git revision and the command. Loopback only; bounded in time (about a minute).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    CpuMeter,
    Service,
    closed_loop,
    digits_body,
    fmt,
    infer_request,
    markdown_table,
    save,
    wait_for_quiet,
)
from protocol.keys import Keys


def replies_per_gateway(url: str) -> dict[str, int]:
    """Entries ever added to each gateway's reply stream (a result per request it served)."""
    prefix = Keys("inferq").replies("")
    with redis.Redis.from_url(url) as r:
        return {
            key.decode().removeprefix(prefix): int(r.xinfo_stream(key)["entries-added"])
            for key in r.scan_iter(match=f"{prefix}*", _type="stream")
        }


def measure(gateways: int, args: argparse.Namespace) -> dict[str, Any]:
    idle = wait_for_quiet()
    extra = ("--gateways", str(gateways), "--models", "digits")
    with Service(*extra, workers=args.workers) as svc:
        svc.wait_for_workers("digits", args.workers)
        before = replies_per_gateway(svc.redis.url)
        meter = CpuMeter(svc.processes())
        meter.start()
        r = closed_loop(
            svc,
            infer_request("digits", digits_body(cache=False)),
            concurrency=args.concurrency,
            duration_s=args.duration,
            warmup_s=args.warmup,
        )
        cores = meter.stop()
        after = replies_per_gateway(svc.redis.url)
    served = sorted((after[g] - before.get(g, 0) for g in after), reverse=True)
    row = {
        "gateways": gateways,
        "rps": r.ok_rps,
        "p50_ms": r.latency_ms["p50"],
        "p99_ms": r.latency_ms["p99"],
        "errors": r.errors,
        "gateway_cores": cores.get("gateway", 0.0),
        "worker_cores": cores.get("worker", 0.0),
        "client_cores": r.client_cpu_share,
        "replies_per_gateway": served,
        "machine_idle_before": idle,
    }
    print(
        f"{gateways} gateway(s): {r.ok_rps:7,.0f} req/s  p50 {fmt(row['p50_ms'])} ms  "
        f"p99 {fmt(row['p99_ms'])} ms  gateways {row['gateway_cores']:.2f} cores, workers "
        f"{row['worker_cores']:.2f}, client {row['client_cores']:.2f}  split {served}  "
        f"errors {r.errors or 0}",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateways", default="1,2", help="gateway counts to compare")
    parser.add_argument("--rounds", type=int, default=2, help="times each count is measured")
    parser.add_argument("--duration", type=float, default=6.0, help="seconds measured per run")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    levels = [int(n) for n in args.gateways.split(",")]
    runs = [measure(n, args) for _ in range(args.rounds) for n in levels]

    table = []
    base = statistics.median(r["rps"] for r in runs if r["gateways"] == levels[0])
    for n in levels:
        mine = [r for r in runs if r["gateways"] == n]
        rps = statistics.median(r["rps"] for r in mine)
        table.append(
            [
                n,
                " / ".join(fmt(r["rps"], 0) for r in mine),
                fmt(rps, 0),
                f"{rps / base:.2f}x",
                fmt(statistics.median(r["p50_ms"] for r in mine), 1),
                fmt(statistics.median(r["p99_ms"] for r in mine), 1),
                f"{statistics.median(r['gateway_cores'] for r in mine):.2f}",
                f"{statistics.median(r['worker_cores'] for r in mine):.2f}",
                f"{statistics.median(r['client_cores'] for r in mine):.2f}",
                " / ".join(":".join(str(s) for s in r["replies_per_gateway"]) for r in mine),
            ]
        )
    headers = [
        "gateways",
        "req/s per run",
        "req/s (median)",
        f"vs {levels[0]}",
        "P50 ms",
        "P99 ms",
        "gateway cores",
        "worker cores",
        "client cores",
        "requests per gateway",
    ]
    print()
    print(markdown_table(headers, table))
    result = {
        "model": "digits (ONNX Runtime), cache bypassed",
        "workers": args.workers,
        "concurrency": args.concurrency,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "runs": runs,
    }
    print(f"\nwrote {save('gateways', result)}")


if __name__ == "__main__":
    main()

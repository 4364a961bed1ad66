"""Issue #2 benchmark: the digits model through `inferq up` (1 gateway, 1 worker) vs in-process.

    python bench/core.py [--duration 8] [--levels 1,16,64]

In one run on this machine it measures:
1. closed-loop HTTP load at each concurrency level: requests/s and P50/P90/P99 latency, with
   the cache bypassed (``"cache": false``) so every request goes through the queue;
2. Redis commands per request from ``INFO commandstats`` before and after each level (all
   commands: gateway, worker, heartbeats), and separately on the cache-miss path (cache on,
   every input distinct, so each request also pays its cache GET);
3. the same model called in-process through ONNX Runtime: the ceiling.

It prints a table and the ratios, and writes bench/results/core.json. Loopback only; every load
loop is bounded in time and count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    DIGITS_SAMPLES,
    ROOT,
    Service,
    call_latencies,
    calls_between,
    closed_loop,
    command_calls,
    rows_per_s,
    save,
)
from loadgen.http import HTTPConnection, PreparedRequest

SAMPLES = DIGITS_SAMPLES
HEADERS = {"content-type": "application/json"}


def body(row: list[float], cache: bool) -> bytes:
    request = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": row}]}
    if not cache:
        request["parameters"] = {"cache": False}
    return json.dumps(request).encode()


async def miss_path(url: str, n: int, concurrency: int) -> int:
    """Send ``n`` requests with distinct inputs (so each misses the cache); return the OKs."""
    base = SAMPLES["inputs"][0]
    ok = 0

    async def lane(j: int) -> None:
        nonlocal ok
        async with HTTPConnection.from_url(url) as conn:
            for i in range(j, n, concurrency):
                row = [*base[:-1], 1000.0 + i]  # a distinct last pixel: a distinct cache key
                r = await conn.request("POST", "/v2/models/digits/infer", body(row, True), HEADERS)
                ok += r.status == 200

    await asyncio.gather(*(lane(j) for j in range(concurrency)))
    return ok


def in_process(seconds: float) -> dict[str, float]:
    """The ceiling: ONNX Runtime called directly, configured as the worker configures it."""
    from consumer.backends.onnx import OnnxBackend
    from consumer.repository import load_config

    backend = OnnxBackend(load_config(ROOT / "models", "digits"), "1")
    backend.load()
    one = np.array([SAMPLES["inputs"][0]], dtype=np.float32)
    many = np.array(SAMPLES["inputs"] * 7, dtype=np.float32)[:64]
    latencies = call_latencies(lambda: backend.predict({"input": one}), seconds)
    batch_rps = rows_per_s(lambda _: backend.predict({"input": many}), 64, seconds)
    return {
        "batch1_calls_per_s": len(latencies) / sum(latencies),
        "batch1_p50_ms": statistics.median(latencies) * 1000,
        "batch64_rows_per_s": batch_rps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per level")
    parser.add_argument("--levels", default="1,16,64", help="concurrency levels")
    parser.add_argument("--miss-requests", type=int, default=3000)
    args = parser.parse_args()
    levels = [int(c) for c in args.levels.split(",")]

    results: dict[str, object] = {"levels": []}
    with Service() as svc:
        request = PreparedRequest(
            "POST", "/v2/models/digits/infer", body(SAMPLES["inputs"][0], False), HEADERS
        )
        for c in levels:
            before = command_calls(svc.redis.url)
            r = closed_loop(svc, request, concurrency=c, duration_s=args.duration)
            calls = calls_between(before, command_calls(svc.redis.url))
            sent = r.requests + r.warmup_requests
            level = {
                "concurrency": c,
                "rps": r.throughput_rps,
                "errors": r.errors,
                **{k: r.latency_ms[k] for k in ("p50", "p90", "p99")},
                "redis_commands_per_request": sum(calls.values()) / sent,
                "commands": {k: round(v / sent, 3) for k, v in calls.items()},
            }
            results["levels"].append(level)  # type: ignore[union-attr]
            print(
                f"c={c:<3} {r.throughput_rps:8.0f} req/s  p50 {r.latency_ms['p50']:.2f} ms  "
                f"p90 {r.latency_ms['p90']:.2f}  p99 {r.latency_ms['p99']:.2f}  "
                f"redis cmds/req {level['redis_commands_per_request']:.2f}  errors {r.errors}",
                flush=True,
            )
        before = command_calls(svc.redis.url)
        ok = asyncio.run(miss_path(svc.url, args.miss_requests, 16))
        calls = calls_between(before, command_calls(svc.redis.url))
        results["cache_miss"] = {
            "requests": args.miss_requests,
            "ok": ok,
            "redis_commands_per_request": sum(calls.values()) / args.miss_requests,
            "commands": {k: round(v / args.miss_requests, 3) for k, v in calls.items()},
        }
        print(
            f"cache-miss path: {results['cache_miss']['redis_commands_per_request']:.2f} "
            f"Redis commands per request ({results['cache_miss']['commands']})",
            flush=True,
        )
    ceiling = in_process(3.0)
    results["in_process"] = ceiling
    lv = {lvl["concurrency"]: lvl for lvl in results["levels"]}  # type: ignore[union-attr]
    print(
        f"in-process ONNX Runtime: {ceiling['batch1_calls_per_s']:.0f} calls/s at batch 1 "
        f"(p50 {ceiling['batch1_p50_ms'] * 1000:.0f} us), "
        f"{ceiling['batch64_rows_per_s']:.0f} rows/s at batch 64"
    )
    print("\nratios (measured side by side in this run):")
    if 1 in lv:
        print(
            f"  inferq p50 at c=1 / in-process p50 at batch 1: "
            f"{lv[1]['p50'] / ceiling['batch1_p50_ms']:.0f}x  (queue + HTTP overhead "
            f"{lv[1]['p50'] - ceiling['batch1_p50_ms']:.2f} ms)"
        )
    if 16 in lv and 64 in lv:
        print(f"  throughput c=16 / c=64: {lv[16]['rps'] / lv[64]['rps']:.2f}")
    top = max(lv.values(), key=lambda x: x["rps"])
    print(
        f"  best inferq throughput / in-process batch-64 rows/s: "
        f"{top['rps'] / ceiling['batch64_rows_per_s']:.3f}"
    )
    print(f"\nwrote {save('core', results)}")


if __name__ == "__main__":
    main()

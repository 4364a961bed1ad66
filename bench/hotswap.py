"""A hot swap of minilm under load: what the clients see while every worker loads, warms and
switches to another version.

    python bench/hotswap.py [--duration 24] [--concurrency 16] [--swap-at 8] [--workers 2]

Builds minilm into a temporary repository as version 1, copies it as version 2 (the same
weights: the figure is the cost of the swap itself, not of a different model), starts `inferq up`
serving version 1 with an admin token, drives a closed loop of one-sentence requests, and
``--swap-at`` seconds into the measurement calls ``POST /v2/repository/models/minilm/load``
with version 2. Prints the per-second timeline (requests, errors, P50, P99, which version
answered) and the P99 before, during and after the load call, measured side by side in one run.
Loopback only; every loop is bounded in time and count.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Service, closed_loop, save, wait_for_quiet
from bench.minilm import build, requests

TOKEN = "bench-hotswap-token"


def prepare_repo(repo: Path) -> None:
    build(repo)
    shutil.copytree(repo / "minilm" / "1", repo / "minilm" / "2")
    config = repo / "minilm" / "config.toml"
    config.write_text(
        config.read_text().replace(
            "[version_policy]\nlatest = 1", '[version_policy]\nspecific = ["1"]'
        )
    )


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"authorization": f"Bearer {TOKEN}", "content-type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def versions_seen(url: str, n: int) -> Counter[str]:
    """Which version answers ``n`` requests sent now (cache bypassed)."""
    seen: Counter[str] = Counter()
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["probe"]}]}
    for _ in range(n):
        request = urllib.request.Request(
            f"{url}/v2/models/minilm/infer",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json", "cache-control": "no-cache"},
        )
        with urllib.request.urlopen(request, timeout=30) as r:
            seen[json.loads(r.read())["model_version"]] += 1
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=24.0, help="seconds measured")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--swap-at", type=float, default=8.0, help="seconds into the window")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    repo = Path(tempfile.mkdtemp(prefix="inferq-bench-hotswap-"))
    os.environ["INFERQ_ADMIN_TOKEN"] = TOKEN  # `inferq up` hands it to the gateway
    try:
        prepare_repo(repo)
        wait_for_quiet()
        with Service(
            "--model-repository", str(repo), "--models", "minilm", workers=args.workers
        ) as svc:
            svc.wait_for_workers("minilm", args.workers)
            before_versions = versions_seen(svc.url, 4)
            swap: dict[str, Any] = {}
            window_start = threading.Event()
            warmup_s = 3.0

            def swapper() -> None:
                window_start.wait(60)
                time.sleep(warmup_s + args.swap_at)
                swap["start"] = time.monotonic()
                swap["status"], swap["body"] = post(
                    f"{svc.url}/v2/repository/models/minilm/load", {"parameters": {"version": "2"}}
                )
                swap["end"] = time.monotonic()

            thread = threading.Thread(target=swapper)
            thread.start()

            window_start.set()
            loop_started = time.monotonic()
            result = closed_loop(
                svc,
                requests(),
                concurrency=args.concurrency,
                duration_s=args.duration,
                warmup_s=warmup_s,
            )
            thread.join(300)
            after_versions = versions_seen(svc.url, 4)
    finally:
        shutil.rmtree(repo, ignore_errors=True)

    # Timeline t is seconds from the start of measurement (after the warm-up).
    t0 = loop_started + warmup_s
    swap_from, swap_to = swap["start"] - t0, swap["end"] - t0
    print(
        f"load call: HTTP {swap['status']} after {swap_to - swap_from:.2f} s "
        f"(window {swap_from:.1f}-{swap_to:.1f} s); workers' load times "
        f"{ {w: v['load_ms'] for w, v in swap['body'].get('workers', {}).items()} } ms"
    )
    print(f"versions answering before: {dict(before_versions)}, after: {dict(after_versions)}")
    print(f"\n{'t (s)':>6} {'req':>5} {'err':>4} {'p50 ms':>7} {'p99 ms':>7}")
    phases: dict[str, list[Any]] = {"before": [], "during": [], "after": []}
    # The last row may hold only the stragglers that finished after the window: left out.
    for row in (r for r in result.timeline if r.t + 1 <= args.duration):
        if row.t + 1 <= swap_from:
            phase = "before"
        elif row.t >= swap_to:
            phase = "after"
        else:
            phase = "during"
        phases[phase].append(row)
        mark = " <- load" if phase == "during" else ""
        p50 = f"{row.p50_ms:7.0f}" if row.p50_ms is not None else "      -"
        p99 = f"{row.p99_ms:7.0f}" if row.p99_ms is not None else "      -"
        print(f"{row.t:6.0f} {row.requests:5d} {row.errors:4d} {p50} {p99}{mark}")

    def worst_p99(rows: list[Any]) -> float:
        return max((r.p99_ms for r in rows if r.p99_ms is not None), default=float("nan"))

    def rps(rows: list[Any]) -> float:
        return sum(r.ok for r in rows) / max(1, len(rows))

    summary = {
        phase: {"seconds": len(rows), "ok_per_s": rps(rows), "worst_p99_ms": worst_p99(rows)}
        for phase, rows in phases.items()
    }
    print(
        f"\nrequests {result.requests}, ok {result.ok}, errors {result.errors or 'none'}; "
        f"overall P50 {result.latency_ms['p50']:.0f} ms, P99 {result.latency_ms['p99']:.0f} ms"
    )
    for phase, s in summary.items():
        print(
            f"  {phase:>6}: {s['seconds']} s, {s['ok_per_s']:.1f} ok/s, "
            f"worst per-second P99 {s['worst_p99_ms']:.0f} ms"
        )
    b, d = summary["before"], summary["during"]
    print(
        f"ratios (side by side in this run): during/before throughput "
        f"{d['ok_per_s'] / b['ok_per_s']:.2f}, "
        f"worst P99 {d['worst_p99_ms'] / b['worst_p99_ms']:.2f}"
    )
    path = save(
        "hotswap",
        {
            "concurrency": args.concurrency,
            "workers": args.workers,
            "load_call": {"status": swap["status"], "seconds": swap_to - swap_from, **swap["body"]},
            "versions_before": dict(before_versions),
            "versions_after": dict(after_versions),
            "errors": result.errors,
            "timeline": [r.to_dict() for r in result.timeline],
            "phases": summary,
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()

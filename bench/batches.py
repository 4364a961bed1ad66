"""A batch against the same lines sent as sync requests, and what a batch does to real-time
traffic beside it.

    python bench/batches.py [--lines 10000] [--concurrency 16,64,128] [--rate 100]

Starts `inferq up` (one gateway, one worker) with a simulated model (`bsim`: 5 ms a call plus
0.02 ms a row, up to 64 rows a call: SIMULATED, its figures are the queue's, not a model's).

1. Sync: closed loops of single-row infer requests (no cache) at each ``--concurrency`` for
   ``--seconds``; the best throughput is the peer of the batch.
2. Batch: one batch of ``--lines`` single-row lines (the same body), from ``POST /v2/batches``
   to ``completed``: lines/s. Every custom_id is checked answered once.
3. Real-time beside it: an open loop of ``--rate`` sync requests/s for ``--seconds``, alone and
   then while a batch of ``--lines`` runs; P50/P99 of each.

Worker batch sizes (rows per model call) come from the model's statistics
(``GET /v2/models/bsim/stats``: inference_count / execution_count over each phase). Prints a
table and the ratios; saves ``bench/summaries/batches.json`` with the revision and command.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    Service,
    closed_loop,
    fmt,
    infer_request,
    markdown_table,
    model_repository,
    open_loop,
    save,
    wait_for_quiet,
)

MODEL = "bsim"
SIMULATED = {"base_ms": 5.0, "per_row_ms": 0.02, "max_batch": 64}


def body(i: int) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [float(i)] * 4}]}


def model_counts(url: str) -> tuple[int, int]:
    """(rows run, model calls) so far, summed over versions and workers."""
    doc = httpx.get(f"{url}/v2/models/{MODEL}/stats", timeout=10).json()
    stats = doc["model_stats"]
    return sum(s["inference_count"] for s in stats), sum(s["execution_count"] for s in stats)


def settled_counts(url: str) -> tuple[int, int]:
    """The counts once the workers' published statistics stop moving."""
    last = model_counts(url)
    for _ in range(20):
        time.sleep(1.0)
        now = model_counts(url)
        if now == last:
            return now
        last = now
    return last


def rows_per_call(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    calls = after[1] - before[1]
    return (after[0] - before[0]) / calls if calls else None


def run_batch(url: str, lines: int) -> dict[str, Any]:
    payload = b"".join(
        json.dumps(
            {"custom_id": f"l{i}", "url": f"/v2/models/{MODEL}/infer", "body": body(i)}
        ).encode()
        + b"\n"
        for i in range(lines)
    )
    with httpx.Client(base_url=url, timeout=120) as c:
        started = time.perf_counter()
        r = c.post("/v2/batches", content=payload)
        r.raise_for_status()
        batch_id = r.json()["id"]
        accepted_s = time.perf_counter() - started
        deadline = time.monotonic() + 1800
        while True:
            doc = c.get(f"/v2/batches/{batch_id}").json()
            if doc["status"] in ("completed", "failed", "expired", "cancelled"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"batch {batch_id} did not end: {doc}")
            time.sleep(0.2)
        elapsed = time.perf_counter() - started
        out = [json.loads(x) for x in c.get(f"/v2/batches/{batch_id}/output").text.split()]
    ids = [o["custom_id"] for o in out]
    assert doc["status"] == "completed", doc
    assert len(ids) == len(set(ids)) == lines, (len(ids), len(set(ids)))
    return {
        "batch_id": batch_id,
        "lines": lines,
        "accepted_s": accepted_s,
        "elapsed_s": elapsed,
        "lines_per_s": lines / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=10_000)
    parser.add_argument("--concurrency", default="16,64,128")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=100.0)
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    out: dict[str, Any] = {"simulated_model": {MODEL: SIMULATED}, "lines": args.lines}
    with (
        model_repository(**{MODEL: SIMULATED}) as repo,
        Service("--model-repository", str(repo), "--models", MODEL) as svc,
    ):
        request = infer_request(MODEL, body(1))
        closed_loop(svc, request, concurrency=8, duration_s=2)  # warm-up
        sync = []
        for level in levels:
            wait_for_quiet()
            before = settled_counts(svc.url)
            result = closed_loop(svc, request, concurrency=level, duration_s=args.seconds)
            after = settled_counts(svc.url)
            sync.append(
                {
                    "concurrency": level,
                    "lines_per_s": result.ok_rps,
                    "errors": result.errors,
                    "p99_ms": result.latency_ms["p99"] if result.latency_ms else None,
                    "rows_per_call": rows_per_call(before, after),
                }
            )
            print(json.dumps(sync[-1]), flush=True)
        out["sync"] = sync
        best = max(sync, key=lambda r: r["lines_per_s"])

        wait_for_quiet()
        before = settled_counts(svc.url)
        batch = run_batch(svc.url, args.lines)
        batch["rows_per_call"] = rows_per_call(before, settled_counts(svc.url))
        out["batch"] = batch
        print(json.dumps(batch), flush=True)

        wait_for_quiet()
        alone = open_loop(svc, request, rate=args.rate, duration_s=args.seconds)
        wait_for_quiet()
        beside: dict[str, Any] = {}
        runner = threading.Thread(target=lambda: beside.update(run_batch(svc.url, args.lines)))
        runner.start()
        time.sleep(1.0)  # the batch is being ingested
        with_batch = open_loop(svc, request, rate=args.rate, duration_s=args.seconds)
        runner.join()
        out["realtime"] = {
            "rate": args.rate,
            "alone": {"latency_ms": alone.latency_ms, "errors": alone.errors},
            "with_batch": {"latency_ms": with_batch.latency_ms, "errors": with_batch.errors},
            "batch_beside": beside,
        }
    ratio = batch["lines_per_s"] / best["lines_per_s"]
    p99_alone = alone.latency_ms["p99"] if alone.latency_ms else None
    p99_with = with_batch.latency_ms["p99"] if with_batch.latency_ms else None
    out["batch_vs_best_sync"] = ratio
    rows = [
        [
            f"sync, concurrency {r['concurrency']}",
            fmt(r["lines_per_s"]),
            fmt(r["rows_per_call"]),
            fmt(r["p99_ms"]),
        ]
        for r in sync
    ]
    rows.append(
        [f"batch of {args.lines}", fmt(batch["lines_per_s"]), fmt(batch["rows_per_call"]), "-"]
    )
    print(
        markdown_table(["how (SIMULATED model)", "lines/s", "rows per model call", "P99 ms"], rows)
    )
    print(f"batch / best sync throughput: {ratio:.2f}")
    print(
        f"real-time at {args.rate:.0f}/s: P99 {fmt(p99_alone)} ms alone, {fmt(p99_with)} ms "
        "beside a batch"
    )
    save("batches", out)


if __name__ == "__main__":
    main()

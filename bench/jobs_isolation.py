"""Async jobs must not wreck synchronous latency: sync P99 while 10,000 jobs drain vs idle.

    python bench/jobs_isolation.py [--jobs 10000] [--concurrency 2] [--duration 5]

`inferq up` with the digits model and one worker. First a closed-loop synchronous load at low
concurrency on the idle service (cache bypassed) gives the idle P99. Then the worker process is
paused (SIGSTOP) while JOBS job submissions are queued (low-priority lane by default), so a real
backlog exists; it is resumed (SIGCONT) and the same synchronous load runs at once, while the
backlog drains. The script reports both P99s, their ratio, how many jobs finished during the
measured window, and when the last job finished. Loopback only; every loop bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import DIGITS_SAMPLES, Service, save
from loadgen.closed import run_closed_loop
from loadgen.http import HTTPConnection, PreparedRequest
from loadgen.loop import LoadOptions

SAMPLES = DIGITS_SAMPLES
HEADERS = {"content-type": "application/json"}


def body(i: int, cache: bool = True) -> bytes:
    doc: dict = {
        "inputs": [
            {
                "name": "input",
                "datatype": "FP32",
                "shape": [1, 64],
                "data": SAMPLES["inputs"][i % 10],
            }
        ]
    }
    if not cache:
        doc["parameters"] = {"cache": False}
    return json.dumps(doc).encode()


async def submit_jobs(url: str, n: int, lanes: int = 32) -> list[str]:
    ids: list[str] = []

    async def lane(j: int) -> None:
        async with HTTPConnection.from_url(url) as conn:
            for i in range(j, n, lanes):
                r = await conn.request("POST", "/v2/models/digits/jobs", body(i), HEADERS)
                assert r.status == 202, r.body
                ids.append(r.json()["id"])

    await asyncio.gather(*(lane(j) for j in range(lanes)))
    return ids


async def finish_times(url: str, ids: list[str], timeout_s: float) -> list[str]:
    """Each job's finished_at, once final (long-polling), bounded by ``timeout_s``."""
    started = time.monotonic()
    stamps = []
    async with HTTPConnection.from_url(url) as conn:
        for job_id in ids:
            while time.monotonic() - started < timeout_s:
                r = await conn.request("GET", f"/v2/jobs/{job_id}?wait=10", timeout=15)
                job = r.json()
                if job["status"] in ("succeeded", "failed", "expired", "cancelled"):
                    assert job["status"] == "succeeded", job
                    stamps.append(job["finished_at"])
                    break
    return stamps


def worker_pid(redis_url: str) -> int:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "inferq worker" in cmd and redis_url in cmd:
                return int(entry.name)
    raise RuntimeError("worker process not found")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--duration", type=float, default=5.0)
    args = parser.parse_args()
    sync = PreparedRequest("POST", "/v2/models/digits/infer", body(3, cache=False), HEADERS)
    with Service() as svc:
        url = f"{svc.url}/v2/models/digits/infer"
        idle = asyncio.run(
            run_closed_loop(
                LoadOptions(url, duration_s=args.duration, requests=sync), args.concurrency
            )
        )
        pid = worker_pid(svc.redis.url)
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            ids = asyncio.run(submit_jobs(svc.url, args.jobs))
            submit_s = time.monotonic() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed = datetime.now(UTC)
        busy = asyncio.run(
            run_closed_loop(
                LoadOptions(url, duration_s=args.duration, requests=sync, warmup_s=0.0),
                args.concurrency,
            )
        )
        window_end = datetime.now(UTC)
        stamps = [datetime.fromisoformat(t) for t in asyncio.run(finish_times(svc.url, ids, 600))]
    finished_in_window = sum(t <= window_end for t in stamps)
    drain_s = (max(stamps) - resumed).total_seconds()
    ratio = busy.latency_ms["p99"] / idle.latency_ms["p99"]
    print(
        f"idle:     {idle.throughput_rps:7.0f} req/s  p50 {idle.latency_ms['p50']:.2f} ms  "
        f"p99 {idle.latency_ms['p99']:.2f} ms"
    )
    print(
        f"draining: {busy.throughput_rps:7.0f} req/s  p50 {busy.latency_ms['p50']:.2f} ms  "
        f"p99 {busy.latency_ms['p99']:.2f} ms  errors {busy.errors}"
    )
    print(
        f"{args.jobs} jobs queued in {submit_s:.1f} s (worker paused); {finished_in_window} "
        f"finished during the {args.duration:.0f} s window; the last {drain_s:.1f} s after "
        "the worker resumed"
    )
    print(f"ratio: sync P99 while draining / idle P99 = {ratio:.2f} (target <= 2)")
    save(
        "jobs_isolation",
        {
            "jobs": args.jobs,
            "concurrency": args.concurrency,
            "idle": idle.to_dict(),
            "draining": busy.to_dict(),
            "p99_ratio": ratio,
            "submit_s": submit_s,
            "finished_in_window": finished_in_window,
            "drain_s": drain_s,
        },
    )


if __name__ == "__main__":
    main()

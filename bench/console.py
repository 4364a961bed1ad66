"""What the operator console costs: the gateway's CPU and the Redis commands it adds while five
browsers refresh it, and what the job index adds to each job submission.

    python bench/console.py [--phase-s 20] [--submissions 20000]

1. Console pollers: `inferq up` (one gateway, one worker, the example repository) with a console
   token; for ``--phase-s`` each: nobody polling (the baseline), five pollers of the overview
   every 3 s (five browsers on the page's overview: it refreshes the view shown every 3 s), and
   five pollers of all five views every 0.5 s (a stress far above what browsers do). Measured:
   the gateway process's CPU (``/proc``), the Redis commands per second (``INFO commandstats``,
   before and after each phase), and the pollers' answer times.
2. The job index: the submission's pipeline (``SUBMIT_SCRIPT``) alone vs. with the index's two
   commands (``producer.jobindex.queue_add``) against a private Redis, ``--submissions`` each,
   one pipeline at a time: time per submission, Redis CPU per submission, and the index's
   memory at its cap.
Loopback only; every loop is bounded in time or count.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    Service,
    calls_between,
    command_calls,
    cpu_seconds,
    fmt,
    markdown_table,
    save,
)
from inferq.redisserver import RedisServer
from producer import jobindex
from protocol.jobs import SUBMIT_SCRIPT, JobRecord, JobStatus, new_job_id
from protocol.keys import JOB_INDEX_MAXLEN, Keys, Lane

TOKEN = "bench-console-token"
VIEWS = ("overview", "workers", "jobs", "deadletters", "models")


def poll(
    url: str, views: tuple[str, ...], every_s: float, until: float, times: list[float]
) -> None:
    headers = {"authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=url, timeout=10, headers=headers) as c:
        next_at = time.monotonic()
        while time.monotonic() < until:
            for view in views:
                started = time.perf_counter()
                r = c.get(f"/console/api/{view}")
                times.append(time.perf_counter() - started)
                assert r.status_code == 200, r.text
            next_at += every_s
            time.sleep(max(0.0, next_at - time.monotonic()))


def phase(
    service: Service,
    gateway_pid: int,
    pollers: int,
    views: tuple[str, ...],
    every_s: float,
    seconds: float,
) -> dict[str, Any]:
    times: list[float] = []
    before_calls = command_calls(service.redis.url)
    before_cpu, started = cpu_seconds(gateway_pid), time.monotonic()
    until = started + seconds
    threads = [
        threading.Thread(target=poll, args=(service.url, views, every_s, until, times))
        for _ in range(pollers)
    ]
    for t in threads:
        t.start()
    if not threads:
        time.sleep(seconds)
    for t in threads:
        t.join()
    wall = time.monotonic() - started
    cpu = cpu_seconds(gateway_pid) - before_cpu
    calls = calls_between(before_calls, command_calls(service.redis.url))
    calls.pop("info", None)  # this script's own INFO
    ordered = sorted(times)
    return {
        "pollers": pollers,
        "views": list(views),
        "every_s": every_s,
        "seconds": round(wall, 1),
        "requests": len(times),
        "gateway_cpu_share": round(cpu / wall, 4),
        "redis_commands_per_s": round(sum(calls.values()) / wall, 1),
        "top_commands_per_s": {k: round(v / wall, 1) for k, v in list(calls.items())[:6]},
        "answer_p50_ms": round(statistics.median(ordered) * 1000, 2) if ordered else None,
        "answer_p99_ms": round(ordered[int(len(ordered) * 0.99)] * 1000, 2) if ordered else None,
    }


def console_cost(seconds: float) -> dict[str, Any]:
    with Service("--console-token", TOKEN) as service:
        (gateway_pid,) = service.role_pids()["gateway"]
        time.sleep(3)  # the stack's own start-up work settles
        runs = {
            "baseline (no console)": phase(service, gateway_pid, 0, (), 3.0, seconds),
            "5 browsers on the overview (every 3 s)": phase(
                service, gateway_pid, 5, ("overview",), 3.0, seconds
            ),
            "5 pollers of all 5 views every 0.5 s": phase(
                service, gateway_pid, 5, VIEWS, 0.5, seconds
            ),
        }
    return runs


def submission_cost(n: int) -> dict[str, Any]:
    with RedisServer() as server:
        r = redis.Redis.from_url(server.url)
        submit = r.register_script(SUBMIT_SCRIPT)
        out: dict[str, Any] = {}
        for label, indexed in (("without the index", False), ("with the index", True)):
            keys = Keys(f"bench-{int(indexed)}")
            cpu_before = _redis_cpu(r)
            started = time.perf_counter()
            for i in range(n):
                now_ms = 1_700_000_000_000 + i
                job_id = new_job_id(now_ms, i.to_bytes(16, "big"))
                record = JobRecord(job_id, "m", "1", JobStatus.QUEUED, now_ms, now_ms + 60_000)
                fields = [x for pair in record.to_fields().items() for x in pair]
                pipe = r.pipeline(transaction=False)
                submit(
                    keys=[keys.job(job_id), keys.stream("m", Lane.LOW)],
                    args=[600_000, b"m", b"x" * 200, "", "", *fields],
                    client=pipe,
                )
                if indexed:
                    jobindex.queue_add(pipe, keys, job_id, now_ms)
                pipe.execute()
            wall = time.perf_counter() - started
            out[label] = {
                "submissions": n,
                "us_per_submission": round(wall / n * 1e6, 1),
                "redis_cpu_us_per_submission": round((_redis_cpu(r) - cpu_before) / n * 1e6, 1),
            }
        keys = Keys("bench-1")
        out["index"] = {
            "entries": int(r.zcard(keys.job_index)),
            "cap": JOB_INDEX_MAXLEN,
            "memory_bytes": int(r.memory_usage(keys.job_index, samples=0) or 0),
        }
        r.close()
    return out


def _redis_cpu(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase-s", type=float, default=20.0)
    parser.add_argument("--submissions", type=int, default=20_000)
    args = parser.parse_args()
    runs = console_cost(args.phase_s)
    base = runs["baseline (no console)"]
    rows = [
        [
            name,
            r["requests"],
            f"{r['gateway_cpu_share']:.1%}",
            f"{r['gateway_cpu_share'] - base['gateway_cpu_share']:+.1%}",
            fmt(r["redis_commands_per_s"], 1),
            fmt(r["redis_commands_per_s"] - base["redis_commands_per_s"], 1),
            fmt(r["answer_p50_ms"]),
            fmt(r["answer_p99_ms"]),
        ]
        for name, r in runs.items()
    ]
    print(
        markdown_table(
            [
                "load",
                "requests",
                "gateway CPU",
                "added",
                "Redis cmd/s",
                "added",
                "p50 ms",
                "p99 ms",
            ],
            rows,
        )
    )
    index = submission_cost(args.submissions)
    without, with_ = index["without the index"], index["with the index"]
    print(
        markdown_table(
            ["submission", "µs each (one pipeline)", "Redis CPU µs each"],
            [
                [k, fmt(v["us_per_submission"], 1), fmt(v["redis_cpu_us_per_submission"], 1)]
                for k, v in ((k, index[k]) for k in ("without the index", "with the index"))
            ],
        )
    )
    ratio = with_["us_per_submission"] / without["us_per_submission"]
    print(f"with/without: {ratio:.2f}x time; index at cap: {index['index']}")
    save("console", {"console": runs, "job_index": index})


if __name__ == "__main__":
    main()

"""How soon a client hears that its job finished: a webhook, the event stream, a long poll.

    python bench/webhooks.py [--jobs 400] [--concurrency 1,8]

Starts `inferq up` (one gateway, one worker, the digits model) with a webhook secret and
``--webhook-allow 127.0.0.1``, and a webhook receiver on loopback (``tests/receiver.py``).
Each of ``--concurrency`` client threads submits digits jobs one after another, every job with a
webhook, and follows it with ``GET /v2/jobs/{id}/events`` (even jobs) or a long poll
``GET /v2/jobs/{id}?wait=`` (odd jobs) until it is final. For every job it records, on this
machine's clock (Redis runs here too, so the job's ``finished_at`` is on the same clock):
``finished_at`` to the webhook's arrival at the receiver, to the final event's arrival, and to the
long poll's answer. Prints P50/P99 of each, side by side, per concurrency. Loopback only; every
loop is bounded in count.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Service, digits_body, fmt, markdown_table, save, wait_for_quiet
from tests.receiver import receiver

SECRET = "whsec_" + base64.b64encode(os.urandom(32)).decode()


def stamp(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def follow_events(c: httpx.Client, job_id: str) -> tuple[dict[str, Any], float]:
    """The final state from the job's event stream, and when it arrived."""
    with c.stream("GET", f"/v2/jobs/{job_id}/events") as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                arrived = time.time()
                state = json.loads(line.removeprefix("data: "))
                if state["status"] not in ("queued", "running"):
                    return state, arrived
    raise RuntimeError(f"the event stream of {job_id} ended before a final state")


def long_poll(c: httpx.Client, job_id: str) -> tuple[dict[str, Any], float]:
    while True:
        state = c.get(f"/v2/jobs/{job_id}", params={"wait": 30}).json()
        if state["status"] not in ("queued", "running"):
            return state, time.time()


def one_job(c: httpx.Client, hook: str, i: int) -> dict[str, Any]:
    body = digits_body(webhook=hook)
    job = c.post("/v2/models/digits/jobs", json=body).json()
    state, arrived = (follow_events if i % 2 == 0 else long_poll)(c, job["id"])
    assert state["status"] == "succeeded", state
    return {
        "id": job["id"],
        "finished": stamp(state["finished_at"]),
        "how": "events" if i % 2 == 0 else "long_poll",
        "arrived": arrived,
    }


def run(url: str, jobs: int, concurrency: int) -> dict[str, Any]:
    with receiver() as hooks, httpx.Client(base_url=url, timeout=60) as c:
        with ThreadPoolExecutor(concurrency) as pool:
            done = list(pool.map(lambda i: one_job(c, hooks.url, i), range(jobs)))
        deadline = time.monotonic() + 60
        while len(hooks.accepted()) < jobs and time.monotonic() < deadline:
            time.sleep(0.05)
        webhook_at = {d.json["id"]: d.at for d in hooks.accepted()}
    lat: dict[str, list[float]] = {"webhook": [], "events": [], "long_poll": []}
    for job in done:
        lat[job["how"]].append((job["arrived"] - job["finished"]) * 1000)
        if job["id"] in webhook_at:
            lat["webhook"].append((webhook_at[job["id"]] - job["finished"]) * 1000)
    out: dict[str, Any] = {"jobs": jobs, "concurrency": concurrency, "delivered": len(webhook_at)}
    for how, values in lat.items():
        a = np.array(values)
        out[how] = {
            "n": len(values),
            "p50_ms": float(np.percentile(a, 50)) if values else None,
            "p99_ms": float(np.percentile(a, 99)) if values else None,
            "max_ms": float(a.max()) if values else None,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=400)
    parser.add_argument("--concurrency", default="1,8")
    args = parser.parse_args()
    os.environ["INFERQ_WEBHOOK_SECRET"] = SECRET
    levels = [int(c) for c in args.concurrency.split(",")]
    rounds = []
    with Service("--models", "digits", "--webhook-allow", "127.0.0.1") as svc:
        run(svc.url, 20, 1)  # warm-up: connections, the model's first batches
        for level in levels:
            wait_for_quiet()
            rounds.append(run(svc.url, args.jobs, level))
            print(json.dumps(rounds[-1]), flush=True)
    rows = []
    for r in rounds:
        rows.append(
            [
                r["concurrency"],
                f"{r['delivered']}/{r['jobs']}",
                *(
                    f"{fmt(r[h]['p50_ms'])} / {fmt(r[h]['p99_ms'])}"
                    for h in ("webhook", "events", "long_poll")
                ),
            ]
        )
    headers = [
        "concurrency",
        "webhooks delivered",
        "webhook P50 / P99 ms",
        "event stream P50 / P99 ms",
        "long poll P50 / P99 ms",
    ]
    print(markdown_table(headers, rows))
    save("webhooks", {"rounds": rounds, "threads": threading.active_count()})


if __name__ == "__main__":
    main()

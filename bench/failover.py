"""Failover of a Redis Cluster master under load: time to recover, answers, lost jobs, and what
``--job-durability replicated`` costs.

    python bench/failover.py [--runs 2] [--submit-s 5]

Each run (``tests.cluster.load.failover_run``, the scenario the failover test checks): a 3-master
+ 3-replica cluster (``cluster-node-timeout`` 2 s) on this machine, one gateway and two workers
(in-process threads) serving a simulated model (1 ms a batch: the figures show inferq and Redis,
not a model), 12 clients sending synchronous requests with a 3 s deadline back to back and one
client submitting jobs; mid-load the master holding the model's request stream is SIGKILLed.
Counted: every answer by status (200 checked against its request id), the time until a replica is
promoted and until requests succeed again, and jobs accepted with 202 that never succeed, in both
durability modes. Then, on a healthy cluster, job submissions per second and their latency with
``async`` and with ``replicated`` (one client thread per core, ``--submit-s`` each).
Writes bench/results/failover.json with the git revision and the command. Loopback only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import markdown_table, save
from tests.cluster.load import failover_run
from tests.localcluster import LocalCluster
from tests.support import GatewayThread, Stack, WorkerThread, sim_body, write_simulated_model


def submission_cost(repo: Path, durability: str, seconds: float) -> dict[str, Any]:
    started: list[GatewayThread | WorkerThread] = []
    with LocalCluster(masters=3, replicas=1) as cluster:
        try:
            s = Stack(cluster.url, f"bench-{uuid.uuid4().hex[:6]}", repo, started)
            s.add_worker(("sim",))
            s.start_gateway(job_durability=durability)
            s.wait_ready("sim")
            latencies: list[float] = []
            codes: dict[int, int] = {}
            lock = threading.Lock()
            stop = time.monotonic() + seconds

            def client() -> None:
                with httpx.Client(base_url=s.url, timeout=10) as c:
                    while time.monotonic() < stop:
                        t0 = time.perf_counter()
                        r = c.post("/v2/models/sim/jobs", json=sim_body(1.0))
                        with lock:
                            latencies.append(time.perf_counter() - t0)
                            codes[r.status_code] = codes.get(r.status_code, 0) + 1

            threads = [threading.Thread(target=client) for _ in range(4)]
            t0 = time.monotonic()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed = time.monotonic() - t0
        finally:
            for thing in reversed(started):
                thing.stop()
    ordered = sorted(latencies)
    return {
        "durability": durability,
        "submitted_per_s": round(codes.get(202, 0) / elapsed, 1),
        "codes": codes,
        "p50_ms": round(statistics.median(ordered) * 1000, 2),
        "p99_ms": round(ordered[int(0.99 * (len(ordered) - 1))] * 1000, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--submit-s", type=float, default=5.0)
    args = parser.parse_args()
    repo = Path(tempfile.mkdtemp(prefix="inferq-failover-"))
    write_simulated_model(repo, "sim", base_ms=1, per_row_ms=0, max_batch=32)
    runs = []
    for i in range(args.runs):
        for durability in ("async", "replicated"):
            run = failover_run(f"bench-{uuid.uuid4().hex[:6]}", repo, durability)
            print(f"run {i + 1}: {run.line()}", flush=True)
            t = run.tally
            runs.append(
                {
                    "durability": durability,
                    "promotion_s": round(run.promotion_s, 2),
                    "back_after_promotion_s": round(run.back_s, 2),
                    "statuses": dict(t.statuses),
                    "wrong_answers": len(t.wrong),
                    "jobs_accepted": len(t.jobs),
                    "jobs_refused": dict(t.job_refused),
                    "jobs_lost": len(run.lost),
                    "processes_alive": run.processes_alive,
                }
            )
    costs = [submission_cost(repo, d, args.submit_s) for d in ("async", "replicated")]
    print()
    print(
        markdown_table(
            [
                "mode",
                "promoted after s",
                "200 again after s",
                "200",
                "503",
                "504",
                "500",
                "hung",
                "jobs accepted",
                "jobs lost",
            ],
            [
                (
                    r["durability"],
                    r["promotion_s"],
                    r["back_after_promotion_s"],
                    r["statuses"].get("200", 0),
                    r["statuses"].get("503", 0),
                    r["statuses"].get("504", 0),
                    r["statuses"].get("500", 0),
                    r["statuses"].get("hung", 0),
                    r["jobs_accepted"],
                    r["jobs_lost"],
                )
                for r in runs
            ],
        )
    )
    print()
    print(
        markdown_table(
            ["job durability", "submissions/s", "P50 ms", "P99 ms"],
            [(c["durability"], c["submitted_per_s"], c["p50_ms"], c["p99_ms"]) for c in costs],
        )
    )
    path = save(
        "failover",
        {
            "runs": runs,
            "submission_cost": costs,
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()

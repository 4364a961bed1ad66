"""Load for failover runs (the test and bench/failover.py): synchronous requests checked per
request id, and job submissions, counted by outcome."""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from protocol.keys import Keys, Lane
from tests.localcluster import LocalCluster
from tests.support import GatewayThread, Stack, WorkerThread, sim_body, wait_until

DEADLINE_S = 3.0
HUNG_AFTER_S = DEADLINE_S + 5.0
CLIENTS = 12


@dataclass
class Tally:
    statuses: Counter[str] = field(default_factory=Counter)
    wrong: list[int] = field(default_factory=list)
    retry_after_missing: int = 0
    jobs: list[str] = field(default_factory=list)
    job_refused: Counter[int] = field(default_factory=Counter)
    last_ok: float = 0.0
    first_failure: float = 0.0
    ok_after: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def sync_client(s: Stack, tally: Tally, stop: threading.Event, k: int) -> None:
    with httpx.Client(base_url=s.url, timeout=HUNG_AFTER_S) as c:
        i = 0
        while not stop.is_set():
            value = float(k * 100_000 + i)
            i += 1
            try:
                r = c.post(
                    "/v2/models/sim/infer",
                    json=sim_body(value, timeout=int(DEADLINE_S * 1_000_000), cache=False),
                )
            except httpx.TimeoutException:
                with tally.lock:
                    tally.statuses["hung"] += 1
                continue
            except httpx.TransportError:
                with tally.lock:
                    tally.statuses["reset"] += 1  # the connection broke: no answer at all
                continue
            now = time.monotonic()
            with tally.lock:
                tally.statuses[str(r.status_code)] += 1
                if r.status_code == 200:
                    data = next(o for o in r.json()["outputs"] if o["name"] == "sum")["data"]
                    if data != [4.0 * value]:
                        tally.wrong.append(int(value))
                    tally.ok_after.append(now)
                else:
                    tally.first_failure = tally.first_failure or now
                    if r.status_code == 503 and "retry-after" not in r.headers:
                        tally.retry_after_missing += 1


def job_client(s: Stack, tally: Tally, stop: threading.Event) -> None:
    with httpx.Client(base_url=s.url, timeout=HUNG_AFTER_S) as c:
        i = 0
        while not stop.is_set():
            i += 1
            try:
                r = c.post("/v2/models/sim/jobs", json=sim_body(float(i)))
            except httpx.TimeoutException:
                with tally.lock:
                    tally.statuses["job-hung"] += 1
                continue
            except httpx.TransportError:
                with tally.lock:
                    tally.statuses["job-reset"] += 1
                continue
            with tally.lock:
                if r.status_code == 202:
                    tally.jobs.append(r.json()["id"])
                else:
                    tally.job_refused[r.status_code] += 1


def lost_jobs(s: Stack, jobs: list[str], timeout_s: float) -> list[str]:
    """Jobs (accepted with 202) not succeeded within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    pending = set(jobs)
    with httpx.Client(base_url=s.url, timeout=10) as c:
        while pending and time.monotonic() < deadline:
            for job in list(pending):
                r = c.get(f"/v2/jobs/{job}")
                if r.status_code == 200 and r.json()["status"] == "succeeded":
                    pending.discard(job)
            if pending:
                time.sleep(0.2)
    return sorted(pending)


@dataclass
class FailoverRun:
    durability: str
    tally: Tally
    killed_port: int
    promoted_port: int
    promotion_s: float
    """From the SIGKILL until a replica serves the dead master's slots."""
    back_s: float
    """From the promotion until the first request sent after it succeeded."""
    lost: list[str]
    """Jobs accepted with 202 that did not succeed."""
    processes_alive: bool

    def line(self) -> str:
        t = self.tally
        return (
            f"failover durability={self.durability}: killed master :{self.killed_port}, "
            f"replica :{self.promoted_port} promoted after {self.promotion_s:.1f} s; first 200 "
            f"{self.back_s:.2f} s after the promotion; requests {dict(sorted(t.statuses.items()))}"
            f", wrong answers {len(t.wrong)}; jobs accepted {len(t.jobs)}, refused "
            f"{dict(t.job_refused)}, lost {len(self.lost)}"
        )


def failover_run(namespace: str, repo: Path, durability: str) -> FailoverRun:
    """3 masters + 3 replicas, a gateway and two workers serving ``sim``; under load, SIGKILL
    the master that holds ``sim``'s request stream; count every outcome."""
    started: list[GatewayThread | WorkerThread] = []
    with LocalCluster(masters=3, replicas=1) as cluster:
        try:
            s = Stack(cluster.url, namespace, repo, started)
            workers = [s.add_worker(("sim",)) for _ in range(2)]
            s.start_gateway(job_durability=durability)
            s.wait_ready("sim")
            victim = cluster.master_of(Keys(namespace).stream("sim", Lane.NORMAL))
            tally, stop = Tally(), threading.Event()
            with ThreadPoolExecutor(CLIENTS + 1) as pool:
                load = [pool.submit(sync_client, s, tally, stop, k) for k in range(CLIENTS)]
                load.append(pool.submit(job_client, s, tally, stop))
                wait_until(lambda: len(tally.ok_after) > 200, what="load to flow")
                killed = time.monotonic()
                cluster.kill(victim.port)
                promoted_node = cluster.wait_promoted(victim)
                promoted = time.monotonic()
                # Service is back when requests sent after the promotion succeed again.
                wait_until(
                    lambda: sum(1 for t in tally.ok_after if t > promoted) > 100,
                    timeout_s=30,
                    what="requests to succeed after the promotion",
                )
                back = next(t for t in tally.ok_after if t > promoted)
                stop.set()
                for f in load:
                    f.result()
            lost = lost_jobs(s, tally.jobs, timeout_s=20)
            alive = all(w.running for w in workers) and bool(
                s.gateway is not None and s.gateway.server.started
            )
            return FailoverRun(
                durability,
                tally,
                victim.port,
                promoted_node.port,
                promoted - killed,
                back - promoted,
                lost,
                alive,
            )
        finally:
            for thing in reversed(started):
                thing.stop()

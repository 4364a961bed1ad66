"""Redis stalls and restarts under mixed load, counted per request id (issue #21).

``inferq up --workers 2`` (its supervisor restarts a child that exits) on a private
``redis-server`` with AOF, a simulated model that records every row it runs, and mixed load:
sync ``/infer`` requests and async jobs, each with its own id and input, from clients that
retry a 503 for ``RETRY_503_S`` (a 503 should mean "did not run", so a retry is what a
well-behaved client does). Meanwhile Redis is hit ``--times`` times by one fault:

- ``stall``: SIGSTOP for ``STALL_S`` (longer than the 5 s socket timeout), then SIGCONT;
- ``restart``: SIGKILL, then started again at once on its AOF (``appendfsync everysec``).

After each fault, the seconds until a fresh request is answered correctly (recovery, bounded
by ``RECOVERY_BOUND_S``). At the end, per id: answered correctly, refused by final status,
lost (no answer, a wrong answer, or a 202 job that never succeeded), executed twice; the
gateway's Redis connections (``CLIENT LIST`` by name) and, where the code has it, its pool
gauge.

The script imports only what every revision since the bench harness has
(``inferq.redisserver``, ``bench.common.git_revision`` and ``ROOT``), and starts the product as
processes, so the same script measures another checkout: run it with ``PYTHONPATH`` there
(``PYTHONPATH=/work/wt-base python bench/redis_faults.py ...``); the result file records which
revision ran (``bench.common`` comes from that checkout too, so its ``git_revision()`` is that
checkout's). Simulated model: figures are about inferq, not a model.

    PYTHONPATH=$PWD python bench/redis_faults.py --fault stall --times 3 --label after
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from bench.common import ROOT, git_revision
from inferq.redisserver import RedisServer, free_port

STALL_S = 7.0
"""The red team's stall: longer than redis-py's and inferq's 5 s socket timeout."""
WARMUP_S = 3.0
STEADY_S = 4.0
"""Load between the recovery after one fault and the next fault."""
RECOVERY_BOUND_S = 60.0
RETRY_503_S = 10.0
SYNC_LANES = 8
JOB_LANES = 2
SYNC_TIMEOUT_US = 20_000_000
"""Each sync request's deadline (20 s: longer than a stall)."""
JOB_SETTLE_S = 60.0
MODEL = "chaos"
JOB_BASE = 1_000_000
PROBE_BASE = 2_000_000


def write_model(repo: Path, runs: Path) -> None:
    folder = repo / MODEL
    (folder / "1").mkdir(parents=True)
    (folder / "config.toml").write_text(
        f"""backend = "simulated"
max_batch = 16
flush_ms = 2.0
default_timeout_ms = 10000

[cache]
enabled = false

[simulated]
base_ms = 20
per_row_ms = 0.1
executions_dir = {json.dumps(str(runs))}

[[inputs]]
name = "x"
datatype = "FP32"
shape = [-1, 4]

[[outputs]]
name = "sum"
datatype = "FP32"
shape = [-1, 1]
"""
    )


def body(i: int, **parameters: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "id": f"req-{i}",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [i] * 4}],
    }
    if parameters:
        doc["parameters"] = parameters
    return doc


def correct(i: int, doc: Any) -> bool:
    try:
        return bool(doc["outputs"][0]["data"] == [4.0 * i])
    except (KeyError, IndexError, TypeError):
        return False


def executions(runs: Path) -> Counter[int]:
    counts: Counter[int] = Counter()
    for record in runs.glob("*.rows"):
        for line in record.read_text().splitlines():
            if line:
                counts[int(float(line))] += 1
    return counts


@dataclass
class Tally:
    status: dict[int, int] = field(default_factory=dict)
    """Final HTTP status per id (0: no answer)."""
    right: set[int] = field(default_factory=set)
    jobs: dict[int, str] = field(default_factory=dict)
    """Job input -> job id, for the 202s."""
    messages: dict[int, str] = field(default_factory=dict)
    """The first error message per status."""
    retried: int = 0

    def note(self, i: int, status: int, doc: Any) -> None:
        self.status[i] = status
        if status not in (200, 202) and status not in self.messages:
            self.messages[status] = str(doc.get("error", ""))[:200] if isinstance(doc, dict) else ""


async def post(client: httpx.AsyncClient, path: str, doc: dict[str, Any]) -> tuple[int, Any]:
    try:
        r = await client.post(path, json=doc, timeout=SYNC_TIMEOUT_US / 1e6 + 10)
    except httpx.HTTPError:
        return 0, None
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, None


async def lane(url: str, ids: Any, tally: Tally, stop: asyncio.Event, *, job: bool) -> None:
    async with httpx.AsyncClient(base_url=url) as client:
        while not stop.is_set():
            i = next(ids)
            path = f"/v2/models/{MODEL}/{'jobs' if job else 'infer'}"
            doc = body(i) if job else body(i, timeout=SYNC_TIMEOUT_US)
            give_up = time.monotonic() + RETRY_503_S
            while True:
                status, reply = await post(client, path, doc)
                if status == 503 and time.monotonic() < give_up:
                    tally.retried += 1
                    await asyncio.sleep(0.2)
                    continue
                break
            tally.note(i, status, reply)
            if status == 200 and correct(i, reply):
                tally.right.add(i)
            if status == 202 and isinstance(reply, dict):
                tally.jobs[i] = reply["id"]


async def recovered_after(url: str, probe: Any) -> float | None:
    """Seconds until a fresh request is answered correctly, or None past the bound."""
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=url) as client:
        while time.monotonic() - started < RECOVERY_BOUND_S:
            i = next(probe)
            try:
                r = await client.post(
                    f"/v2/models/{MODEL}/infer", json=body(i, timeout=2_000_000), timeout=5
                )
                if r.status_code == 200 and correct(i, r.json()):
                    return round(time.monotonic() - started, 2)
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    return None


async def settle_jobs(url: str, tally: Tally) -> dict[str, int]:
    """Each 202 job's final state (``succeeded`` checked for its value)."""
    ends: dict[int, str] = {}
    last: dict[int, str] = {}
    deadline = time.monotonic() + JOB_SETTLE_S
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        while len(ends) < len(tally.jobs) and time.monotonic() < deadline:
            for i, job_id in tally.jobs.items():
                if i in ends:
                    continue
                try:
                    r = await client.get(f"/v2/jobs/{job_id}")
                except httpx.HTTPError:
                    continue
                if r.status_code != 200:
                    if r.status_code != 503:
                        ends[i] = str(r.status_code)
                    continue
                doc = r.json()
                last[i] = doc["status"]
                if doc["status"] == "succeeded":
                    ends[i] = "correct" if correct(i, doc.get("result")) else "wrong"
                    if ends[i] == "correct":
                        tally.right.add(i)
                elif doc["status"] in ("failed", "expired", "cancelled"):
                    ends[i] = doc["status"]
            await asyncio.sleep(0.5)
    for i in tally.jobs:
        ends.setdefault(i, f"still {last.get(i, 'unknown')}")
    return dict(Counter(ends.values()))


def connections(r: redis.Redis) -> dict[str, int]:
    """Connections open on Redis now, by client name with the process id left out."""
    names: Counter[str] = Counter()
    for c in r.client_list():
        name = c.get("name") or "(unnamed)"
        names[re.sub(r"-[0-9a-f]{6,}.*$|-vm-.*$|-\w+-\d+-\w+$", "", name)] += 1
    return dict(sorted(names.items()))


def pool_gauge(url: str) -> dict[str, float] | None:
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    found = {}
    for line in text.splitlines():
        m = re.match(r'inferq_redis_pool_connections\{state="(\w+)"\} ([0-9.e+]+)', line)
        if m:
            found[m.group(1)] = float(m.group(2))
    return found or None


def wait_ready(url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/v2/models/{MODEL}/ready", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError("inferq up did not serve the model within 60 s")


def fault(server: RedisServer, kind: str) -> None:
    assert server._process is not None
    if kind == "stall":
        pid = server._process.pid
        os.kill(pid, signal.SIGSTOP)
        time.sleep(STALL_S)  # the fault: Redis answers nothing this long
        os.kill(pid, signal.SIGCONT)
    else:
        server._process.kill()  # SIGKILL: no final AOF flush
        server._process.wait()
        server._process = None
        server.start()  # same port and folder: replays its AOF


async def drive(
    url: str, server: RedisServer, kind: str, times: int, job_lanes: int
) -> tuple[Tally, list, dict]:
    """The load with ``times`` faults in it; then every job's end."""
    tally = Tally()
    stop = asyncio.Event()
    sync_ids = iter(range(0, JOB_BASE))
    job_ids = iter(range(JOB_BASE, PROBE_BASE))
    probe = iter(range(PROBE_BASE, 3 * JOB_BASE))
    lanes = [
        *(lane(url, sync_ids, tally, stop, job=False) for _ in range(SYNC_LANES)),
        *(lane(url, job_ids, tally, stop, job=True) for _ in range(job_lanes)),
    ]
    load = asyncio.gather(*lanes)
    await asyncio.sleep(WARMUP_S)
    recoveries: list[float | None] = []
    for _ in range(times):
        await asyncio.to_thread(fault, server, kind)
        recoveries.append(await recovered_after(url, probe))
        await asyncio.sleep(STEADY_S)
    stop.set()
    await load
    return tally, recoveries, await settle_jobs(url, tally)


def scenario(kind: str, times: int, job_lanes: int = JOB_LANES) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="redis-faults-") as tmp:
        root = Path(tmp)
        (root / "redis").mkdir()
        write_model(root / "models", root / "runs")
        server = RedisServer(
            extra_args=("--appendonly", "yes", "--appendfsync", "everysec"),
            data_dir=root / "redis",
        ).start()
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        up = subprocess.Popen(
            [
                sys.executable, "-m", "inferq", "up",
                "--redis", server.url,
                "--port", str(port), "--grpc-port", "0", "--metrics-port", "0",
                "--model-repository", str(root / "models"),
                "--workers", "2", "--heartbeat-s", "0.5", "--log-level", "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(root / "up.log").open("wb"),
            start_new_session=True,
            cwd=root,  # not this checkout: `-m` puts the cwd first on the children's path
        )  # fmt: skip
        r = redis.Redis.from_url(server.url)
        try:
            wait_ready(url)
            before = connections(r)
            tally, recoveries, jobs = asyncio.run(drive(url, server, kind, times, job_lanes))
            runs = executions(root / "runs")
            after = connections(r)
            pool = pool_gauge(url)
            ready = httpx.get(f"{url}/v2/health/ready", timeout=10)
        finally:
            r.close()
            os.killpg(up.pid, signal.SIGTERM)
            try:
                up.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait()
            server.stop()
        log = (root / "up.log").read_text(errors="replace")
    measured = [i for i in tally.status if i < PROBE_BASE]
    statuses = Counter(tally.status[i] for i in measured)
    sync = [i for i in measured if i < JOB_BASE]
    job_inputs = [i for i in measured if i >= JOB_BASE]
    return {
        "fault": kind,
        "times": times,
        "sync_lanes": SYNC_LANES,
        "job_lanes": job_lanes,
        "stall_s": STALL_S if kind == "stall" else None,
        "sent": len(measured),
        "sync_sent": len(sync),
        "jobs_sent": len(job_inputs),
        "correct": len([i for i in measured if i in tally.right]),
        "final_status": {str(k): v for k, v in sorted(statuses.items())},
        "refused": {str(s): statuses[s] for s in (429, 503, 504) if statuses[s]},
        "messages": {str(k): v for k, v in sorted(tally.messages.items())},
        "lost": statuses[0]
        + len([i for i in sync if tally.status[i] == 200 and i not in tally.right])
        + len([i for i in job_inputs if tally.status[i] == 202 and i not in tally.right]),
        "jobs_202": len(tally.jobs),
        "jobs_final": jobs,
        "executed_twice": sum(1 for i, n in runs.items() if n > 1 and i < PROBE_BASE),
        "ran_after_503": sum(1 for i in measured if tally.status[i] == 503 and runs[i] > 0),
        "ran_after_504": sum(1 for i in measured if tally.status[i] == 504 and runs[i] > 0),
        "retried_503": tally.retried,
        "recovery_s": recoveries,
        "connections_before": before,
        "connections_after": after,
        "pool_gauge_after": pool,
        "ready_after": ready.status_code,
        "unclosed_pipeline_warnings": log.count("Unclosed Pipeline"),
        "child_exits": log.count("child exited") + log.count('"child restarted"'),
        "restarts": log.count("restarted"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fault", choices=("stall", "restart"), action="append")
    parser.add_argument("--times", type=int, default=None, help="3 stalls, 2 restarts")
    parser.add_argument(
        "--job-lanes", type=int, default=JOB_LANES, help="concurrent job submitters"
    )
    parser.add_argument("--label", default="run", help="names the result file")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "summaries")
    args = parser.parse_args()
    results = []
    for kind in args.fault or ["stall", "restart"]:
        times = args.times or (3 if kind == "stall" else 2)
        result = scenario(kind, times, args.job_lanes)
        print(json.dumps(result), flush=True)
        results.append(result)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"redis_faults-{args.label}.json"
    path.write_text(json.dumps(stamped(results), indent=2))
    print(f"wrote {path}")


def stamped(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The result file: which checkout ran (``bench.common.git_revision`` of the checkout on
    ``PYTHONPATH``, and where it is), how, on what, and the results."""
    return {
        "revision": f"{git_revision()} ({ROOT})",
        "command": " ".join(
            [f"PYTHONPATH={os.environ.get('PYTHONPATH', '')}", "python", *sys.argv]
        ),
        "machine": f"{platform.node()} {os.cpu_count()} CPUs",
        "simulated_model": True,
        "results": results,
    }


if __name__ == "__main__":
    main()

"""Scale to zero and back: cold starts, a bursty load at ``--workers 0:4`` against a fixed 4,
and what an idle deployment holds.

    python bench/autoscale.py [--rounds 8] [--minilm-rounds 4] [--skip-minilm]
                              [--burst 20:8s,200:8s,20:8s] [--tail-s 15]

1. **Cold start by stage** (digits, and minilm, which it builds into a temporary repository
   first): ``inferq up --workers 0:1 --scale-down-after-s 1``; each round waits until the stack
   has scaled to zero (no worker process), sends one request and times its stages from the
   JSON log lines (UTC timestamps) and Redis: arrival -> the scaling decision (``scaling up``)
   -> the worker process started (``child started``) -> the worker connected to Redis
   (``CLIENT LIST`` shows its connection: Python and the imports are done) -> the model loaded,
   warmed and advertised (``worker started``) -> the answer. A second request right after is
   the warm latency, for scale. P50/P99 of the first requests after idle.
2. **Bursty open loop** on the simulated model ``sim`` (40 ms a batch of up to 4 rows: one
   worker serves about 100 requests/s; simulated, not a real model): idle until the 0:4 stack is
   at zero, then Poisson arrivals following ``--burst`` (20 -> 200 -> 20 requests/s), then
   ``--tail-s`` of idleness. Both stacks run the same schedule and seed, one after the other:
   P50/P99, refusals by status, and worker-seconds (live worker processes sampled every 0.1 s
   from the start of the load to the end of the tail).
3. **Memory of an idle deployment**: resident memory (RSS) of ``inferq up``, its gateway, its
   workers and Redis, serving digits: fixed 4 once all four serve, 0:4 once it is at zero.

Loopback only; every loop is bounded in time and count. Writes bench/results/autoscale.json and
bench/summaries/autoscale.json.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import shutil
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from statistics import median
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    Service,
    digits_body,
    infer_request,
    markdown_table,
    model_repository,
    save,
    wait_for_quiet,
)
from loadgen.http import run as run_loop
from loadgen.loop import LoadOptions
from loadgen.open import run_open_loop
from loadgen.schedule import RateSchedule

SIM = {"base_ms": 40, "per_row_ms": 0, "max_batch": 4}
SIM_BODY = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
LONG_TIMEOUT_US = 120_000_000


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _ts(record: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(record["timestamp"]).replace("Z", "+00:00")).timestamp()


class Up(Service):
    """``bench.common.Service`` serving ``repo`` with info logs, its JSON log records (its
    children's too) read back from the file its processes write them to."""

    def __init__(self, repo: Path, *flags: str, workers: str) -> None:
        self._logs = Path(tempfile.mkdtemp(prefix="inferq-bench-autoscale-"))
        log = self._logs / "up.log"
        super().__init__(
            "--model-repository",
            str(repo),
            "--log-level",
            "info",
            *flags,
            workers=workers,
            env={"PYTHONUNBUFFERED": "1"},
            stdout=log,
            stderr=log,
        )
        self._log = log
        self._read_to = 0
        self.records: list[dict[str, Any]] = []

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            shutil.rmtree(self._logs, ignore_errors=True)

    def _read(self) -> None:
        """Decode the records of the lines written since the last call (whole lines only)."""
        with self._log.open("rb") as fh:
            fh.seek(self._read_to)
            chunk = fh.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._read_to += len(complete)
        decoder = json.JSONDecoder()
        for line in complete.decode(errors="replace").splitlines():
            pos = line.find("{")
            while pos != -1:
                try:
                    doc, end = decoder.raw_decode(line, pos)
                except json.JSONDecodeError:
                    break
                self.records.append(doc)
                pos = line.find("{", end)

    def events(self, name: str, after: float = 0.0, **match: object) -> list[dict[str, Any]]:
        self._read()
        return [
            r
            for r in list(self.records)
            if r.get("event") == name
            and all(r.get(k) == v for k, v in match.items())
            and _ts(r) >= after
        ]

    def children(self) -> dict[int, str]:
        """Pid -> role (``worker``, ``gateway``) of the processes ``inferq up`` runs now."""
        assert self.proc is not None
        out: dict[int, str] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(stat[1]) != self.proc.pid or stat[0] == "Z":
                    continue
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                for role in (b"worker", b"gateway"):
                    if role in argv:
                        out[int(entry.name)] = role.decode()
        return out

    def live_workers(self) -> int:
        return sum(1 for role in self.children().values() if role == "worker")

    def rss_mib(self) -> dict[str, float]:
        assert self.proc is not None
        pids: dict[str, list[int]] = {"up": [self.proc.pid]}
        for pid, role in self.children().items():
            pids.setdefault(role, []).append(pid)
        with redis.Redis.from_url(self.redis.url) as r:
            pids["redis"] = [int(r.info("server")["process_id"])]
        return {role: round(sum(_rss_kib(p) for p in ps) / 1024, 1) for role, ps in pids.items()}

    def worker_connected(self) -> bool:
        with redis.Redis.from_url(self.redis.url) as r:
            return any(str(c.get("name", "")).startswith("inferq-worker-") for c in r.client_list())


def _rss_kib(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def wait(check: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.02)


def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, float]:
    request = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "cache-control": "no-cache"},
    )
    started = time.time()
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
    return status, time.time() - started


# -- 1. cold starts ---------------------------------------------------------------------------


class ConnectWatch:
    """The moment a worker's connection shows in Redis's ``CLIENT LIST`` (polled at 50 Hz on
    a thread): its Python has started and imported everything, and it has dialled Redis."""

    def __init__(self, up: Up) -> None:
        self.up = up
        self.at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._stop.is_set() and self.at is None:
            with contextlib.suppress(redis.RedisError):
                if self.up.worker_connected():
                    self.at = time.time()
            self._stop.wait(0.02)

    def __enter__(self) -> ConnectWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def one_cold_start(up: Up, path: str, body: dict[str, Any], stops: int) -> dict[str, float]:
    """Once the stack is at zero (``stops`` workers stopped so far), one request, timed."""
    wait(lambda: len(up.events("child stopped")) == stops, "the stack at zero")
    wait(lambda: up.live_workers() == 0 and not up.worker_connected(), "no worker")
    time.sleep(0.5)  # idle for real: no process of the last round still exiting
    with ConnectWatch(up) as connect:
        t0 = time.time()
        status, latency = post(up.url, path, body)
    if status != 200 or connect.at is None:
        raise RuntimeError(f"cold request answered {status}")
    decided = up.events("scaling up", after=t0)[0]
    spawned = up.events("child started", after=t0)[0]
    started = up.events("worker started", after=t0)[0]
    stamps = [t0, _ts(decided), _ts(spawned), connect.at, _ts(started), t0 + latency]
    stages = [b - a for a, b in itertools.pairwise(stamps)]
    names = ["decision_s", "spawn_s", "python_and_connect_s", "model_load_s", "to_answer_s"]
    return {**dict(zip(names, stages, strict=True)), "total_s": latency}


def cold_starts(repo: Path, model: str, body: dict[str, Any], rounds: int) -> dict[str, Any]:
    path = f"/v2/models/{model}/infer"
    flags = ("--models", model, "--scale-down-after-s", "1")
    rows: list[dict[str, float]] = []
    warm: list[float] = []
    with Up(repo, *flags, "--scale-interval-s", "0.2", workers="0:1") as up:
        for i in range(rounds):
            rows.append(one_cold_start(up, path, body, stops=i + 1))
            warm.append(post(up.url, path, body)[1])
            print(f"  {model} round {i + 1}: {rows[-1]['total_s']:.2f} s", flush=True)
    firsts = [r["total_s"] for r in rows]
    return {
        "rounds": rows,
        "median_by_stage_s": {k: round(median(r[k] for r in rows), 3) for k in rows[0]},
        "first_request_p50_s": percentile(firsts, 0.5),
        "first_request_p99_s": percentile(firsts, 0.99),
        "warm_p50_ms": round(1000 * (percentile(warm, 0.5) or 0), 1),
    }


# -- 2. bursty load ---------------------------------------------------------------------------


class WorkerSeconds:
    """Live worker processes, sampled every ``step_s`` on a thread, integrated."""

    def __init__(self, up: Up, step_s: float = 0.1) -> None:
        self.up, self.step_s = up, step_s
        self.total = 0.0
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.is_set():
            n = self.up.live_workers()
            now = time.monotonic()
            self.total += n * (now - last)
            self.peak = max(self.peak, n)
            last = now
            self._stop.wait(self.step_s)

    @contextlib.contextmanager
    def running(self) -> Iterator[WorkerSeconds]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()


def bursty(repo: Path, workers: str, schedule: str, tail_s: float, *extra: str) -> dict[str, Any]:
    flags = (
        *extra,
        "--models",
        "sim",
        "--scale-down-after-s",
        "5",
        "--scale-backlog-per-worker",
        "8",
        "--scale-interval-s",
        "0.25",
    )
    rate = RateSchedule.parse(schedule)
    request = infer_request("sim", SIM_BODY)
    with Up(repo, *flags, workers=workers) as up:
        if workers.startswith("0:"):
            wait(lambda: up.live_workers() == 0, "the stack at zero")
        else:
            wait(lambda: up.live_workers() == int(workers), "every worker")
        time.sleep(1.0)
        with WorkerSeconds(up).running() as used:
            result = run_loop(
                run_open_loop(
                    LoadOptions(
                        up.url + request.path,
                        duration_s=rate.length_s,
                        requests=request,
                        warmup_s=0.0,
                        timeout_s=30.0,
                    ),
                    rate,
                    seed=7,
                )
            )
            time.sleep(tail_s)
        scaling = [
            (r["event"], r["workers_wanted"], r["reason"])
            for r in up.events("scaling up") + up.events("scaling down")
        ]
    refusals = {str(s): n for s, n in result.status_counts.items() if s != 200}
    return {
        "workers": workers,
        "requests": result.requests,
        "ok": result.ok,
        "refusals": refusals,
        "errors": result.errors,
        "p50_ms": result.latency_ms.get("p50"),
        "p99_ms": result.latency_ms.get("p99"),
        "max_ms": result.latency_ms.get("max"),
        "worker_seconds": round(used.total, 1),
        "window_s": round(rate.length_s + tail_s, 1),
        "peak_workers": used.peak,
        "scaling": scaling,
    }


# -- 3. idle memory ---------------------------------------------------------------------------


def idle_memory(repo: Path, workers: str) -> dict[str, Any]:
    flags = ("--models", "digits", "--scale-down-after-s", "2")
    with Up(repo, *flags, workers=workers) as up:
        if workers.startswith("0:"):
            wait(lambda: up.live_workers() == 0, "the stack at zero")
        else:
            wait(
                lambda: len(up.events("worker started")) == int(workers),
                "every worker serving",
            )
        time.sleep(2.0)
        rss = up.rss_mib()
    return {"workers": workers, "rss_mib": rss, "total_mib": round(sum(rss.values()), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--minilm-rounds", type=int, default=4)
    parser.add_argument("--skip-minilm", action="store_true")
    parser.add_argument("--burst", default="20:8s,200:8s,20:8s")
    parser.add_argument("--tail-s", type=float, default=15.0)
    args = parser.parse_args()
    idle_share = wait_for_quiet(max_wait_s=30.0)
    out: dict[str, Any] = {
        "simulated_model": {"sim": SIM},
        "burst": args.burst,
        "cpu_idle_share_at_start": idle_share,
    }
    with model_repository(digits=True, sim=SIM) as repo:
        print("cold starts: digits", flush=True)
        # A deadline long enough for any cold start here: the figure is the cold start itself.
        body = digits_body(timeout=LONG_TIMEOUT_US)
        out["cold_start"] = {"digits": cold_starts(repo, "digits", body, args.rounds)}
        if not args.skip_minilm:
            from bench.minilm import build

            minilm_repo = Path(tempfile.mkdtemp(prefix="inferq-bench-minilm-"))
            try:
                build(minilm_repo)
                sentence = {
                    "inputs": [
                        {"name": "text", "datatype": "BYTES", "shape": [1], "data": ["a test"]}
                    ],
                    "parameters": {"timeout": LONG_TIMEOUT_US},
                }
                print("cold starts: minilm", flush=True)
                out["cold_start"]["minilm"] = cold_starts(
                    minilm_repo, "minilm", sentence, args.minilm_rounds
                )
            finally:
                shutil.rmtree(minilm_repo, ignore_errors=True)
        out["bursty"] = {}
        # The default (one worker starting at a time) and all four at once, against a fixed 4.
        variants = {
            "0:4": ("0:4",),
            "0:4 max-starting 4": ("0:4", "--scale-max-starting", "4"),
            "4": ("4",),
        }
        for label, (workers, *extra) in variants.items():
            print(f"bursty load: --workers {label}", flush=True)
            out["bursty"][label] = bursty(repo, workers, args.burst, args.tail_s, *extra)
        out["idle_memory"] = {w: idle_memory(repo, w) for w in ("4", "0:4")}
    save("autoscale", out)
    report(out)


def report(out: dict[str, Any]) -> None:
    stages = ["decision_s", "spawn_s", "python_and_connect_s", "model_load_s", "to_answer_s"]
    rows = []
    for model, c in out["cold_start"].items():
        m = c["median_by_stage_s"]
        rows.append(
            [
                model,
                *(f"{m[s] * 1000:.0f}" for s in stages),
                f"{c['first_request_p50_s']:.2f}",
                f"{c['first_request_p99_s']:.2f}",
                f"{c['warm_p50_ms']:.1f}",
            ]
        )
    print(
        markdown_table(
            [
                "model",
                "decision ms",
                "spawn ms",
                "python+connect ms",
                "load+warm ms",
                "to answer ms",
                "first P50 s",
                "first P99 s",
                "warm P50 ms",
            ],
            rows,
        )
    )
    b = out["bursty"]
    print(
        markdown_table(
            ["workers", "requests", "ok", "refusals", "P50 ms", "P99 ms", "worker-s", "peak"],
            [
                [
                    label,
                    r["requests"],
                    r["ok"],
                    sum(r["refusals"].values()),
                    r["p50_ms"],
                    r["p99_ms"],
                    r["worker_seconds"],
                    r["peak_workers"],
                ]
                for label, r in b.items()
            ],
        )
    )
    ratio = b["0:4"]["worker_seconds"] / max(b["4"]["worker_seconds"], 1e-9)
    print(f"worker-seconds 0:4 / fixed 4: {ratio:.2f}")
    mem = out["idle_memory"]
    print(
        markdown_table(
            ["workers", "up", "gateway", "workers MiB", "redis", "total MiB"],
            [
                [
                    w,
                    m["rss_mib"].get("up"),
                    m["rss_mib"].get("gateway"),
                    m["rss_mib"].get("worker", 0),
                    m["rss_mib"].get("redis"),
                    m["total_mib"],
                ]
                for w, m in mem.items()
            ],
        )
    )


if __name__ == "__main__":
    main()

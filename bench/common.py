"""The one harness of the benchmark scripts: what each of them would otherwise write again.

A private Redis and `inferq up` (``Service``, also another checkout's for an A/B run), waiting
for readiness (``wait_until``, ``wait_ready``), temporary model repositories (digits, the medium
network, simulated models), closed and open loops through loadgen in this process, in-process
call rates, CPU meters from /proc, Redis command counts, tables, and ``save()``, which stamps
every result with the revision, the command and the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import redis

from inferq.redisserver import RedisServer, free_port
from loadgen.closed import run_closed_loop
from loadgen.http import PreparedRequest
from loadgen.http import run as run_loop
from loadgen.loop import LoadOptions
from loadgen.open import run_open_loop
from loadgen.result import LoadResult

ROOT = Path(__file__).resolve().parent.parent
DIGITS_SAMPLES: dict[str, Any] = json.loads((ROOT / "models/digits/samples.json").read_text())
"""One held-out example per digit, as shipped with the example model."""


def digits_body(row: list[float] | None = None, **parameters: Any) -> dict[str, Any]:
    """A one-row V2 request for ``digits`` (the first sample unless ``row`` is given)."""
    body: dict[str, Any] = {
        "inputs": [
            {
                "name": "input",
                "datatype": "FP32",
                "shape": [1, 64],
                "data": row or DIGITS_SAMPLES["inputs"][0],
            }
        ]
    }
    if parameters:
        body["parameters"] = parameters
    return body


RESULTS = ROOT / "bench" / "results"


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
    }


_STATS: dict[str, redis.Redis] = {}


def command_calls(url: str) -> dict[str, int]:
    """Calls per command from INFO commandstats (cumulative since the server started), over
    one connection per URL kept for the run: a new one would add its own HELLO to the count."""
    client = _STATS.get(url)
    if client is None:
        client = _STATS[url] = redis.Redis.from_url(url)
    stats = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


def calls_between(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    diff = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return {k: v for k, v in sorted(diff.items(), key=lambda kv: -kv[1]) if v}


def wait_until(
    check: Callable[[], bool],
    what: str,
    *,
    timeout_s: float = 60.0,
    proc: subprocess.Popen[bytes] | None = None,
) -> None:
    """Poll ``check`` (OSError counts as not yet) until it holds; fail if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            if check():
                return
        time.sleep(0.2)
    raise RuntimeError(f"{what}: not after {timeout_s:.0f} s")


def answers(url: str) -> bool:
    """Whether ``url`` answers a GET with 200."""
    with urllib.request.urlopen(url, timeout=2) as r:
        return bool(r.status == 200)


def wait_ready(
    url: str, *, proc: subprocess.Popen[bytes] | None = None, timeout_s: float = 60.0
) -> None:
    """Until a V2 server at ``url`` reports ready."""
    wait_until(
        lambda: answers(f"{url}/v2/health/ready"), f"{url} ready", timeout_s=timeout_s, proc=proc
    )


def _declares(root: Path, flag: str) -> bool:
    """Whether the checkout at ``root`` declares a command-line flag (another revision's, in an
    A/B run, may predate it)."""
    return any(flag in p.read_text() for p in root.glob("*/*.py"))


class Service:
    """`inferq up` against a private Redis, for one benchmark run."""

    def __init__(
        self,
        *extra: str,
        workers: int | str = 1,
        root: Path = ROOT,
        env: dict[str, str] | None = None,
        stdout: Path | None = None,
        stderr: Path | None = None,
    ) -> None:
        """``workers``: N, or MIN:MAX to scale; ``root``: the checkout whose code runs (another
        revision's, for an A/B run); ``env``: variables added to its environment; ``stdout``,
        ``stderr``: files its processes append to (the same file for both: one stream of
        lines; its JSON logs are on stderr)."""
        self.env = env or {}
        self.stdout = stdout
        self.stderr = stderr
        self.redis = RedisServer()
        self.root = root
        self.port = free_port()
        # Its own gRPC port too: the default (8001) would be shared through SO_REUSEPORT with
        # anything else listening there.
        self.grpc_port = free_port()
        self.extra = extra
        self.workers = workers
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Service:
        self.redis.start()
        out = self.stdout.open("ab") if self.stdout else None
        err = out if self.stderr == self.stdout else None
        if err is None and self.stderr is not None:
            err = self.stderr.open("ab")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "inferq",
                "up",
                "--redis",
                self.redis.url,
                "--port",
                str(self.port),
                *(
                    ("--grpc-port", str(self.grpc_port))
                    if _declares(self.root, "--grpc-port")
                    else ()
                ),
                "--workers",
                str(self.workers),
                "--log-level",
                "warning",
                "--model-repository",
                str(ROOT / "models"),
                # No fixed metrics ports: runs (and anything else on the machine) would collide.
                "--metrics-port",
                "0",
                *self.extra,
            ],
            stdout=out or subprocess.DEVNULL,
            stderr=err,
            cwd=self.root,
            env={**os.environ, **self.env, "PYTHONPATH": str(self.root)},
        )
        for f in (out, err):  # the processes hold their own copies
            if f is not None:
                f.close()
        try:
            wait_ready(self.url, proc=self.proc)
        except RuntimeError:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(60)
        self.redis.stop()

    def processes(self) -> dict[int, str]:
        """The processes `inferq up` started, by pid: ``"gateway"`` or ``"worker"``."""
        assert self.proc is not None
        out: dict[int, str] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                if ppid != self.proc.pid:
                    continue
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except (OSError, ValueError, IndexError):
                continue
            for role in (b"gateway", b"worker"):
                if role in argv:
                    out[int(entry.name)] = role.decode()
        return out

    def model_metadata(self, model: str) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.url}/v2/models/{model}", timeout=5) as r:
            data: dict[str, Any] = json.loads(r.read())
            return data

    def wait_for_workers(self, model: str, n: int, timeout_s: float = 120.0) -> None:
        """Until ``n`` live workers serve ``model`` (`inferq up` is ready with the first)."""

        def served() -> bool:
            with contextlib.suppress(ValueError, KeyError):
                return int(self.model_metadata(model)["parameters"]["workers"]) >= n
            return False

        wait_until(served, f"{n} workers serving {model}", timeout_s=timeout_s)

    def role_pids(self) -> dict[str, list[int]]:
        """The processes by role: ``gateway`` and ``worker`` (`inferq up`'s), and ``redis``."""
        roles: dict[str, list[int]] = {}
        for pid, role in self.processes().items():
            roles.setdefault(role, []).append(pid)
        with redis.Redis.from_url(self.redis.url) as r:
            roles["redis"] = [int(r.info("server")["process_id"])]
        return roles


SUMMARIES = ROOT / "bench" / "summaries"
"""Committed: the figures BENCHMARKS.md quotes, each file with its revision, command and machine
(``bench/results/`` holds the same and more, and is not committed)."""


def save(
    name: str, data: dict[str, Any], *, commit: bool = True, omit: Collection[str] = ()
) -> Path:
    """Write a run's results to ``bench/results/NAME.json`` and (``commit``) the committed
    ``bench/summaries/NAME.json`` without the ``omit`` keys (raw rounds, profiles), both
    stamped with the git revision, the command and the machine unless they say already."""
    stamped = {
        "revision": git_revision(),
        "command": " ".join(["python", *sys.argv]),
        "machine": machine(),
        **data,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(stamped, indent=2, default=str))
    if commit:
        SUMMARIES.mkdir(parents=True, exist_ok=True)
        summary = {k: v for k, v in stamped.items() if k not in omit}
        (SUMMARIES / f"{name}.json").write_text(json.dumps(summary, indent=2, default=str))
    return RESULTS / f"{name}.json"


def git_revision(root: Path = ROOT) -> str:
    """The commit the working tree (of ``root``) is at, with ``+dirty`` when it has changes."""
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return f"{rev}+dirty" if dirty else rev or "unknown"


@contextlib.contextmanager
def model_repository(
    *, digits: bool = False, medium: bool = False, **simulated: dict[str, Any]
) -> Iterator[Path]:
    """A temporary model repository: ``name={"base_ms": ..., "per_row_ms": ..., "max_batch":
    ...}`` per simulated model (``tests.support.write_simulated_model`` arguments), plus a copy
    of the real digits model when ``digits`` and the medium network (``bench/medium_model.py``,
    random weights) when ``medium``. Removed on exit."""
    from bench import medium_model
    from tests.support import write_simulated_model

    repo = Path(tempfile.mkdtemp(prefix="inferq-bench-"))
    try:
        if digits:
            shutil.copytree(
                ROOT / "models" / "digits",
                repo / "digits",
                ignore=shutil.ignore_patterns("train.py", "__pycache__"),
            )
        if medium:
            medium_model.write(repo)
        for name, options in simulated.items():
            write_simulated_model(repo, name, **options)
        yield repo
    finally:
        shutil.rmtree(repo, ignore_errors=True)


def infer_request(model: str, body: dict[str, Any]) -> PreparedRequest:
    """A JSON inference POST that bypasses the result cache (``Cache-Control: no-cache``)."""
    return PreparedRequest(
        "POST",
        f"/v2/models/{model}/infer",
        json.dumps(body).encode(),
        {"content-type": "application/json", "cache-control": "no-cache"},
    )


def fmt(value: float | None, digits: int = 2) -> str:
    """A table cell: thousands separators for big numbers, ``-`` for missing ones."""
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured Markdown table (cells already formatted, or ``fmt``-ed here)."""

    def cell(v: object) -> str:
        return fmt(v) if isinstance(v, float) or v is None else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def closed_loop(
    target: Service | str,
    requests: PreparedRequest | Sequence[PreparedRequest],
    *,
    concurrency: int,
    duration_s: float,
    warmup_s: float = 1.0,
    timeout_s: float = 60.0,
) -> LoadResult:
    """A closed-loop run against ``target`` (a service or its base URL; on uvloop, in this
    process); several ``requests`` are cycled through."""
    first = requests if isinstance(requests, PreparedRequest) else requests[0]
    url = (target.url if isinstance(target, Service) else target) + first.path
    return run_loop(
        run_closed_loop(
            LoadOptions(
                url,
                duration_s=duration_s,
                requests=requests,
                warmup_s=warmup_s,
                timeout_s=timeout_s,
            ),
            concurrency,
        )
    )


def open_loop(
    service: Service,
    request: PreparedRequest,
    *,
    rate: float,
    duration_s: float,
    warmup_s: float = 1.0,
    timeout_s: float = 60.0,
    max_connections: int = 2048,
    seed: int = 0,
) -> LoadResult:
    """An open-loop (Poisson) run against ``service`` (on uvloop, in this process)."""
    return run_loop(
        run_open_loop(
            LoadOptions(
                service.url + request.path,
                duration_s=duration_s,
                requests=request,
                warmup_s=warmup_s,
                timeout_s=timeout_s,
            ),
            rate,
            max_connections=max_connections,
            seed=seed,
        )
    )


def rows_per_s(call: Callable[[int], object], rows: int, seconds: float) -> float:
    """Rows/s of ``call(done)`` (each call handles ``rows`` rows; ``done``: rows so far),
    repeated for ``seconds`` after one untimed call, at most 100,000 calls."""
    call(0)
    done, calls, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds and calls < 100_000:
        call(done)
        done += rows
        calls += 1
    return done / (time.perf_counter() - t0)


def call_latencies(call: Callable[[], object], seconds: float) -> list[float]:
    """Seconds each ``call()`` took, repeated for ``seconds`` (at most a million calls)."""
    latencies: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end and len(latencies) < 1_000_000:
        t = time.perf_counter()
        call()
        latencies.append(time.perf_counter() - t)
    return latencies


def cpu_idle_share(interval_s: float = 1.0) -> float:
    """The machine's idle CPU share over ``interval_s`` (from /proc/stat; 1.0 when unknown)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        return fields[3] + fields[4], sum(fields)  # idle + iowait, total

    try:
        idle0, total0 = sample()
        time.sleep(interval_s)
        idle1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return 1.0
    return (idle1 - idle0) / max(total1 - total0, 1)


def wait_for_quiet(min_idle: float = 0.85, max_wait_s: float = 120.0) -> float:
    """Wait (up to ``max_wait_s``) until the machine is mostly idle, so other work on these
    shared cores does not skew a measurement; return the last idle share seen and say so when
    it never got quiet."""
    deadline = time.monotonic() + max_wait_s
    idle = cpu_idle_share()
    while idle < min_idle and time.monotonic() < deadline:
        idle = cpu_idle_share()
    if idle < min_idle:
        print(f"  (warning: the machine is busy, {idle:.0%} idle: figures may be low)", flush=True)
    return idle


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a process has used so far (0.0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU used by some processes between ``start()`` and ``stop()``, by role, in cores."""

    def __init__(self, processes: dict[int, str]) -> None:
        self.processes = processes
        self._before: dict[int, float] = {}
        self._t0 = 0.0

    def start(self) -> None:
        self._before = {pid: cpu_seconds(pid) for pid in self.processes}
        self._t0 = time.monotonic()

    def stop(self) -> dict[str, float]:
        """Cores used per role (``{"gateway": 0.45, "worker": 0.8}``: workers summed)."""
        elapsed = max(time.monotonic() - self._t0, 1e-9)
        out: dict[str, float] = {}
        for pid, role in self.processes.items():
            used = cpu_seconds(pid) - self._before.get(pid, 0.0)
            out[role] = out.get(role, 0.0) + used / elapsed
        return out


def spawn_inferq(*args: str) -> subprocess.Popen[bytes]:
    """One ``inferq`` process (``python -m inferq ARGS``) with its output discarded."""
    return subprocess.Popen(
        [sys.executable, "-m", "inferq", *args, "--log-level", "warning"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def stop_processes(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each, then wait up to 15 s each before SIGKILL."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

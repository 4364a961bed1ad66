"""Issue #14 benchmark: inferq against the servers it replaces, side by side in one run.

    python bench/peers.py [--duration 5] [--warmup 1] [--rounds 1] [--label NAME]
                          [--profile TARGET:MODEL:C ...]

In one run, on free loopback ports, it starts
1. a plain FastAPI/uvicorn server calling ONNX Runtime inline (no batching),
2. a FastAPI server with an in-process asyncio micro-batcher (max batch 32, 5 ms window, one
   executor thread) (both ``bench/peer_servers.py``),
3. ``inferq up`` with 1 gateway and 1 worker on a private redis-server,
all serving the same two ONNX files with one intra-op thread: the real ``digits`` model
(``models/digits/1/model.onnx``, 64→128→10) and ``medium`` (1024→2048→2048→2048→1000, 12.5 M
parameters, **random weights**, written by ``bench/medium_model.py`` into a temporary model
repository). Before the servers start it measures each model's in-process ceiling (the same
session options, called in a loop): rows/s at batch 32 and the batch-1 latency.

Then, per model, concurrency level and target (interleaved, so drift on this shared machine
hits every target alike), a closed loop with ``wrk`` (or inferq's loadgen where wrk is not
installed): ``--warmup`` seconds discarded, then ``--duration`` seconds measured. Every request
is one row with the cache off (``"parameters": {"cache": false}``), so each one goes through
the queue. Per run it records requests/s, P50/P90/P99, the server's CPU per request (for inferq:
the gateway's, the worker's and Redis's, from /proc/<pid>/stat utime+stime over the run divided
by the requests answered), and for inferq the Redis commands per request from ``INFO
commandstats`` (everything: gateway, worker, heartbeats, registry refreshes, trims; the
benchmark's own INFO calls are left out).

It prints a table per model, the ratios and the issue's targets met or not, and writes
``bench/results/peers-<label>.json`` (every run) and ``bench/summaries/peers-<label>.json``
(the figures BENCHMARKS.md quotes), both with the git revision, the command and the machine.
``--profile inferq-json:digits:64`` adds, after the measured runs, one run with py-spy
recording the gateway and the worker (collapsed stacks under bench/results/).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import loadtool, medium_model
from bench.common import (
    DIGITS_SAMPLES,
    RESULTS,
    ROOT,
    Service,
    call_latencies,
    calls_between,
    command_calls,
    cpu_seconds,
    git_revision,
    machine,
    model_repository,
    rows_per_s,
    save,
    wait_for_quiet,
    wait_ready,
)
from inferq.redisserver import free_port

DIGITS_LEVELS = (1, 16, 64, 128)
MEDIUM_LEVELS = (16, 64, 128)
PEER_MAX_BATCH = 32
PEER_WINDOW_MS = 5.0


@dataclass(frozen=True)
class Target:
    name: str
    label: str
    server: str
    """``plain``, ``batcher`` or ``inferq``."""
    binary: bool


TARGETS = {
    "fastapi": Target("fastapi", "FastAPI, no batching", "plain", False),
    "fastapi-binary": Target("fastapi-binary", "FastAPI, no batching, binary", "plain", True),
    "batcher": Target("batcher", "FastAPI + asyncio batcher (max 32, 5 ms)", "batcher", False),
    "batcher-binary": Target(
        "batcher-binary", "FastAPI + asyncio batcher (max 32, 5 ms), binary", "batcher", True
    ),
    "inferq-json": Target("inferq-json", "inferq, JSON", "inferq", False),
    "inferq-binary": Target("inferq-binary", "inferq, binary tensors", "inferq", True),
}
MATRIX = {
    "digits": ("fastapi", "batcher", "inferq-json", "inferq-binary"),
    "medium": ("fastapi-binary", "batcher-binary", "inferq-binary", "inferq-json"),
}


# --- requests ---------------------------------------------------------------------------------


def sample(model: str) -> np.ndarray:
    if model == "digits":
        return np.array([DIGITS_SAMPLES["inputs"][0]], dtype=np.float32)
    rng = np.random.default_rng(1)
    return rng.random((1, medium_model.LAYERS[0]), dtype=np.float32)


def request(model: str, binary: bool) -> tuple[bytes, dict[str, str]]:
    """One V2 request for one row of ``model``, cache off: (body, headers)."""
    x = sample(model)
    tensor: dict[str, Any] = {"name": "input", "datatype": "FP32", "shape": list(x.shape)}
    if not binary:
        tensor["data"] = x.ravel().tolist()
        body = {"inputs": [tensor], "parameters": {"cache": False}}
        return json.dumps(body).encode(), {"content-type": "application/json"}
    blob = x.tobytes()
    tensor["parameters"] = {"binary_data_size": len(blob)}
    header = json.dumps(
        {"inputs": [tensor], "parameters": {"cache": False, "binary_data_output": True}}
    ).encode()
    return header + blob, {
        "content-type": "application/octet-stream",
        "inference-header-content-length": str(len(header)),
    }


def decode(body: bytes, header_length: str | None) -> dict[str, np.ndarray]:
    """The outputs of a V2 response (JSON or binary), as arrays."""
    n = int(header_length) if header_length else len(body)
    pos = n
    out = {}
    for o in json.loads(body[:n])["outputs"]:
        dtype = {"FP32": np.float32, "INT64": np.int64}[o["datatype"]]
        if "data" in o:
            arr = np.array(o["data"], dtype=dtype)
        else:
            size = o["parameters"]["binary_data_size"]
            arr = np.frombuffer(body[pos : pos + size], dtype=dtype)
            pos += size
        out[o["name"]] = arr.reshape(o["shape"])
    return out


# --- servers ----------------------------------------------------------------------------------


def in_process(path: Path, model: str, seconds: float) -> dict[str, float]:
    """The model's ceiling in this process: rows/s at batch 32, batch-1 calls/s and P50."""
    from bench.peer_servers import session

    sess = session(str(path))
    name = sess.get_inputs()[0].name
    outputs = [o.name for o in sess.get_outputs()]
    one = sample(model)
    many = np.repeat(one, 32, axis=0)
    batch32 = rows_per_s(lambda _: sess.run(outputs, {name: many}), 32, seconds)
    latencies = call_latencies(lambda: sess.run(outputs, {name: one}), seconds)
    return {
        "batch32_rows_per_s": batch32,
        "batch1_calls_per_s": len(latencies) / sum(latencies),
        "batch1_p50_ms": statistics.median(latencies) * 1000,
    }


def report_ceilings(ceilings: dict[str, dict[str, float]]) -> None:
    for m, c in ceilings.items():
        print(
            f"in-process {m}: {c['batch32_rows_per_s']:.0f} rows/s at batch 32, "
            f"{c['batch1_calls_per_s']:.0f} calls/s at batch 1 (P50 {c['batch1_p50_ms']:.3f} ms)",
            flush=True,
        )


def reference(path: Path, model: str) -> dict[str, np.ndarray]:
    from bench.peer_servers import session

    sess = session(str(path))
    outputs = [o.name for o in sess.get_outputs()]
    return dict(
        zip(outputs, sess.run(outputs, {sess.get_inputs()[0].name: sample(model)}), strict=True)
    )


@contextlib.contextmanager
def peer(kind: str, models: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """A FastAPI peer on a free port: (url, pid)."""
    port = free_port()
    argv = [sys.executable, "-m", "bench.peer_servers", kind, "--port", str(port)]
    argv += [
        "--max-batch",
        str(PEER_MAX_BATCH),
        "--window-ms",
        str(PEER_WINDOW_MS),
    ]
    for name, path in models.items():
        argv += ["--model", f"{name}={path}"]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc=proc)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def probe(url: str, model: str, binary: bool, want: dict[str, np.ndarray]) -> None:
    """One request, checked against the in-process answer: every server does the same work."""
    body, headers = request(model, binary)
    req = urllib.request.Request(f"{url}/v2/models/{model}/infer", body, headers, method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        got = decode(r.read(), r.headers.get("inference-header-content-length"))
    for name, arr in want.items():
        if name not in got or not np.allclose(got[name], arr, rtol=1e-4, atol=1e-4):
            raise RuntimeError(f"{url}: wrong '{name}' for {model} (binary={binary})")


# --- measuring --------------------------------------------------------------------------------


@dataclass
class Endpoint:
    url: str
    pids: dict[str, list[int]]
    """Role ("server", or "gateway"/"worker"/"redis") to its processes (``--gateways N``)."""
    redis_url: str | None = None


def measure(
    endpoint: Endpoint,
    model: str,
    target: Target,
    concurrency: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    body, headers = request(model, target.binary)
    url = f"{endpoint.url}/v2/models/{model}/infer"
    if args.warmup > 0:
        loadtool.run(url, body, headers, concurrency=concurrency, duration_s=args.warmup)
    before_cmds = command_calls(endpoint.redis_url) if endpoint.redis_url else {}
    before_cpu = {role: sum(map(cpu_seconds, pids)) for role, pids in endpoint.pids.items()}
    load = loadtool.run(url, body, headers, concurrency=concurrency, duration_s=args.duration)
    cpu = {
        role: sum(map(cpu_seconds, pids)) - before_cpu[role] for role, pids in endpoint.pids.items()
    }
    row: dict[str, Any] = {
        "model": model,
        "target": target.name,
        "concurrency": concurrency,
        **load.as_dict(),
        "cpu_us_per_request": {
            role: round(used / max(load.requests, 1) * 1e6, 1) for role, used in cpu.items()
        },
        "cpu_cores": {role: round(used / load.duration_s, 3) for role, used in cpu.items()},
    }
    if endpoint.redis_url:
        calls = calls_between(before_cmds, command_calls(endpoint.redis_url))
        calls.pop("info", None)  # the benchmark's own
        n = max(load.requests, 1)
        row["redis_commands_per_request"] = round(sum(calls.values()) / n, 3)
        row["redis_commands"] = {k: round(v / n, 3) for k, v in calls.items()}
    return row


def py_spy() -> str:
    """py-spy from PATH, or the one installed beside this Python (the bench extra)."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if beside.exists() else "py-spy")


def profile(
    endpoint: Endpoint, model: str, target: Target, concurrency: int, args: argparse.Namespace
) -> dict[str, str]:
    """A run with py-spy recording the gateway and the worker (collapsed stacks)."""
    body, headers = request(model, target.binary)
    url = f"{endpoint.url}/v2/models/{model}/infer"
    loadtool.run(url, body, headers, concurrency=concurrency, duration_s=1)
    files = {}
    spies = []
    for role in ("gateway", "worker"):
        out = RESULTS / f"pyspy-{args.label}-{target.name}-{model}-c{concurrency}-{role}.txt"
        files[role] = str(out)
        spies.append(
            subprocess.Popen(
                [
                    py_spy(),
                    "record",
                    "--pid",
                    str(endpoint.pids[role][0]),
                    "--duration",
                    str(round(args.duration)),
                    "--rate",
                    "250",
                    # Only the thread holding the GIL: CPU spent in Python (and the C it calls
                    # with the GIL held, uvloop's included), not threads waiting.
                    "--gil",
                    "--format",
                    "raw",
                    "--output",
                    str(out),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    time.sleep(0.5)  # py-spy attaches
    loadtool.run(url, body, headers, concurrency=concurrency, duration_s=args.duration)
    for spy in spies:
        spy.wait(60)
    return files


# --- reporting --------------------------------------------------------------------------------


def median_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, target, concurrency): the median over rounds of each figure."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["model"], r["target"], r["concurrency"]), []).append(r)
    out = []
    for (model, target, c), rows in groups.items():
        row: dict[str, Any] = {"model": model, "target": target, "concurrency": c}
        for key in ("rps", "p50_ms", "p90_ms", "p99_ms", "errors"):
            row[key] = round(statistics.median(r[key] for r in rows), 3)
        row["rps_runs"] = [round(r["rps"]) for r in rows]
        row["cpu_us_per_request"] = {
            role: round(statistics.median(r["cpu_us_per_request"][role] for r in rows), 1)
            for role in rows[0]["cpu_us_per_request"]
        }
        if "redis_commands_per_request" in rows[0]:
            row["redis_commands_per_request"] = round(
                statistics.median(r["redis_commands_per_request"] for r in rows), 3
            )
        out.append(row)
    return out


def table(rows: list[dict[str, Any]], model: str) -> str:
    lines = [
        f"\n{model}: req/s, P50/P99 ms, server CPU µs/request (inferq: gateway/worker/redis), "
        "Redis commands/request"
    ]
    for r in rows:
        if r["model"] != model:
            continue
        cpu = r["cpu_us_per_request"]
        cpu_text = (
            f"{cpu['gateway']:.0f}/{cpu['worker']:.0f}/{cpu['redis']:.0f}"
            if "gateway" in cpu
            else f"{cpu['server']:.0f}"
        )
        cmds = r.get("redis_commands_per_request")
        lines.append(
            f"  {r['target']:<15} c={r['concurrency']:<4} {r['rps']:8.0f} req/s  "
            f"p50 {r['p50_ms']:7.2f}  p99 {r['p99_ms']:7.2f}  cpu {cpu_text:>12}  "
            f"cmds {cmds if cmds is not None else '-':>6}  errors {r['errors']:.0f}"
        )
    return "\n".join(lines)


def find(rows: list[dict[str, Any]], model: str, target: str, c: int) -> dict[str, Any] | None:
    for r in rows:
        if (r["model"], r["target"], r["concurrency"]) == (model, target, c):
            return r
    return None


def verdicts(
    rows: list[dict[str, Any]], ceilings: dict[str, dict[str, float]], inferq: str = "inferq"
) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured figure and whether it is met (``inferq``:
    the targets' prefix, ``base`` for the baseline revision of an A/B run)."""
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, op: str, goal: float, note: str = "") -> None:
        met = None if value is None else (value >= goal if op == ">=" else value <= goal)
        out.append(
            {"target": name, "value": value, "goal": f"{op} {goal}", "met": met, "note": note}
        )

    def ratio(a: str, b: str, c: int) -> float | None:
        x, y = find(rows, "digits", a, c), find(rows, "digits", b, c)
        return round(x["rps"] / y["rps"], 3) if x and y and y["rps"] else None

    add("digits JSON c=64: inferq / batcher", ratio(f"{inferq}-json", "batcher", 64), ">=", 1.3)
    add("digits JSON c=16: inferq / FastAPI", ratio(f"{inferq}-json", "fastapi", 16), ">=", 1.0)
    c1 = find(rows, "digits", f"{inferq}-json", 1)
    add("digits JSON c=1: P50 ms", c1 and c1["p50_ms"], "<=", 1.0)
    add("digits JSON c=1: P99 ms", c1 and c1["p99_ms"], "<=", 2.0)
    c64 = find(rows, "digits", f"{inferq}-json", 64)
    add(
        "gateway CPU µs/request (digits JSON c=64)",
        c64 and c64["cpu_us_per_request"]["gateway"],
        "<=",
        150,
    )
    add("Redis commands/request c=64", c64 and c64.get("redis_commands_per_request"), "<=", 3)
    add("Redis commands/request c=1", c1 and c1.get("redis_commands_per_request"), "<=", 4)
    medium = [r for r in rows if r["model"] == "medium" and r["target"] == f"{inferq}-binary"]
    ceiling = ceilings.get("medium", {}).get("batch32_rows_per_s")
    if medium and ceiling:
        best = max(medium, key=lambda r: r["rps"])
        add(
            "medium binary / in-process ceiling at batch 32",
            round(best["rps"] / ceiling, 3),
            ">=",
            0.30,
            f"best level c={best['concurrency']}: {best['rps']:.0f} req/s vs {ceiling:.0f} rows/s",
        )
    return out


# --- main -------------------------------------------------------------------------------------


def print_verdicts(title: str, results: list[dict[str, Any]]) -> None:
    print(f"\n{title}:")
    for v in results:
        state = "-" if v["met"] is None else ("met" if v["met"] else "NOT met")
        print(f"  {v['target']}: {v['value']} (goal {v['goal']}): {state} {v['note']}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds measured per run")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds discarded per run")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the whole matrix")
    parser.add_argument("--models", default="digits,medium")
    parser.add_argument("--digits-levels", default=",".join(map(str, DIGITS_LEVELS)))
    parser.add_argument("--medium-levels", default=",".join(map(str, MEDIUM_LEVELS)))
    parser.add_argument("--targets", default="", help="only these targets (comma-separated)")
    parser.add_argument("--label", default="", help="result file names (default: revision)")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="a checkout of another revision: its `inferq up` runs beside this one's as the "
        "targets base-json and base-binary (an A/B comparison under the same noise)",
    )
    parser.add_argument(
        "--inferq-args",
        default="",
        help="extra options of this revision's `inferq up`, e.g. '--gateways 2' (recorded)",
    )
    parser.add_argument(
        "--profile",
        action="append",
        default=[],
        metavar="TARGET:MODEL:C",
        help="after the measured runs, one run under py-spy (inferq and base targets only)",
    )
    parser.add_argument("--ceiling-s", type=float, default=3.0)
    parser.add_argument(
        "--quiet-s",
        type=float,
        default=20.0,
        help="before each level, wait up to this long for the machine to be 80%% idle (0: no)",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    revision = git_revision()
    args.label = args.label or revision
    models = [m for m in args.models.split(",") if m]
    levels = {
        "digits": [int(c) for c in args.digits_levels.split(",") if c],
        "medium": [int(c) for c in args.medium_levels.split(",") if c],
    }
    only = {t for t in args.targets.split(",") if t}
    matrix = {m: [t for t in MATRIX[m] if not only or t in only] for m in MATRIX}
    if args.baseline is not None:
        base_rev = git_revision(args.baseline)
        for names in matrix.values():
            for name in [n for n in names if n.startswith("inferq-")]:
                base = name.replace("inferq-", "base-")
                TARGETS[base] = Target(
                    base, f"inferq at {base_rev}, {name[7:]}", "base", "binary" in name
                )
                names.insert(names.index(name), base)
    RESULTS.mkdir(parents=True, exist_ok=True)
    started = time.time()
    header: dict[str, Any] = {
        "benchmark": "bench/peers.py",
        "revision": revision,
        "baseline_revision": git_revision(args.baseline) if args.baseline else None,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {**machine(), "load_tool": loadtool.tool()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "models": {
            "digits": "real: models/digits (64→128→10, trained)",
            "medium": "random weights: bench/medium_model.py "
            f"({'→'.join(map(str, medium_model.LAYERS))}, {medium_model.parameters():,} params)",
        },
        "targets": {name: t.label for name, t in TARGETS.items()},
    }
    saved_as = f"peers-{args.label}"
    runs: list[dict[str, Any]] = []
    profiles: dict[str, dict[str, str]] = {}

    def save_raw() -> None:
        save(saved_as, {**header, "runs": runs, "profiles": profiles}, commit=False)

    with model_repository(digits=True, medium="medium" in models) as repo:
        files = {m: repo / m / "1" / "model.onnx" for m in ("digits", "medium") if m in models}
        print(f"load tool: {loadtool.tool()}; revision {revision}", flush=True)
        ceilings = {m: in_process(p, m, args.ceiling_s) for m, p in files.items()}
        report_ceilings(ceilings)
        header["in_process"] = ceilings
        want = {m: reference(p, m) for m, p in files.items()}
        with contextlib.ExitStack() as stack:
            endpoints = start_servers(
                stack, files, repo, args.baseline, shlex.split(args.inferq_args)
            )
            for m in files:
                for name in matrix[m]:
                    t = TARGETS[name]
                    probe(endpoints[t.server].url, m, t.binary, want[m])
            for round_ in range(args.rounds):
                for m in files:
                    for c in levels[m]:
                        idle = wait_for_quiet(0.8, args.quiet_s) if args.quiet_s else 1.0
                        # Alternate the order per round: whatever runs second in a level
                        # meets a warmer, busier machine, so no target gets that place always.
                        order = matrix[m] if round_ % 2 == 0 else matrix[m][::-1]
                        for name in order:
                            t = TARGETS[name]
                            row = measure(endpoints[t.server], m, t, c, args)
                            row.update(round=round_, machine_idle_before=round(idle, 3))
                            runs.append(row)
                            save_raw()
                            print(table([row], m).splitlines()[-1], flush=True)
            for spec in args.profile:
                name, m, c = spec.split(":")
                t = TARGETS[name]
                try:
                    profiles[spec] = profile(endpoints[t.server], m, t, int(c), args)
                except (OSError, subprocess.SubprocessError) as e:
                    print(f"py-spy {spec} failed: {e}", flush=True)
                    continue
                save_raw()
                print(f"py-spy {spec}: {profiles[spec]}", flush=True)

        # Again with the servers gone: the best of the two is the ceiling (the shared machine's
        # other work can only lower a measurement, and a low ceiling would flatter inferq).
        again = {m: in_process(p, m, args.ceiling_s) for m, p in files.items()}
        report_ceilings(again)
        for m, c in again.items():
            for k in c:
                best = max if k != "batch1_p50_ms" else min
                ceilings[m][k] = best(ceilings[m][k], c[k])

    header["seconds"] = round(time.time() - started)
    rows = median_rows(runs)
    for m in files:
        print(table(rows, m))
    results = verdicts(rows, ceilings)
    print_verdicts("targets (issue #14), measured side by side in this run", results)
    if args.baseline is not None:
        header["baseline_targets"] = verdicts(rows, ceilings, "base")
        print_verdicts(f"the same for {header['baseline_revision']}", header["baseline_targets"])
    data = {**header, "runs": runs, "profiles": profiles, "rows": rows, "targets": results}
    print(f"\nwrote {save(saved_as, data, omit=('runs', 'profiles'))} and its summary")


def start_servers(
    stack: contextlib.ExitStack,
    files: dict[str, Path],
    repo: Path,
    baseline: Path | None,
    inferq_args: Sequence[str] = (),
) -> dict[str, Endpoint]:
    """The peers and `inferq up` (and the baseline's), all ready, by server kind;
    ``inferq_args`` are extra options of this revision's `inferq up` (``--gateways 2``)."""
    plain_url, plain_pid = stack.enter_context(peer("plain", files))
    batcher_url, batcher_pid = stack.enter_context(peer("batcher", files))
    endpoints = {
        "plain": Endpoint(plain_url, {"server": [plain_pid]}),
        "batcher": Endpoint(batcher_url, {"server": [batcher_pid]}),
    }
    for kind, root in (("inferq", ROOT), ("base", baseline)):
        if root is None:
            continue
        extra = tuple(inferq_args) if kind == "inferq" else ()
        svc = stack.enter_context(Service("--model-repository", str(repo), *extra, root=root))
        for m in files:
            svc.wait_for_workers(m, 1)
        endpoints[kind] = Endpoint(svc.url, svc.role_pids(), svc.redis.url)
    return endpoints


if __name__ == "__main__":
    main()

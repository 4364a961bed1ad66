"""Issue #27, phase 1: the real peers standalone, each from its own venv, on the same ONNX files.

    python bench/realpeers/run.py [--peers triton,mlserver,...] [--rounds 2] [--duration 5]
                                  [--warmup 2] [--envs /work/peers] [--label NAME]

For each peer (``bench/realpeers/envs.py`` builds or reuses its venv first), it starts the
peer's server module (``bench/realpeers/<peer>_server.py``) with the venv's Python on a free
loopback port, serving ``digits`` (models/digits, 64→128→10) and ``medium``
(1024→2048→2048→2048→1000, random weights, ``bench/medium_model.py``) with ONNX Runtime on one
intra-op thread, batching where the peer has it (max batch 32, the window ``--window-ms``: the
same figures as bench/peers.py's in-process batcher). Then, per model, concurrency level and
encoding (JSON; the binary tensor extension where the peer takes it), it checks one answer
against in-process ONNX Runtime, runs ``--warmup`` seconds of wrk, then ``--duration`` seconds
measured (bench/loadtool.py and bench/wrk_post.lua, as bench/peers.py drives its targets), and
stops the peer before the next one starts. Rounds run the peers in reversed order every other
round, so none always meets the warmer machine.

Per run: answered requests/s (non-2xx answers are counted as errors, not throughput), P50/P90/
P99, and the CPU per answer of every process the peer started (the whole process tree, from
/proc utime+stime), in total and per process. A peer that does not install, start or answer
correctly is reported with the error and the run goes on. Results go to
``bench/results/realpeers-<label>.json`` as they come and, at the end, with the medians of the
rounds, also to ``bench/summaries/`` (both stamped with the git revision and the command).
inferq (``inferq up``: 1 gateway, 1 worker, a private Redis), plain FastAPI and the in-process
batcher (``bench/peer_servers.py``) take their turns in the same rounds, from this checkout's
Python, so the closing table of issue #27's targets compares cells of one round.
Nothing here is in the ``dev`` extra or in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import loadtool, medium_model, peers
from bench.common import (
    RESULTS,
    ROOT,
    Service,
    calls_between,
    command_calls,
    cpu_seconds,
    git_revision,
    machine,
    model_repository,
    save,
    wait_for_quiet,
)
from bench.realpeers import envs
from inferq.redisserver import free_port

LEVELS = {"digits": (1, 16, 64, 128), "medium": (16, 128)}
LOGS = RESULTS / "realpeers-logs"
NO_PHONING_HOME = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "BENTOML_DO_NOT_TRACK": "True",
    "DO_NOT_TRACK": "1",
}
"""The benchmark talks to loopback only: the peers' usage reporting is off."""


@dataclass(frozen=True)
class RealPeer:
    name: str
    label: str
    binary: bool
    """Whether it takes the binary tensor extension (else JSON only)."""
    batching: str
    """How it batches, with ``{max_batch}`` and ``{window_ms}`` filled in from the run."""
    startup_s: float = 180.0
    checkout: str = ""
    """Empty for a real peer (its own venv). Otherwise this checkout's own server, run from the
    benchmark's Python in the same rounds as the peers: ``inferq`` (`inferq up`, 1 gateway and
    1 worker on a private Redis, as bench/peers.py runs it) or a ``bench/peer_servers.py`` kind
    (``plain``, ``batcher``)."""

    @property
    def module(self) -> list[str]:
        """What follows ``python -m`` to start it (not for ``inferq``: `bench.common.Service`)."""
        if self.checkout:
            return ["bench.peer_servers", self.checkout]
        return [f"bench.realpeers.{self.name}_server"]


PEERS = {
    p.name: p
    for p in (
        RealPeer(
            "inferq",
            "inferq (1 gateway, 1 worker, a private Redis)",
            True,
            "the models' config.toml: digits max_batch 64, flush_ms 2; medium its own; "
            "every request with the cache off",
            checkout="inferq",
        ),
        RealPeer(
            "fastapi",
            "FastAPI, no batching (bench/peer_servers.py plain)",
            True,
            "none",
            checkout="plain",
        ),
        RealPeer(
            "batcher",
            "FastAPI + in-process asyncio batcher (bench/peer_servers.py batcher)",
            True,
            "max_batch {max_batch}, window {window_ms} ms, one executor thread",
            checkout="batcher",
        ),
        RealPeer(
            "triton",
            "Triton (PyTriton, tritonserver + Python backend)",
            True,
            "dynamic batcher: max_batch_size {max_batch}, "
            "max_queue_delay_microseconds {window_us}; one model instance",
        ),
        RealPeer(
            "mlserver",
            "MLServer",
            False,
            "adaptive batching: max_batch_size {max_batch}, max_batch_time {window_ms} ms; "
            "one parallel inference worker",
        ),
        RealPeer(
            "bentoml",
            "BentoML (API service + batchable model service)",
            False,
            "batchable=True, max_batch_size {max_batch}, max_latency_ms default (60000): "
            "its adaptive dispatcher picks the window; runner_connection.max_requests raised "
            "(the default 100 fails requests in flight)",
        ),
        RealPeer(
            "litserve",
            "LitServe",
            False,
            "max_batch_size {max_batch}, batch_timeout {window_ms} ms; "
            "one inference worker process per model, fast_queue (ZeroMQ)",
        ),
        RealPeer("kserve", "KServe model server", True, "none (KServe's model server has none)"),
        RealPeer(
            "rayserve",
            "Ray Serve",
            True,
            "@serve.batch(max_batch_size={max_batch}, batch_wait_timeout_s={window_ms} ms), "
            "max_ongoing_requests 256; one replica per model",
        ),
    )
}


# --- the peer's processes -----------------------------------------------------------------


def process_tree(*roots: int) -> dict[int, str]:
    """Every process in ``roots`` and below them, by pid, each with a short name (for the CPU
    split): the command name, or for a Python process the module or script it runs."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    out: dict[int, str] = {}
    todo = list(roots)
    while todo:
        pid = todo.pop()
        with contextlib.suppress(OSError):
            out[pid] = process_name(pid)
        todo += children.get(pid, [])
    return out


def process_name(pid: int) -> str:
    comm = Path(f"/proc/{pid}/comm").read_text().strip()
    if not comm.startswith("python"):
        return comm
    argv = [
        a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    ]
    name = "python"
    for i, arg in enumerate(argv[1:], 1):
        if arg == "-m" and i + 1 < len(argv):
            name = argv[i + 1].rsplit(".", 1)[-1]
            if name == "inferq" and i + 2 < len(argv):  # `inferq up`, `inferq gateway`, ...
                name += " " + argv[i + 2]
            break
        if arg == "-c" and i + 1 < len(argv):
            name = "multiprocessing" if "multiprocessing" in argv[i + 1] else "python -c"
            break
        if not arg.startswith("-"):
            name = Path(arg).name
            break
    if "--service-name" in argv:
        name += ":" + argv[argv.index("--service-name") + 1]
    return name


class CpuTree:
    """The CPU a peer's whole process trees used between ``start()`` and ``stop()``."""

    def __init__(self, roots: tuple[int, ...]) -> None:
        self.roots = roots
        self.before: dict[int, float] = {}

    def start(self) -> None:
        self.before = {pid: cpu_seconds(pid) for pid in process_tree(*self.roots)}

    def stop(self) -> dict[str, float]:
        """Seconds used, per process name (a process that started meanwhile counts whole)."""
        out: dict[str, float] = {}
        for pid, name in process_tree(*self.roots).items():
            used = cpu_seconds(pid) - self.before.get(pid, 0.0)
            out[name] = out.get(name, 0.0) + max(used, 0.0)
        return out


@dataclass
class Running:
    peer: RealPeer
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    pids: set[int]
    """Every process seen in its tree, so that none outlives the run."""
    others: tuple[int, ...] = ()
    """Processes outside ``proc``'s tree whose CPU is the peer's too (inferq's Redis)."""
    redis_url: str | None = None
    """inferq's Redis, for the commands per request."""

    @property
    def roots(self) -> tuple[int, ...]:
        return (self.proc.pid, *self.others)


def log_tail(path: Path, lines: int = 12) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    return ""


@contextlib.contextmanager
def started(
    peer: RealPeer, python: Path, files: dict[str, Path], args: argparse.Namespace, log: Path
) -> Iterator[Running]:
    """The peer serving ``files``, answering correctly (JSON) for every model; stopped after."""
    if peer.checkout == "inferq":
        with inferq_started(peer, files, log) as running:
            yield running
        return
    port = free_port()
    argv = [str(python), "-m", *peer.module, "--port", str(port)]
    argv += ["--max-batch", str(args.max_batch), "--window-ms", str(args.window_ms)]
    for name, path in files.items():
        argv += ["--model", f"{name}={path}"]
    env = {**os.environ, **NO_PHONING_HOME, "PYTHONPATH": str(ROOT)}
    env.pop("VIRTUAL_ENV", None)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    running = Running(peer, f"http://127.0.0.1:{port}", proc, log, {proc.pid})
    try:
        wait_answering(running, files, peer.startup_s)
        running.pids |= set(process_tree(proc.pid))
        yield running
    finally:
        running.pids |= set(process_tree(proc.pid))
        stop(running)


@contextlib.contextmanager
def inferq_started(peer: RealPeer, files: dict[str, Path], log: Path) -> Iterator[Running]:
    """`inferq up` on the models' repository (the folder above each model's), as bench/peers.py
    starts it; its CPU counts the `inferq up` tree and the private Redis."""
    (repo,) = {path.parents[2] for path in files.values()}
    log.parent.mkdir(parents=True, exist_ok=True)
    with Service("--model-repository", str(repo), stdout=log, stderr=log) as svc:
        assert svc.proc is not None
        for m in files:
            svc.wait_for_workers(m, 1)
        (redis_pid,) = svc.role_pids()["redis"]
        running = Running(
            peer,
            svc.url,
            svc.proc,
            log,
            set(process_tree(svc.proc.pid)),
            (redis_pid,),
            svc.redis.url,
        )
        wait_answering(running, files, peer.startup_s)
        yield running


def wait_answering(running: Running, files: dict[str, Path], timeout_s: float) -> None:
    """Until every model answers a JSON probe correctly (or the peer exits, or time is up)."""
    wants = {m: peers.reference(p, m) for m, p in files.items()}
    deadline = time.monotonic() + timeout_s
    pending = dict(wants)
    last = ""
    while pending and time.monotonic() < deadline:
        if running.proc.poll() is not None:
            raise RuntimeError(f"exited with {running.proc.returncode}:\n{log_tail(running.log)}")
        for m in list(pending):
            try:
                peers.probe(running.url, m, False, pending[m])
                del pending[m]
            except (OSError, ValueError, http.client.HTTPException) as e:
                last = repr(e)
        if pending:
            time.sleep(0.5)
    if pending:
        raise RuntimeError(
            f"not answering after {timeout_s:.0f} s ({last}):\n{log_tail(running.log)}"
        )


def stop(running: Running) -> None:
    """SIGTERM the peer's main process, then SIGKILL whatever of its tree is left."""
    proc = running.proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(p) for p in running.pids):
        time.sleep(0.2)
    for pid in running.pids:
        if alive(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# --- measuring ----------------------------------------------------------------------------


def measure(
    running: Running, model: str, binary: bool, concurrency: int, args: argparse.Namespace
) -> dict[str, Any]:
    body, headers = peers.request(model, binary)
    url = f"{running.url}/v2/models/{model}/infer"
    if args.warmup > 0:
        loadtool.run(url, body, headers, concurrency=concurrency, duration_s=args.warmup)
    meter = CpuTree(running.roots)
    before_cmds = command_calls(running.redis_url) if running.redis_url else {}
    meter.start()
    load = loadtool.run(url, body, headers, concurrency=concurrency, duration_s=args.duration)
    cpu = meter.stop()
    extra: dict[str, Any] = {}
    if running.redis_url:
        calls = calls_between(before_cmds, command_calls(running.redis_url))
        calls.pop("info", None)  # the benchmark's own
        extra["redis_commands_per_request"] = round(sum(calls.values()) / max(load.requests, 1), 3)
    answered = max(load.requests - load.errors, 0)
    per_answer = {k: round(v / max(answered, 1) * 1e6, 1) for k, v in sorted(cpu.items())}
    return {
        "model": model,
        "target": f"{running.peer.name}-{'binary' if binary else 'json'}",
        "peer": running.peer.name,
        "encoding": "binary" if binary else "json",
        "concurrency": concurrency,
        **load.as_dict(),
        # Answered requests only: a peer that sheds load with 503s gets no credit for them.
        "rps": answered / load.duration_s,
        "responses_per_s": load.rps,
        "cpu_us_per_request": {"server": round(sum(cpu.values()) / max(answered, 1) * 1e6, 1)},
        "cpu_us_per_process": {k: v for k, v in per_answer.items() if v},
        "cpu_cores": round(sum(cpu.values()) / load.duration_s, 3),
        "processes": len(process_tree(*running.roots)),
        **extra,
    }


def idle_cores(running: Running, seconds: float) -> dict[str, float]:
    """The cores the peer's processes use while it serves nothing (per process, and total):
    what it would take from the others if it stayed up beside them."""
    meter = CpuTree(running.roots)
    meter.start()
    time.sleep(seconds)
    used = {k: round(v / seconds, 3) for k, v in meter.stop().items() if v}
    return {"total": round(sum(used.values()), 3), **used}


def run_peer(
    peer: RealPeer,
    files: dict[str, Path],
    wants: dict[str, dict[str, Any]],
    args: argparse.Namespace,
    round_: int,
    record: Any,
) -> dict[str, Any]:
    """All of one peer's cells in one round; returns its status (``ok`` or the error)."""
    if peer.checkout:
        python, version = Path(sys.executable), checkout_version(peer)
    else:
        try:
            version = envs.ensure(envs.PEERS[peer.name], args.envs, args.python)["version"]
        except envs.BuildError as e:
            return {"status": "does not install", "error": str(e)}
        python = envs.python_of(args.envs, peer.name)
    log = LOGS / f"{args.label}-{peer.name}-r{round_}.log"
    t0 = time.monotonic()
    try:
        with started(peer, python, files, args, log) as running:
            status: dict[str, Any] = {
                "status": "ok",
                "version": version,
                "startup_s": round(time.monotonic() - t0, 1),
            }
            if args.idle_s > 0:
                status["idle_cpu_cores"] = idle_cores(running, args.idle_s)
            for model in files:
                for c in args.levels[model]:
                    idle = wait_for_quiet(0.8, args.quiet_s) if args.quiet_s else 1.0
                    for binary in [False, True] if peer.binary and args.binary else [False]:
                        try:
                            peers.probe(running.url, model, binary, wants[model])
                        except (OSError, RuntimeError) as e:
                            status.setdefault("wrong_answers", []).append(
                                f"{model} c={c} binary={binary}: {e!r}"
                            )
                            continue
                        row = measure(running, model, binary, c, args)
                        row.update(round=round_, machine_idle_before=round(idle, 3))
                        record(row)
            return status
    except RuntimeError as e:
        return {"status": "does not run", "error": str(e), "log": str(log)}


def checkout_version(peer: RealPeer) -> str:
    """What a checkout server runs: inferq at this revision, or the benchmark venv's FastAPI."""
    if peer.checkout == "inferq":
        return f"inferq {git_revision()}"
    return f"fastapi {importlib.metadata.version('fastapi')}"


def configuration(args: argparse.Namespace) -> dict[str, str]:
    fill = {
        "max_batch": args.max_batch,
        "window_ms": args.window_ms,
        "window_us": round(args.window_ms * 1000),
    }
    return {name: p.batching.format(**fill) for name, p in PEERS.items()}


UNBATCHED = {"fastapi", "kserve"}
"""The peers without batching: not counted for the CPU-per-answer target."""


def targets(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue #27's targets, per round (each a ratio of cells measured in the same round):
    inferq's req/s against the best other server's row (any encoding) per cell at c >= 16, its
    CPU per answer at digits c=128 against the most frugal batching peer's, c=1 against plain
    FastAPI, c=64 against the in-process batcher, and its Redis commands per request at c=64."""
    out: list[dict[str, Any]] = []

    def add(round_: int, name: str, value: float | None, op: str, goal: float, note: str) -> None:
        met = None if value is None else (value >= goal if op == ">=" else value <= goal)
        out.append(
            {
                "round": round_ + 1,
                "target": name,
                "value": value,
                "goal": f"{op} {goal}",
                "met": met,
                "note": note,
            }
        )

    def cell(rows: list[dict[str, Any]], target: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["target"] == target), None)

    cells: dict[tuple[int, str, int], list[dict[str, Any]]] = {}
    for r in runs:
        cells.setdefault((r["round"], r["model"], r["concurrency"]), []).append(r)
    for (round_, model, c), rows in sorted(cells.items()):
        others = [r for r in rows if r["peer"] != "inferq"]
        if c >= 16 and others:
            best = max(others, key=lambda r: r["rps"])
            for encoding, goal in (("json", 1.3), ("binary", 1.6)):
                mine = cell(rows, f"inferq-{encoding}")
                if mine:
                    add(
                        round_,
                        f"{model} c={c}: inferq {encoding} / the best peer",
                        round(mine["rps"] / best["rps"], 3) if best["rps"] else None,
                        ">=",
                        goal,
                        f"{mine['rps']:.0f} vs {best['target']} {best['rps']:.0f} req/s",
                    )
        if (model, c) == ("digits", 128):
            batching = [r for r in others if r["peer"] not in UNBATCHED and r["rps"] > 0]
            if batching:
                frugal = min(batching, key=lambda r: r["cpu_us_per_request"]["server"])
                least = frugal["cpu_us_per_request"]["server"]
                for encoding in ("json", "binary"):
                    mine = cell(rows, f"inferq-{encoding}")
                    if mine:
                        cpu = mine["cpu_us_per_request"]["server"]
                        add(
                            round_,
                            f"digits c=128: inferq {encoding} CPU per answer / the most frugal "
                            "batching peer's",
                            round(cpu / least, 3),
                            "<=",
                            1.0,
                            f"{cpu:.0f} vs {frugal['target']} {least:.0f} µs",
                        )
        mine, plain = cell(rows, "inferq-json"), cell(rows, "fastapi-json")
        if (model, c) == ("digits", 1) and mine and plain:
            note = f"{mine['p50_ms']:.2f} vs {plain['p50_ms']:.2f} ms"
            add(
                round_,
                "digits c=1: P50 inferq JSON / FastAPI",
                round(mine["p50_ms"] / plain["p50_ms"], 3),
                "<=",
                2.0,
                note,
            )
            note = f"{mine['rps']:.0f} vs {plain['rps']:.0f} req/s"
            add(
                round_,
                "digits c=1: req/s inferq JSON / FastAPI",
                round(mine["rps"] / plain["rps"], 3),
                ">=",
                0.6,
                note,
            )
        batcher = cell(rows, "batcher-json")
        if (model, c) == ("digits", 64) and mine and batcher:
            note = f"{mine['rps']:.0f} vs {batcher['rps']:.0f} req/s"
            add(
                round_,
                "digits c=64: inferq JSON / the in-process batcher",
                round(mine["rps"] / batcher["rps"], 3),
                ">=",
                1.5,
                note,
            )
        if c == 64:
            for encoding in ("json", "binary"):
                mine_c = cell(rows, f"inferq-{encoding}")
                if mine_c and "redis_commands_per_request" in mine_c:
                    add(
                        round_,
                        f"{model} c=64: Redis commands per request, inferq {encoding}",
                        mine_c["redis_commands_per_request"],
                        "<=",
                        2.5,
                        "",
                    )
    return out


def print_targets(results: list[dict[str, Any]]) -> None:
    print("\nissue #27's targets, per round (cells of the same round):", flush=True)
    for t in results:
        verdict = {True: "met", False: "NOT met", None: "-"}[t["met"]]
        print(
            f"  r{t['round']} {t['target']:<66} {t['value']!s:>7} {t['goal']:<7} {verdict:<8}"
            f"{t['note']}",
            flush=True,
        )


def print_table(rows: list[dict[str, Any]], model: str) -> None:
    lines = [f"\n{model}: answered req/s, P50/P99 ms, CPU µs per answer (all the peer's processes)"]
    for r in rows:
        if r["model"] == model:
            lines.append(
                f"  {r['target']:<17} c={r['concurrency']:<4} {r['rps']:8.0f} req/s "
                f"{r['rps_runs']!s:>14}  p50 {r['p50_ms']:8.2f}  p99 {r['p99_ms']:8.2f}  "
                f"cpu {r['cpu_us_per_request']['server']:7.0f}  errors {r['errors']:.0f}"
            )
    print("\n".join(lines), flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated, in order")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds measured per run")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds discarded per run")
    parser.add_argument("--models", default="digits,medium")
    parser.add_argument("--digits-levels", default=",".join(map(str, LEVELS["digits"])))
    parser.add_argument("--medium-levels", default=",".join(map(str, LEVELS["medium"])))
    parser.add_argument(
        "--no-binary", dest="binary", action="store_false", help="JSON only, for every peer"
    )
    parser.add_argument("--max-batch", type=int, default=peers.PEER_MAX_BATCH)
    parser.add_argument("--window-ms", type=float, default=peers.PEER_WINDOW_MS)
    parser.add_argument("--envs", type=Path, default=envs.DEFAULT_ROOT, help="the peers' venvs")
    parser.add_argument("--python", default=sys.executable, help="base of venvs still to build")
    parser.add_argument("--label", default="", help="result file names (default: revision)")
    parser.add_argument("--ceiling-s", type=float, default=2.0, help="in-process ceiling (0: no)")
    parser.add_argument(
        "--idle-s", type=float, default=3.0, help="after start, measure the idle CPU (0: no)"
    )
    parser.add_argument(
        "--quiet-s",
        type=float,
        default=20.0,
        help="before each level, wait up to this long for the machine to be 80%% idle (0: no)",
    )
    args = parser.parse_args()
    unknown = set(args.peers.split(",")) - set(PEERS)
    if unknown:
        parser.error(f"unknown peers: {', '.join(sorted(unknown))} (known: {', '.join(PEERS)})")
    args.levels = {
        "digits": [int(c) for c in args.digits_levels.split(",") if c],
        "medium": [int(c) for c in args.medium_levels.split(",") if c],
    }
    return args


def main() -> None:
    args = parse_args()
    t0 = time.monotonic()
    revision = git_revision()
    args.label = args.label or revision
    subprocess.run([str(ROOT / "scripts" / "ensure-wrk")], check=False)
    names = [n for n in args.peers.split(",") if n]
    models = [m for m in args.models.split(",") if m]
    header: dict[str, Any] = {
        "benchmark": "bench/realpeers/run.py",
        "revision": revision,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {**machine(), "load_tool": loadtool.tool()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "models": {
            "digits": "real: models/digits (64→128→10, trained)",
            "medium": "random weights: bench/medium_model.py "
            f"({'→'.join(map(str, medium_model.LAYERS))}, {medium_model.parameters():,} params)",
        },
        "settings": {
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "max_batch": args.max_batch,
            "window_ms": args.window_ms,
            "onnxruntime": "one intra-op thread, one inter-op thread, no spinning",
        },
        "configuration": {n: configuration(args)[n] for n in names},
        "labels": {n: PEERS[n].label for n in names},
    }
    runs: list[dict[str, Any]] = []
    statuses: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    raw = RESULTS / f"realpeers-{args.label}.json"
    RESULTS.mkdir(parents=True, exist_ok=True)

    def save_raw() -> None:
        raw.write_text(json.dumps({**header, "status": statuses, "runs": runs}, indent=1))

    def record(row: dict[str, Any]) -> None:
        runs.append(row)
        save_raw()
        cpu = row["cpu_us_per_request"]["server"]
        print(
            f"  r{row['round']} {row['target']:<17} {row['model']:<6} c={row['concurrency']:<4}"
            f"{row['rps']:8.0f} req/s  p50 {row['p50_ms']:8.2f}  p99 {row['p99_ms']:8.2f}  "
            f"cpu {cpu:7.0f} µs/answer  errors {row['errors']}",
            flush=True,
        )

    with model_repository(digits="digits" in models, medium="medium" in models) as repo:
        files = {m: repo / m / "1" / "model.onnx" for m in ("digits", "medium") if m in models}
        wants = {m: peers.reference(p, m) for m, p in files.items()}
        if args.ceiling_s > 0:
            header["in_process"] = {
                m: peers.in_process(p, m, args.ceiling_s) for m, p in files.items()
            }
            peers.report_ceilings(header["in_process"])
        for round_ in range(args.rounds):
            for name in names if round_ % 2 == 0 else names[::-1]:
                print(f"round {round_ + 1}: {name}", flush=True)
                status = run_peer(PEERS[name], files, wants, args, round_, record)
                statuses[name].append(status)
                save_raw()
                if status["status"] != "ok":
                    print(f"  {name}: {status['status']}: {status['error']}", flush=True)
    header["seconds"] = round(time.monotonic() - t0)
    header["versions"] = {
        n: checkout_version(PEERS[n])
        if PEERS[n].checkout
        else (envs.stamp(args.envs, n) or {}).get("version")
        for n in names
    }
    rows = peers.median_rows(runs)
    for m in files:
        print_table(rows, m)
    results = targets(runs)
    print_targets(results)
    path = save(
        f"realpeers-{args.label}",
        {**header, "status": statuses, "rows": rows, "targets": results, "runs": runs},
    )
    print(f"\nwrote {raw} and {path.name} (bench/summaries/)", flush=True)


if __name__ == "__main__":
    main()

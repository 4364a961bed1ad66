"""Issue #27: system calls per request, by process, for inferq and plain FastAPI side by side.

    python bench/syscalls.py [--levels 1,64] [--duration 3] [--label NAME]

At c=1 a request's latency is about the sum of the CPU its processes spend on it, one after
another, and on a virtual machine much of that is the kernel: every wake-up is an ``epoll_wait``
and a read, every hop a write. This counts them. It starts ``inferq up`` (1 gateway, 1 worker,
a private Redis) and the plain FastAPI server (``bench/peer_servers.py plain``) on the digits
model, and per level and server runs wrk (JSON, cache off) for ``--duration`` seconds with
``strace -c -f`` attached to each of the server's processes (all threads), then divides each
process's calls by the requests answered. strace slows what it traces several times over, so
the figures are counts, not timings: the answered requests/s printed beside them are traced
ones. Before each traced run, an untraced one of the same length gives the answered
requests/s, P50, and each process's CPU per request split into user and kernel time (from
/proc/PID/stat). Writes ``bench/results/syscalls-NAME.json`` and its summary (revision,
command).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import loadtool, peers
from bench.common import Service, git_revision, machine, model_repository, save

_ROW = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$")


def parse_summary(text: str) -> dict[str, int]:
    """strace -c's table: calls per syscall name (the ``total`` row left out)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        found = _ROW.match(line)
        if found and found[2] != "total":
            out[found[2]] = out.get(found[2], 0) + int(found[1])
    return out


@contextlib.contextmanager
def traced(pids: dict[str, int], folder: Path) -> Any:
    """``strace -c -f -p`` on each process; yields a dict filled with calls per role on exit."""
    procs = {}
    for role, pid in pids.items():
        out = folder / f"{role}.txt"
        procs[role] = (
            subprocess.Popen(
                ["strace", "-c", "-f", "-qq", "-o", str(out), "-p", str(pid)],
                stderr=subprocess.DEVNULL,
            ),
            out,
        )
    time.sleep(0.5)  # attached
    counts: dict[str, dict[str, int]] = {}
    try:
        yield counts
    finally:
        for role, (proc, out) in procs.items():
            proc.send_signal(signal.SIGINT)
            proc.wait(30)
            counts[role] = parse_summary(out.read_text())


def user_system(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def measure(url: str, pids: dict[str, int], c: int, seconds: float) -> dict[str, Any]:
    body, headers = peers.request("digits", False)
    target = f"{url}/v2/models/digits/infer"
    loadtool.run(target, body, headers, concurrency=c, duration_s=1.0)  # warm
    before = {role: user_system(pid) for role, pid in pids.items()}
    plain = loadtool.run(target, body, headers, concurrency=c, duration_s=seconds)
    done = max(plain.requests - plain.errors, 1)
    cpu = {
        role: {
            "user_us": round((user_system(pid)[0] - before[role][0]) / done * 1e6, 1),
            "system_us": round((user_system(pid)[1] - before[role][1]) / done * 1e6, 1),
        }
        for role, pid in pids.items()
    }
    untraced = {"rps": round(plain.rps), "p50_ms": plain.p50_ms, "cpu_us_per_request": cpu}
    with tempfile.TemporaryDirectory() as tmp, traced(pids, Path(tmp)) as counts:
        load = loadtool.run(target, body, headers, concurrency=c, duration_s=seconds)
    answered = max(load.requests - load.errors, 1)
    per_role = {
        role: {
            "total": round(sum(calls.values()) / answered, 2),
            **{
                name: round(n / answered, 2)
                for name, n in sorted(calls.items(), key=lambda kv: -kv[1])
                if n / answered >= 0.05
            },
        }
        for role, calls in counts.items()
    }
    return {
        "concurrency": c,
        "untraced": untraced,
        "answered": answered,
        "traced_rps": round(load.rps),
        **per_role,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,64")
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    revision = git_revision()
    label = args.label or revision
    rows: list[dict[str, Any]] = []
    with model_repository(digits=True) as repo, contextlib.ExitStack() as stack:
        files = {"digits": repo / "digits" / "1" / "model.onnx"}
        plain_url, plain_pid = stack.enter_context(peers.peer("plain", files))
        svc = stack.enter_context(Service("--model-repository", str(repo)))
        svc.wait_for_workers("digits", 1)
        roles = {role: pids[0] for role, pids in svc.role_pids().items()}
        for c in (int(x) for x in args.levels.split(",") if x):
            for name, url, pids in (
                ("inferq-json", svc.url, roles),
                ("fastapi-json", plain_url, {"server": plain_pid}),
            ):
                row = {"target": name, **measure(url, pids, c, args.duration)}
                rows.append(row)
                summary = "  ".join(
                    f"{role} {row[role]['total']:.1f}" for role in pids if role in row
                )
                u = row["untraced"]
                cpu = "  ".join(
                    f"{role} {v['user_us']:.0f}+{v['system_us']:.0f}"
                    for role, v in u["cpu_us_per_request"].items()
                )
                print(
                    f"{name:<13} c={c:<4} untraced {u['rps']} req/s, P50 {u['p50_ms']:.2f} ms, "
                    f"CPU µs/request user+kernel: {cpu}",
                    flush=True,
                )
                print(f"{'':<13} syscalls/request: {summary}", flush=True)
                for role in pids:
                    top = [(k, v) for k, v in row[role].items() if k != "total"][:8]
                    print(f"    {role:<8} " + ", ".join(f"{k} {v}" for k, v in top), flush=True)
    data = {
        "benchmark": "bench/syscalls.py",
        "revision": revision,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        "rows": rows,
    }
    print(f"wrote {save(f'syscalls-{label}', data)}")


if __name__ == "__main__":
    main()

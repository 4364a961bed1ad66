"""Gateway instructions per request under callgrind: a figure the machine's noise cannot move.

Wall-clock A/B runs on a shared 2-core machine vary by up to 1.7 times between rounds. Callgrind
counts the instructions the gateway process executes, which stay the same whatever else runs
(same binary, inputs and environment give the same total). So this
script runs one gateway under ``valgrind --tool=callgrind`` per checkout, with a normal worker
and a private Redis beside it, and counts only while requests are served (``--instr-atstart=no``
and ``callgrind_control -i on|off``): instructions per request, startup excluded.

    python bench/instructions.py --baseline /work/wt-base --requests 400

Figures are digits JSON through the real HTTP gateway, cache bypassed; concurrency 1 and 16.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.common import (
    ROOT,
    digits_body,
    git_revision,
    markdown_table,
    save,
    wait_until,
)
from inferq.redisserver import RedisServer, free_port

HEADERS = {"content-type": "application/json", "cache-control": "no-cache"}


def _env(root: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(root)}


def _send(url: str, body: bytes, requests: int, concurrency: int) -> int:
    """``requests`` POSTs from ``concurrency`` threads, each on one keep-alive connection;
    the number answered 200 (every answer is checked: a refusal is not a served request)."""
    ok = [0] * concurrency
    share = [requests // concurrency + (i < requests % concurrency) for i in range(concurrency)]

    def one(i: int) -> None:
        with httpx.Client(base_url=url, timeout=120.0) as client:
            for _ in range(share[i]):
                r = client.post("/v2/models/digits/infer", content=body, headers=HEADERS)
                ok[i] += r.status_code == 200 and "outputs" in r.json()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(ok)


def _total(path: Path) -> int:
    """The ``totals:`` line of a callgrind dump: the instructions counted since the last zeroing."""
    text = path.read_text(errors="replace")
    match = re.search(r"^totals:\s+(\d+)", text, re.M)
    if match is None:
        raise RuntimeError(f"no totals in {path}")
    return int(match.group(1))


def measure(root: Path, requests: int, levels: list[int]) -> dict[int, dict[str, Any]]:
    """Instructions per request of ``root``'s gateway at each concurrency."""
    out: dict[int, dict[str, Any]] = {}
    with RedisServer() as redis_server, tempfile.TemporaryDirectory() as tmp:
        worker = subprocess.Popen(
            [sys.executable, "-m", "inferq", "worker", "--redis", redis_server.url,
             "--model-repository", str(ROOT / "models"), "--models", "digits",
             "--metrics-port", "0", "--log-level", "warning"],
            cwd=root, env=_env(root), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cg_out = Path(tmp) / "callgrind.out"
        gateway = subprocess.Popen(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no",
             f"--callgrind-out-file={cg_out}", sys.executable, "-m", "inferq", "gateway",
             "--redis", redis_server.url, "--port", str(port), "--grpc-port", str(free_port()),
             "--log-level", "warning"],
            cwd=root, env=_env(root), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            body = digits_body()
            payload = json.dumps(body).encode()

            def served() -> bool:
                try:
                    return _send(url, payload, 1, 1) == 1
                except httpx.HTTPError:
                    return False

            wait_until(served, "the gateway under valgrind answers", timeout_s=600)
            for c in levels:
                _send(url, payload, 4 * c, c)  # warm: connections, caches of the interpreter
                subprocess.run(["callgrind_control", "-z", str(gateway.pid)], check=True,
                               capture_output=True)  # fmt: skip
                subprocess.run(["callgrind_control", "-i", "on", str(gateway.pid)], check=True,
                               capture_output=True)  # fmt: skip
                started = time.monotonic()
                answered = _send(url, payload, requests, c)
                seconds = time.monotonic() - started
                subprocess.run(["callgrind_control", "-i", "off", str(gateway.pid)], check=True,
                               capture_output=True)  # fmt: skip
                dump = Path(tmp) / f"c{c}"
                subprocess.run(["callgrind_control", "-d", f"c{c}", str(gateway.pid)],
                               check=True, capture_output=True)  # fmt: skip
                files = sorted(Path(tmp).glob("callgrind.out.*"), key=lambda p: p.stat().st_mtime)
                total = _total(files[-1])
                files[-1].rename(dump)
                if answered != requests:
                    raise RuntimeError(f"{requests - answered} of {requests} requests failed")
                out[c] = {
                    "requests": requests,
                    "instructions_per_request": total / requests,
                    "seconds_under_valgrind": round(seconds, 1),
                }
                print(f"  {root}: c={c} {total / requests:,.0f} instructions/request", flush=True)
        finally:
            gateway.send_signal(signal.SIGINT)
            worker.send_signal(signal.SIGINT)
            for p in (gateway, worker):
                try:
                    p.wait(120)
                except subprocess.TimeoutExpired:
                    p.kill()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, help="a checkout of another revision")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout measured as this")
    parser.add_argument("--requests", type=int, default=400, help="counted requests per level")
    parser.add_argument("--levels", default="1,16")
    parser.add_argument("--label", default="instructions")
    args = parser.parse_args()
    levels = [int(c) for c in args.levels.split(",")]
    roots = {"this": args.root} | ({"baseline": args.baseline} if args.baseline else {})
    results = {name: measure(root, args.requests, levels) for name, root in roots.items()}
    revisions = {name: git_revision(root) for name, root in roots.items()}
    rows = []
    for c in levels:
        this = results["this"][c]["instructions_per_request"]
        row: list[object] = [f"c={c}", f"{this:,.0f}"]
        if "baseline" in results:
            base = results["baseline"][c]["instructions_per_request"]
            row = [f"c={c}", f"{base:,.0f}", f"{this:,.0f}", f"{(this - base) / base:+.1%}"]
        rows.append(row)
    headers = (
        ["level", f"baseline {revisions['baseline']}", f"this {revisions['this']}", "change"]
        if "baseline" in results
        else ["level", f"this {revisions['this']}"]
    )
    print(markdown_table(headers, rows))
    save(args.label, {"revisions": revisions, "results": results})


if __name__ == "__main__":
    main()

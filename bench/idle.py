"""Idle cost: Redis commands per second with no traffic at all, and who issues them.

    python bench/idle.py [--models 1,10,40] [--gateways 1,4,8] [--window 10]

Each configuration runs real processes against a private redis-server: one ``inferq worker``
serving every model of a repository of simulated models (nothing runs: there is no traffic),
and N ``inferq gateway`` processes on their own ports. After a settling period, the command
counts of ``INFO commandstats`` are read twice, ``--window`` seconds apart: commands/s is their
difference over the window. ``MONITOR`` over a few seconds then attributes commands to the
process kind that sent them (client names: ``inferq-gateway-*``, ``inferq-worker-*``).

The rows sweep models with 1 gateway (``--models``), then gateways with the largest model count
(``--gateways``). Writes bench/results/idle.json with the git revision and the command.
Loopback only; bounded in time (about (settle + window + monitor) s per configuration).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    calls_between,
    command_calls,
    markdown_table,
    model_repository,
    save,
    spawn_inferq,
    stop_processes,
)
from inferq.redisserver import RedisServer, free_port
from protocol.keys import Keys

SETTLE_S = 4.0
MONITOR_S = 4.0
NAMESPACE = "idle"
_MONITOR_LINE = re.compile(r'^[\d.]+ \[\d+ ([^\]]+)\] "([^"]+)"')


def _kind(name: str) -> str:
    for prefix, kind in (
        ("inferq-gateway-replies", "gateway (reply reader)"),
        ("inferq-gateway", "gateway"),
        ("inferq-worker-reader", "worker (reader)"),
        ("inferq-worker-control", "worker (control reader)"),
        ("inferq-worker", "worker"),
    ):
        if name.startswith(prefix):
            return kind
    return name or "unnamed"


def attribute(url: str, port: int, seconds: float) -> dict[str, dict[str, float]]:
    """Commands/s per process kind and command, from ``redis-cli monitor`` over ``seconds``."""
    with redis.Redis.from_url(url) as r:
        names = {c["addr"]: c.get("name", "") for c in r.client_list()}
    try:
        out_text = subprocess.run(
            ["redis-cli", "-p", str(port), "monitor"],
            capture_output=True,
            text=True,
            timeout=seconds,
        ).stdout
    except subprocess.TimeoutExpired as e:
        out_text = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    counts: Counter[tuple[str, str]] = Counter()
    for line in out_text.splitlines():
        match = _MONITOR_LINE.match(line)
        if match is not None:
            address, command = match.groups()
            counts[(_kind(names.get(address, "")), command.upper())] += 1
    out: dict[str, dict[str, float]] = {}
    for (kind, command), n in sorted(counts.items()):
        out.setdefault(kind, {})[command] = round(n / seconds, 2)
    return out


def _settle(url: str, procs: list[subprocess.Popen[bytes]]) -> None:
    """Until the worker advertises itself and a gateway publishes the backlog snapshot, then
    ``SETTLE_S`` more (start-up commands are not idle cost)."""
    keys = Keys(NAMESPACE)
    deadline = time.monotonic() + 120
    with redis.Redis.from_url(url) as r:
        # (A revision before the elected refresher has no stats key: then only the worker.)
        stats = getattr(keys, "stats", None)
        while not (r.zcard(keys.workers) and (stats is None or r.exists(stats))):
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("an inferq process exited during the idle run")
            if time.monotonic() > deadline:
                raise RuntimeError("the worker and gateways did not start within 120 s")
            time.sleep(0.2)
    time.sleep(SETTLE_S)
    if any(p.poll() is not None for p in procs):
        raise RuntimeError("an inferq process exited during the idle run")


def measure(models: int, gateways: int, window_s: float) -> dict[str, Any]:
    sims = {f"m{i:02d}": {"base_ms": 1.0, "per_row_ms": 0.0, "max_batch": 8} for i in range(models)}
    with RedisServer() as server, model_repository(**sims) as repo:
        url = server.url
        procs = [
            spawn_inferq(
                "worker",
                "--redis",
                url,
                "--namespace",
                NAMESPACE,
                "--model-repository",
                str(repo),
                "--metrics-port",
                "0",
            )
        ]
        for _ in range(gateways):
            procs.append(
                spawn_inferq(
                    "gateway",
                    "--redis",
                    url,
                    "--namespace",
                    NAMESPACE,
                    "--port",
                    str(free_port()),
                    "--grpc-port",
                    "0",
                )
            )
        try:
            _settle(url, procs)
            before = command_calls(url)
            time.sleep(window_s)
            after = command_calls(url)
            by_kind = attribute(url, server.port, MONITOR_S)
        finally:
            stop_processes(procs)
    calls = calls_between(before, after)
    calls.pop("info", None)  # the measurement's own
    total = sum(calls.values()) / window_s
    return {
        "models": models,
        "gateways": gateways,
        "workers": 1,
        "commands_per_s": round(total, 1),
        "per_model_per_s": round(total / models, 2),
        "by_command_per_s": {k: round(v / window_s, 2) for k, v in calls.items()},
        "by_process_per_s": {k: round(sum(v.values()), 2) for k, v in by_kind.items()},
        "by_process_and_command_per_s": by_kind,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="1,10,40")
    parser.add_argument("--gateways", default="1,4,8")
    parser.add_argument("--window", type=float, default=10.0)
    args = parser.parse_args()
    model_counts = [int(x) for x in args.models.split(",")]
    gateway_counts = [int(x) for x in args.gateways.split(",")]
    configs = [(m, 1) for m in model_counts]
    configs += [(max(model_counts), g) for g in gateway_counts if g != 1]
    rows = []
    for models, gateways in configs:
        row = measure(models, gateways, args.window)
        rows.append(row)
        print(
            f"{models} models, {gateways} gateway(s), 1 worker: {row['commands_per_s']} "
            f"commands/s ({row['per_model_per_s']} per model); by process "
            f"{row['by_process_per_s']}",
            flush=True,
        )
    print()
    print(
        markdown_table(
            ["models", "gateways", "commands/s", "per model", "gateways' share", "worker's share"],
            [
                (
                    r["models"],
                    r["gateways"],
                    r["commands_per_s"],
                    r["per_model_per_s"],
                    round(sum(v for k, v in r["by_process_per_s"].items() if "gateway" in k), 1),
                    round(sum(v for k, v in r["by_process_per_s"].items() if "worker" in k), 1),
                )
                for r in rows
            ],
        )
    )
    path = save(
        "idle",
        {
            "window_s": args.window,
            "rows": rows,
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()

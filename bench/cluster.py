"""The queue on one Redis vs a 3-master Redis Cluster: Redis ops/s and CPU per master.

    python bench/cluster.py [--duration 8] [--concurrency 64] [--models 6] [--rounds 3]

Both setups run the same processes on this machine: one ``inferq gateway`` and two ``inferq
worker`` processes serving ``--models`` simulated models (a batch "takes" 1 ms + 0.02 ms a row,
spent sleeping, so the workers cost little CPU and the queue is what is measured; the figures
show inferq's queueing, not any real model). The load is a closed loop over HTTP cycling through
the models, cache off. Per Redis master: commands/s (``INFO commandstats`` before and after) and
CPU (from /proc, in cores). Also requests/s and Redis commands per request.

On a 2-core machine everything shares the cores, so the absolute rates measure the gateway (the
Python process saturates first), not Redis: read the per-master split and the commands and CPU
per request, which BENCHMARKS.md turns into a model of how far K masters carry inferq.
Writes bench/results/cluster.json with the git revision and the command.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    answers,
    calls_between,
    closed_loop,
    command_calls,
    cpu_seconds,
    infer_request,
    markdown_table,
    model_repository,
    save,
    spawn_inferq,
    stop_processes,
    wait_for_quiet,
    wait_until,
)
from inferq.redisserver import RedisServer, free_port
from tests.localcluster import LocalCluster
from tests.support import sim_body

NAMESPACE = "bench"
SIM = {"base_ms": 1.0, "per_row_ms": 0.02, "max_batch": 32}


def _by_command(port: int) -> dict[str, int]:
    calls = command_calls(f"redis://127.0.0.1:{port}")
    calls.pop("info", None)  # the benchmark's own
    return calls


def run(setup: str, nodes: list[tuple[int, int]], redis_url: str, args: Any) -> dict[str, Any]:
    """One setup: ``nodes`` is (port, pid) of every master."""
    models = [f"m{i}" for i in range(args.models)]
    with model_repository(**{m: dict(SIM) for m in models}) as repo:
        port = free_port()
        common = ("--redis", redis_url, "--namespace", NAMESPACE)
        procs = [
            spawn_inferq("worker", *common, "--model-repository", str(repo), "--metrics-port", "0")
            for _ in range(2)
        ]
        procs.append(spawn_inferq("gateway", *common, "--port", str(port), "--grpc-port", "0"))
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until(
                lambda: all(answers(f"{url}/v2/models/{m}/ready") for m in models),
                "the models ready",
                timeout_s=120,
            )
            requests = [infer_request(m, sim_body(float(i))) for i, m in enumerate(models)]
            commands_before = {p: _by_command(p) for p, _ in nodes}
            cpu_before = {p: cpu_seconds(pid) for p, pid in nodes}
            inferq_before = {p.pid: cpu_seconds(p.pid) for p in procs}
            t0 = time.monotonic()
            result = closed_loop(
                url, requests, concurrency=args.concurrency, duration_s=args.duration, timeout_s=30
            )
            elapsed = time.monotonic() - t0
            commands_after = {p: _by_command(p) for p, _ in nodes}
            cpu_after = {p: cpu_seconds(pid) for p, pid in nodes}
            inferq_cores = {
                p.pid: (cpu_seconds(p.pid) - inferq_before[p.pid]) / elapsed for p in procs
            }
        finally:
            stop_processes(procs)
    per_node = {p: calls_between(commands_before[p], commands_after[p]) for p, _ in nodes}
    ops = {p: sum(calls.values()) / elapsed for p, calls in per_node.items()}
    cpu = {p: (cpu_after[p] - cpu_before[p]) / elapsed for p, _ in nodes}
    total_ops = sum(ops.values())
    commands: dict[str, int] = {}
    for calls in per_node.values():
        for name, n in calls.items():
            commands[name] = commands.get(name, 0) + n
    served = result.ok_rps * elapsed  # the loop's own window is shorter: per second is what counts
    return {
        "setup": setup,
        "masters": len(nodes),
        "models": args.models,
        "concurrency": args.concurrency,
        "rps": round(result.ok_rps, 1),
        "errors": result.errors,
        "p50_ms": result.latency_ms["p50"],
        "p99_ms": result.latency_ms["p99"],
        "redis_ops_per_s": round(total_ops),
        "ops_per_s_per_master": [round(v) for v in ops.values()],
        "redis_cores_per_master": [round(v, 3) for v in cpu.values()],
        "commands_per_request": round(total_ops / result.ok_rps, 2) if result.ok_rps else None,
        "redis_cpu_us_per_request": (
            round(sum(cpu.values()) / result.ok_rps * 1e6, 1) if result.ok_rps else None
        ),
        "gateway_cores": round(inferq_cores[procs[-1].pid], 2),
        "worker_cores": round(sum(v for pid, v in inferq_cores.items() if pid != procs[-1].pid), 2),
        "commands": {k: round(v / max(served, 1), 3) for k, v in commands.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--models", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = []
    # Alternated rounds: the shared machine's load drifts, and a drift should hit both setups.
    for round_ in range(args.rounds):
        wait_for_quiet()
        with RedisServer() as server:
            assert server._process is not None
            rows.append(run("1 node", [(server.port, server._process.pid)], server.url, args))
        print(f"round {round_ + 1}: {rows[-1]['setup']}: {rows[-1]['rps']} req/s", flush=True)
        wait_for_quiet()
        with LocalCluster(masters=3) as cluster:
            masters = [n for n in cluster.nodes() if n.master]
            nodes = []
            for n in sorted(masters, key=lambda n: n.slots[0][0]):
                process = cluster.server(n.port)._process
                assert process is not None
                nodes.append((n.port, process.pid))
            rows.append(run("3-master cluster", nodes, cluster.url, args))
        print(f"round {round_ + 1}: {rows[-1]['setup']}: {rows[-1]['rps']} req/s", flush=True)
    ratios = [rows[i + 1]["rps"] / rows[i]["rps"] for i in range(0, len(rows), 2) if rows[i]["rps"]]
    print(f"cluster / 1 node req/s per round: {[round(r, 2) for r in ratios]}")
    print()
    print(
        markdown_table(
            [
                "setup",
                "req/s",
                "P99 ms",
                "Redis ops/s",
                "ops/s per master",
                "Redis CPU per master (cores)",
                "commands/request",
                "Redis CPU µs/request",
                "gateway cores",
            ],
            [
                (
                    r["setup"],
                    r["rps"],
                    r["p99_ms"],
                    r["redis_ops_per_s"],
                    " / ".join(str(x) for x in r["ops_per_s_per_master"]),
                    " / ".join(f"{x:.2f}" for x in r["redis_cores_per_master"]),
                    r["commands_per_request"],
                    r["redis_cpu_us_per_request"],
                    r["gateway_cores"],
                )
                for r in rows
            ],
        )
    )
    path = save(
        "cluster",
        {
            "simulated_model": SIM,
            "rows": rows,
            "cluster_over_one_node_rps": ratios,
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()

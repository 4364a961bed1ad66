"""gRPC vs HTTP JSON vs HTTP binary tensors, through one `inferq up` (1 gateway, 1 worker).

    python bench/grpc_vs_http.py [--duration 6] [--levels 1,64] [--models digits,medium]
                                 [--rounds 2] [--transport-seconds 4]

For each model, protocol and closed-loop concurrency, one cell of ``inferq loadgen`` (in this
process; cache bypassed, so every request goes through the queue): requests/s, P50 and P99, and
the gateway's CPU per answered request, from its /proc/<pid>/stat (user + system) and its own
request counter, both read before and after the cell (warm-up included in both); also with the
CPU its background loops burn at idle (measured first, 3 s) subtracted. The 1-minute load
average is recorded per cell: on a shared machine it says how much to trust the cell.

Models: ``digits`` (the example, 64 -> 10) and ``medium`` (``bench/medium_model.py``: 12.5 M
parameters, RANDOM weights): its figures are about moving 4 KB in and 4 KB out per row, not
about any trained model. Every cell runs ``--rounds`` times (the protocols take turns going
first); the table shows the medians and each round's req/s. Writes
bench/results/grpc_vs_http.json with the git revision and the command.
Last, the transports alone (``--transport-seconds``, default 4 s a cell, c=16): a trivial
ModelInfer handler on grpc.aio (uvloop) and a trivial POST route on uvicorn + Starlette, each in
a process of its own with nothing behind it, for the CPU each protocol's server side costs per
request before any inferq code runs. Loopback only; every cell is bounded in time and count.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    ROOT,
    Service,
    cpu_seconds,
    markdown_table,
    model_repository,
    save,
    wait_until,
)
from inferq.redisserver import free_port
from loadgen.cli import main as loadgen

PROTOCOLS = ("grpc", "http-json", "http-binary")


def answered(url: str) -> float:
    """Inference requests the gateway has answered (any status, both protocols)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("inferq_gateway_requests_total{") and 'endpoint="infer"' in line
    )


def idle_cpu_rate(service: Service, seconds: float = 3.0) -> float:
    """The gateway's CPU seconds per second with no traffic (its background loops)."""
    gateway = next(pid for pid, role in service.processes().items() if role == "gateway")
    before = cpu_seconds(gateway)
    time.sleep(seconds)
    return (cpu_seconds(gateway) - before) / seconds


def cell(
    service: Service,
    model: str,
    protocol: str,
    concurrency: int,
    duration_s: float,
    idle_rate: float,
) -> dict[str, Any]:
    gateway = next(pid for pid, role in service.processes().items() if role == "gateway")
    workers = [pid for pid, role in service.processes().items() if role == "worker"]
    started = time.monotonic()
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    if protocol == "grpc":
        target = ["--protocol", "grpc", "--url", f"http://127.0.0.1:{service.grpc_port}"]
    else:
        target = ["--url", service.url, *(["--binary"] if protocol == "http-binary" else [])]
    argv = [
        *target,
        "-m",
        model,
        "-c",
        str(concurrency),
        "-d",
        f"{duration_s}s",
        "--warmup",
        "1s",
        "--max-requests",
        "200000",
        "--json",
        str(out),
        "--no-progress",
    ]
    before = (cpu_seconds(gateway), sum(cpu_seconds(p) for p in workers), answered(service.url))
    with contextlib.redirect_stdout(io.StringIO()):
        code = loadgen(argv, environ={})
    after = (cpu_seconds(gateway), sum(cpu_seconds(p) for p in workers), answered(service.url))
    elapsed = time.monotonic() - started
    result = json.loads(out.read_text())
    out.unlink()
    requests = after[2] - before[2]
    return {
        "model": model,
        "protocol": protocol,
        "concurrency": concurrency,
        "exit": code,
        "loadgen": f"inferq loadgen {' '.join(argv[:-3])}",
        "requests": result["requests"],
        "status_counts": result["status_counts"],
        "rps": result["ok_rps"],
        "p50_ms": result["latency_ms"].get("p50"),
        "p99_ms": result["latency_ms"].get("p99"),
        "gateway_answered": requests,
        "gateway_cpu_us_per_request": (after[0] - before[0]) / requests * 1e6 if requests else None,
        "gateway_busy_cpu_us_per_request": (
            (after[0] - before[0] - idle_rate * elapsed) / requests * 1e6 if requests else None
        ),
        "load_average": os.getloadavg()[0],
        "worker_cpu_us_per_request": (after[1] - before[1]) / requests * 1e6 if requests else None,
        "client_cpu_s": result.get("client_cpu_s"),
    }


def serve_transport(kind: str, port: int) -> None:
    """The transport alone (``--serve``): a trivial V2 infer handler, nothing behind it."""
    if kind == "grpc":
        import grpc
        import uvloop

        from protocol.grpc import inferq_v2_pb2 as pb
        from protocol.grpc.service import generic_handler

        class Echo:
            async def ModelInfer(self, request: Any, context: Any) -> Any:
                return pb.ModelInferResponse(model_name=request.model_name)

        async def run() -> None:
            server = grpc.aio.server()
            server.add_generic_rpc_handlers((generic_handler(Echo()),))
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            await server.wait_for_termination()

        uvloop.run(run())
        return
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def infer(request: Request) -> Response:
        await request.body()
        return Response(b'{"model_name":"m","outputs":[]}', media_type="application/json")

    app = Starlette(routes=[Route("/v2/models/m/infer", infer, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def _listening(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), 1):
        return True


def transport_cell(kind: str, concurrency: int, duration_s: float) -> dict[str, Any]:
    """Load a trivial handler of one transport (a subprocess); its CPU per request."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", kind, str(port)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        wait_until(lambda: _listening(port), f"the {kind} server", timeout_s=30, proc=server)
        folder = Path(tempfile.mkdtemp())
        digit = {"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [0.0] * 64}
        (folder / "in.json").write_text(json.dumps({"inputs": [digit]}))
        url = f"http://127.0.0.1:{port}"
        target = ["--protocol", "grpc", "--url", url] if kind == "grpc" else ["--url", url]
        argv = [
            *target,
            *(["--binary"] if kind == "http-binary" else []),
            "-m",
            "m",
            "--input-file",
            str(folder / "in.json"),
            "-c",
            str(concurrency),
            "-d",
            f"{duration_s}s",
            "--warmup",
            "0.5s",
            "--json",
            str(folder / "out.json"),
            "--no-progress",
        ]
        before = cpu_seconds(server.pid)
        with contextlib.redirect_stdout(io.StringIO()):
            loadgen(argv, environ={})
        used = cpu_seconds(server.pid) - before
        result = json.loads((folder / "out.json").read_text())
        shutil.rmtree(folder, ignore_errors=True)
    finally:
        server.terminate()
        server.wait(10)
    sent = result["requests"] + result["warmup_requests"]
    return {
        "transport": kind,
        "concurrency": concurrency,
        "rps": result["ok_rps"],
        "p50_ms": result["latency_ms"].get("p50"),
        "p99_ms": result["latency_ms"].get("p99"),
        "server_cpu_us_per_request": used / sent * 1e6 if sent else None,
        "client_cpu_us_per_request": result["client_cpu_s"] / result["requests"] * 1e6,
        "load_average": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=6.0, help="measured seconds per cell")
    parser.add_argument("--levels", default="1,64", help="closed-loop concurrency levels")
    parser.add_argument("--models", default="digits,medium")
    parser.add_argument(
        "--rounds", type=int, default=2, help="runs of every cell; the table shows medians"
    )
    parser.add_argument(
        "--transport-seconds",
        type=float,
        default=4.0,
        help="seconds per cell of the transport-alone comparison (0: skip it)",
    )
    parser.add_argument("--serve", nargs=2, metavar=("KIND", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve_transport(args.serve[0], int(args.serve[1]))
        return
    levels = [int(v) for v in args.levels.split(",")]
    models = [m for m in args.models.split(",") if m]
    started = time.time()
    cells = []
    with (
        model_repository(digits="digits" in models, medium="medium" in models) as repo,
        Service("--model-repository", str(repo)) as service,
    ):
        for model in models:
            service.wait_for_workers(model, 1)
        idle = idle_cpu_rate(service)
        for round_ in range(args.rounds):
            # Each round runs every cell; the protocols take turns going first, so a change in
            # the machine's load during a round does not always fall on the same protocol.
            order = PROTOCOLS if round_ % 2 == 0 else tuple(reversed(PROTOCOLS))
            for model in models:
                for concurrency in levels:
                    for protocol in order:
                        c = cell(service, model, protocol, concurrency, args.duration, idle)
                        c["round"] = round_
                        cells.append(c)
                        print(
                            f"{model:7} {protocol:11} c={concurrency:<3} {c['rps']:8.0f} req/s  "
                            f"P50 {c['p50_ms']:.2f}  P99 {c['p99_ms']:.2f} ms  gateway "
                            f"{c['gateway_cpu_us_per_request']:.0f} µs/req  "
                            f"{c['status_counts']}",
                            flush=True,
                        )
    rows = []
    for model in models:
        for concurrency in levels:
            for protocol in PROTOCOLS:
                same = [
                    c
                    for c in cells
                    if (c["model"], c["concurrency"], c["protocol"])
                    == (model, concurrency, protocol)
                ]

                def median(key: str, same: list[dict[str, Any]] = same) -> float:
                    return float(statistics.median(c[key] for c in same))

                rows.append(
                    [
                        model + (" (random weights)" if model == "medium" else ""),
                        protocol,
                        concurrency,
                        f"{median('rps'):,.0f}",
                        f"{median('p50_ms'):.2f}",
                        f"{median('p99_ms'):.2f}",
                        f"{median('gateway_cpu_us_per_request'):.0f}",
                        f"{median('gateway_busy_cpu_us_per_request'):.0f}",
                        f"{median('worker_cpu_us_per_request'):.0f}",
                        " / ".join(f"{c['rps']:,.0f}" for c in same),
                        f"{median('load_average'):.1f}",
                    ]
                )
    table = markdown_table(
        [
            "model",
            "protocol",
            "c",
            "req/s",
            "P50 ms",
            "P99 ms",
            "gateway CPU µs/req",
            "same, idle loops subtracted",
            "worker CPU µs/req",
            "req/s of each round",
            "load avg",
        ],
        rows,
    )
    print("\n" + table)
    transport = []
    if args.transport_seconds > 0:
        for kind in ("grpc", "http-binary"):
            t = transport_cell(kind, 16, args.transport_seconds)
            transport.append(t)
            print(
                f"transport {kind:11} c=16 {t['rps']:8.0f} req/s  server "
                f"{t['server_cpu_us_per_request']:.0f} µs/req  client "
                f"{t['client_cpu_us_per_request']:.0f} µs/req",
                flush=True,
            )
    path = save(
        "grpc_vs_http",
        {
            "started": started,
            "duration_s": args.duration,
            "rounds": args.rounds,
            "medium_model": "bench/medium_model.py: 1024-2048-2048-2048-1000, random weights",
            "gateway_idle_cpu_s_per_s": idle,
            "cells": cells,
            "table": table,
            "transport_alone": transport,
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()

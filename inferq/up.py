"""``inferq up``: Redis (found or started), one gateway and N workers on this machine.

Children are started with the parent-death signal set (Linux), so even a ``kill -9`` of
``inferq up`` leaves no orphans; Ctrl-C or SIGTERM stops them in order: workers drain first, then
the gateway, then a private Redis.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from consumer.settings import WorkerSettings
from inferq.redisserver import INSTALL_HINT, RedisServer, RedisServerError, answers
from producer.settings import GatewaySettings
from runtime.argtypes import positive_int
from runtime.connections import redact
from runtime.options import forward_argv, option

EXIT_OK = 0
EXIT_FAILED = 1
READY_TIMEOUT_S = 60.0


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _spawn(argv: list[str], extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    # Each worker must have its own consumer name: never hand them a shared INFERQ_WORKER_ID.
    env = {k: v for k, v in os.environ.items() if k != "INFERQ_WORKER_ID"}
    env.update(extra_env or {})
    return subprocess.Popen(
        [sys.executable, "-m", "inferq", *argv],
        preexec_fn=_die_with_parent,
        # Own process group: a terminal's Ctrl-C reaches only `inferq up`, which then stops
        # the children in order instead of all at once.
        process_group=0,
        env=env,
    )


@dataclass(frozen=True)
class UpSettings:
    """The options of ``inferq up`` itself (it also takes every gateway and worker option)."""

    workers: int = option(
        1,
        flag="--workers",
        env="INFERQ_WORKERS",
        parse=positive_int,
        help="worker processes to start",
    )


def _worker_argv(args: argparse.Namespace, redis_url: str, index: int = 0) -> list[str]:
    port = args.metrics_port + index if args.metrics_port else 0
    argv, _ = forward_argv(args, [WorkerSettings], redis=redis_url, metrics_port=port)
    return ["worker", *argv]


def _gateway_argv(args: argparse.Namespace, redis_url: str) -> tuple[list[str], dict[str, str]]:
    """The gateway's command line, and the secrets it gets in its environment instead (the
    process list shows every user of the host the command line)."""
    argv, env = forward_argv(args, [GatewaySettings], redis=redis_url)
    return ["gateway", *argv], env


def _wait_ready(url: str, processes: list[subprocess.Popen[bytes]], stop: threading.Event) -> bool:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and not stop.is_set():
        if any(p.poll() is not None for p in processes):
            return False
        try:
            with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=1) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        stop.wait(0.2)
    return False


def example_curl(url: str, repository: Path) -> str:
    samples = repository / "digits" / "samples.json"
    data: list[Any] = [0.0] * 64
    if samples.is_file():
        data = json.loads(samples.read_text())["inputs"][0]
    body = json.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "datatype": "FP32",
                    "shape": [1, 64],
                    "data": [round(x) for x in data],
                }
            ]
        },
        separators=(",", ":"),
    )
    return (
        f"curl -s -X POST {url}/v2/models/digits/infer "
        f"-H 'Content-Type: application/json' -d '{body}'"
    )


def _stop_all(processes: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    for p in processes:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in processes:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_up(args: argparse.Namespace) -> int:
    stop = threading.Event()
    signals = 0

    def on_signal(signum: int, frame: object) -> None:
        nonlocal signals
        signals += 1
        stop.set()
        if signals > 1:
            raise KeyboardInterrupt

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    server: RedisServer | None = None
    workers: list[subprocess.Popen[bytes]] = []
    gateway: subprocess.Popen[bytes] | None = None
    redis_url = args.redis_url
    try:
        if not answers(redis_url):
            try:
                server = RedisServer().start()
            except RedisServerError as e:
                print(
                    f"inferq up: no Redis answers at {redact(redis_url)} and {e}", file=sys.stderr
                )
                if "PATH" not in str(e):
                    print(f"inferq up: {INSTALL_HINT}", file=sys.stderr)
                return EXIT_FAILED
            redis_url = server.url
            print(f"inferq up: started a private redis-server at {redis_url}", flush=True)
        else:
            print(f"inferq up: using the Redis at {redact(redis_url)}", flush=True)
        workers = [_spawn(_worker_argv(args, redis_url, i)) for i in range(args.workers)]
        gateway = _spawn(*_gateway_argv(args, redis_url))
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        url = f"http://{host}:{args.port}"
        if not _wait_ready(url, [gateway, *workers], stop):
            if not stop.is_set():
                print(
                    "inferq up: the service did not become ready; see the messages above",
                    file=sys.stderr,
                )
            return EXIT_FAILED if not stop.is_set() else EXIT_OK
        grpc = f" and gRPC at {host}:{args.grpc_port}" if args.grpc_port else ""
        print(
            f"\ninferq is serving at {url}{grpc} with {args.workers} worker(s). Try:\n\n"
            f"  {example_curl(url, args.model_repository)}\n\nCtrl-C stops everything.\n",
            flush=True,
        )
        while not stop.is_set():
            exited = [p for p in [gateway, *workers] if p.poll() is not None]
            if exited:
                print(
                    f"inferq up: a process exited (code {exited[0].returncode}); stopping",
                    file=sys.stderr,
                )
                return EXIT_FAILED
            stop.wait(0.5)
        return EXIT_OK
    except KeyboardInterrupt:
        return EXIT_FAILED
    finally:
        # Workers first so they drain into a gateway that still listens for their replies.
        _stop_all(workers, args.drain_timeout_s + 5)
        if gateway is not None:
            _stop_all([gateway], 15)
        if server is not None:
            server.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)

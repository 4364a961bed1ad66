"""``inferq up``: Redis (found or started), N gateways and N workers on this machine, supervised.

``inferq up`` is the supervisor of what it starts (``inferq/supervisor.py``): a worker or gateway
that exits without being asked to is replaced at once, with backoff while it keeps crashing, and
each restart is logged and counted. Children are started with the parent-death signal set
(Linux), so even a ``kill -9`` of ``inferq up`` leaves no orphans. Only Ctrl-C or SIGTERM stops
the stack, in order: workers drain first, then the gateways, then a private Redis. A second
Ctrl-C kills what is still running.

A private redis-server (started when none answers at ``--redis``) is supervised the same way:
it keeps an AOF in its folder, and one that exits is started again on the same port and folder,
so it replays what it held; gateways and workers reconnect with backoff meanwhile. A Redis that
``inferq up`` found running is not its to restart.

Worker ``i`` keeps one consumer name across restarts, so its replacement finds the entries it
held in its own pending list and runs them at once (no wait for ``--claim-idle-ms``).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from consumer.settings import WorkerSettings
from inferq.gateways import STOP_TIMEOUT_S as GATEWAY_STOP_TIMEOUT_S
from inferq.gateways import ListenError, bind_listeners, gateway_specs, metrics_base
from inferq.redisserver import INSTALL_HINT, RedisServer, RedisServerError, answers
from inferq.supervisor import (
    ChildSpec,
    EventLog,
    Process,
    Spawn,
    Supervisor,
    spawn_inferq,
    supervise,
)
from protocol.argtypes import positive_int
from protocol.exits import EXIT_FAILED, EXIT_OK, StopSignals
from protocol.options import forward_argv, option
from runtime.connections import redact
from runtime.logging import configure

READY_TIMEOUT_S = 60.0
REDIS_STOP_TIMEOUT_S = 10.0
"""How long a private redis-server may take to flush its AOF and exit on SIGTERM."""

log = structlog.get_logger("inferq.up")


@dataclass(frozen=True)
class UpSettings:
    """The options of ``inferq up`` itself (it also takes every gateway and worker option, and
    ``--gateways``)."""

    workers: int = option(
        1,
        flag="--workers",
        env="INFERQ_WORKERS",
        parse=positive_int,
        help="worker processes to start, each restarted if it exits",
    )


def _worker_argv(
    args: argparse.Namespace, redis_url: str, index: int = 0
) -> tuple[list[str], dict[str, str]]:
    """Worker ``index``'s arguments, and the variables that carry its secrets (the Redis URL,
    which may hold a password: never on a command line, which ``ps`` shows every user)."""
    port = args.metrics_port + index if args.metrics_port else 0
    argv, env = forward_argv(args, [WorkerSettings], redis=redis_url, metrics_port=port)
    return ["worker", *argv], env


def _worker_specs(args: argparse.Namespace, redis_url: str) -> list[ChildSpec]:
    prefix = args.worker_id or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
    specs = []
    for i in range(args.workers):
        argv, env = _worker_argv(args, redis_url, i)
        specs.append(
            ChildSpec(
                name=f"worker {i}",
                role="worker",
                # Not forwarded from up's own flags (--worker-id is not for sharing): one name
                # per slot, kept across restarts, so a replacement runs what its predecessor held.
                argv=(*argv, "--worker-id", f"{prefix}-{i}"),
                env=env,
            )
        )
    return specs


def _wait_ready(url: str, supervisor: Supervisor, stop: threading.Event) -> bool:
    """Until the gateway answers ready, restarting children that exit meanwhile."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and not stop.is_set() and supervisor.failure is None:
        supervisor.tick()
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


PRIVATE_REDIS_ARGS = ("--appendonly", "yes", "--appendfsync", "everysec")
"""A private redis-server keeps an append-only file, so that a restart after a crash (which the
supervisor does) replays the queued requests, pending entries, groups and job records."""


def _start_redis(args: argparse.Namespace) -> tuple[str, RedisServer | None]:
    """The Redis to use: ``--redis`` if it answers, else a private redis-server."""
    if answers(args.redis_url):
        print(f"inferq up: using the Redis at {redact(args.redis_url)}", flush=True)
        return args.redis_url, None
    try:
        server = RedisServer(extra_args=PRIVATE_REDIS_ARGS).start()
    except RedisServerError as e:
        print(f"inferq up: no Redis answers at {redact(args.redis_url)} and {e}", file=sys.stderr)
        if "PATH" not in str(e):
            print(f"inferq up: {INSTALL_HINT}", file=sys.stderr)
        raise
    print(
        f"inferq up: started a private redis-server at {server.url} (AOF in {server.folder}; "
        "restarted from it if it exits)",
        flush=True,
    )
    return server.url, server


def _redis_specs(server: RedisServer | None) -> list[ChildSpec]:
    """The private redis-server as a supervised slot (its first process already runs)."""
    return [] if server is None else [ChildSpec(name="redis-server", role="redis", argv=())]


def _spawner(server: RedisServer | None) -> Spawn:
    """How the supervisor starts each slot: ``inferq`` children by ``spawn_inferq``, the private
    Redis by ``RedisServer.spawn``, which hands over the running process or starts a new one on
    the same port and folder."""

    def spawn(spec: ChildSpec) -> Process:
        if spec.role == "redis" and server is not None:
            return server.spawn()
        return spawn_inferq(spec)

    return spawn


def _scrape_targets(args: argparse.Namespace, host: str) -> str:
    """Where Prometheus finds every process's metrics (one target per process)."""
    base = metrics_base(args.gateway_metrics_port, args.gateways)
    if base:
        gateways = ", ".join(f"{host}:{base + i}" for i in range(args.gateways))
    else:
        gateways = f"{host}:{args.port}"
    line = f"Metrics (Prometheus targets): gateway(s) {gateways}"
    if args.metrics_port:
        workers = ", ".join(f"{host}:{args.metrics_port + i}" for i in range(args.workers))
        line += f"; worker(s) {workers}"
    return line + "."


def _restart_summary(restarts: dict[str, int]) -> str:
    total = sum(restarts.values())
    if not total:
        return "no restarts"
    each = ", ".join(f"{name}: {n}" for name, n in restarts.items() if n)
    return f"{total} restart(s) ({each})"


def run_up(args: argparse.Namespace) -> int:
    configure(args.log_level)
    signals = StopSignals()
    server: RedisServer | None = None
    listeners: list[socket.socket] = []
    supervisor: Supervisor | None = None
    with signals.installed():
        try:
            try:
                redis_url, server = _start_redis(args)
            except RedisServerError:
                return EXIT_FAILED
            try:
                listeners = bind_listeners(args.host, args.port, args.gateways)
            except ListenError as e:
                print(f"inferq up: {e}", file=sys.stderr)
                return EXIT_FAILED
            supervisor = Supervisor(
                [
                    *_redis_specs(server),
                    *_worker_specs(args, redis_url),
                    *gateway_specs(args, redis_url, listeners),
                ],
                spawn=_spawner(server),
                on_event=EventLog(log),
            )
            supervisor.start()
            host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
            url = f"http://{host}:{args.port}"
            if not _wait_ready(url, supervisor, signals.stop):
                if signals.stop.is_set():
                    return EXIT_OK
                print(
                    f"inferq up: {supervisor.failure or 'the service did not become ready'}; "
                    "see the messages above",
                    file=sys.stderr,
                )
                return EXIT_FAILED
            grpc = f" and gRPC at {host}:{args.grpc_port}" if args.grpc_port else ""
            print(
                f"\ninferq is serving at {url}{grpc} with {args.workers} worker(s) and "
                f"{args.gateways} gateway(s). Try:\n\n"
                f"  {example_curl(url, args.model_repository)}\n\n"
                f"{_scrape_targets(args, host)}\n"
                "Ctrl-C stops everything; a process that exits is restarted.\n",
                flush=True,
            )
            supervise(supervisor, signals.stop)
            if supervisor.failure is not None:
                print(f"inferq up: {supervisor.failure}; stopping", file=sys.stderr)
                return EXIT_FAILED
            return EXIT_OK
        finally:
            if supervisor is not None:
                # Workers first, so they drain into gateways that still listen for replies.
                supervisor.stop(
                    [
                        ("worker", args.drain_timeout_s + 5),
                        ("gateway", GATEWAY_STOP_TIMEOUT_S),
                        ("redis", REDIS_STOP_TIMEOUT_S),
                    ],
                    force=signals.force,
                )
                print(f"inferq up: stopped; {_restart_summary(supervisor.restarts)}", flush=True)
            for sock in listeners:
                sock.close()
            if server is not None:
                server.stop()

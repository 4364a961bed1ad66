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

``--workers MIN:MAX`` scales the workers on the backlog (``inferq.scaler``, policy in
``inferq.autoscale``): MAX slots exist, the first ones run. A worker scaled in gets SIGTERM and
drains as it does at shutdown (finishes what it holds, up to ``--drain-timeout-s``; what it
still held then stays in its pending list, claimed by the others after ``--claim-idle-ms``, or
run at once by the next process of the same slot). With MIN = 0 the gateways are started with
``--workers-on-demand``: a request that arrives while no worker runs is queued and waits for the
cold start its backlog causes, within its deadline.
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
from inferq.autoscale import (
    ScalingPolicy,
    ScalingTargets,
    WorkerRange,
    parse_worker_range,
)
from inferq.gateways import STOP_TIMEOUT_S as GATEWAY_STOP_TIMEOUT_S
from inferq.gateways import ListenError, bind_listeners, gateway_specs, metrics_base
from inferq.redisserver import INSTALL_HINT, RedisServer, RedisServerError, answers
from inferq.scaler import Autoscaler, BacklogProbe, UpMetrics
from inferq.supervisor import (
    ChildSpec,
    EventLog,
    Process,
    Spawn,
    Supervisor,
    spawn_inferq,
    supervise,
)
from protocol.argtypes import non_negative_float, port_or_off, positive_float, positive_int
from protocol.exits import EXIT_FAILED, EXIT_OK, StopSignals
from protocol.keys import Keys
from protocol.options import forward_argv, from_args, option
from runtime.connections import RedisSettings, redact
from runtime.logging import configure
from runtime.metrics import MetricsServer

READY_TIMEOUT_S = 60.0
REDIS_STOP_TIMEOUT_S = 10.0
"""How long a private redis-server may take to flush its AOF and exit on SIGTERM."""

_TARGETS = ScalingTargets()

log = structlog.get_logger("inferq.up")


@dataclass(frozen=True)
class UpSettings:
    """The options of ``inferq up`` itself (it also takes every gateway and worker option, and
    ``--gateways``)."""

    workers: WorkerRange = option(
        WorkerRange(1, 1),
        flag="--workers",
        env="INFERQ_WORKERS",
        parse=parse_worker_range,
        metavar="N|MIN:MAX",
        help="worker processes, each restarted if it exits: N always, or MIN:MAX scaled on "
        "the backlog (0:4; MIN 0 stops every worker when idle, and a request then waits for "
        "a cold start)",
    )
    scale_backlog_per_worker: int = option(
        _TARGETS.backlog_per_worker,
        flag="--scale-backlog-per-worker",
        env="INFERQ_SCALE_BACKLOG_PER_WORKER",
        parse=positive_int,
        help="with --workers MIN:MAX: one worker per this many entries queued or pending "
        "(summed over the models)",
    )
    scale_oldest_wait_s: float = option(
        _TARGETS.oldest_wait_s,
        flag="--scale-oldest-wait-s",
        env="INFERQ_SCALE_OLDEST_WAIT_S",
        parse=positive_float,
        help="with --workers MIN:MAX: a pending entry older than this adds a worker",
    )
    scale_down_after_s: float = option(
        _TARGETS.scale_down_after_s,
        flag="--scale-down-after-s",
        env="INFERQ_SCALE_DOWN_AFTER_S",
        parse=non_negative_float,
        help="with --workers MIN:MAX: workers are stopped only after the backlog has asked "
        "for fewer for this long",
    )
    scale_up_cooldown_s: float = option(
        _TARGETS.scale_up_cooldown_s,
        flag="--scale-up-cooldown-s",
        env="INFERQ_SCALE_UP_COOLDOWN_S",
        parse=non_negative_float,
        help="with --workers MIN:MAX: least time between two workers added for the oldest "
        "wait (about a worker's start-up time)",
    )
    scale_max_starting: int = option(
        _TARGETS.max_starting,
        flag="--scale-max-starting",
        env="INFERQ_SCALE_MAX_STARTING",
        parse=positive_int,
        help="with --workers MIN:MAX: workers that may be starting at once (each start is a "
        "burst of CPU; on a small host several at once slow the first)",
    )
    scale_interval_s: float = option(
        0.5,
        flag="--scale-interval-s",
        env="INFERQ_SCALE_INTERVAL_S",
        parse=positive_float,
        help="with --workers MIN:MAX: how often the backlog is read",
    )
    scale_metrics_port: int = option(
        0,
        flag="--scale-metrics-port",
        env="INFERQ_SCALE_METRICS_PORT",
        parse=port_or_off,
        help="port of up's own /metrics: workers wanted and running, scaling events (0: off)",
    )

    @property
    def targets(self) -> ScalingTargets:
        return ScalingTargets(
            backlog_per_worker=self.scale_backlog_per_worker,
            oldest_wait_s=self.scale_oldest_wait_s,
            scale_down_after_s=self.scale_down_after_s,
            scale_up_cooldown_s=self.scale_up_cooldown_s,
            max_starting=self.scale_max_starting,
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
    for i in range(args.workers.max):
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
        workers = ", ".join(f"{host}:{args.metrics_port + i}" for i in range(args.workers.max))
        line += f"; worker(s) {workers}"
    return line + "."


def _restart_summary(restarts: dict[str, int]) -> str:
    total = sum(restarts.values())
    if not total:
        return "no restarts"
    each = ", ".join(f"{name}: {n}" for name, n in restarts.items() if n)
    return f"{total} restart(s) ({each})"


class WorkerScaler:
    """The autoscaler of one ``inferq up --workers MIN:MAX`` and what it owns: the backlog
    probe's thread and, with ``--scale-metrics-port``, the metrics server."""

    def __init__(self, up: UpSettings, args: argparse.Namespace, redis_url: str) -> None:
        self.up = up
        self.metrics = UpMetrics()
        self.probe = BacklogProbe(
            RedisSettings(url=redis_url), Keys(args.namespace), up.scale_interval_s
        )
        self._server = (
            MetricsServer(
                self.metrics.registry, up.scale_metrics_port, args.metrics_host or args.host
            )
            if up.scale_metrics_port
            else None
        )
        self._stop_timeout_s = args.drain_timeout_s + 5
        self.autoscaler: Autoscaler | None = None

    def start(self, supervisor: Supervisor) -> None:
        policy = ScalingPolicy(self.up.workers, self.up.targets, now=time.monotonic())
        self.autoscaler = Autoscaler(
            policy, supervisor, self.probe, self.metrics, stop_timeout_s=self._stop_timeout_s
        )
        self.probe.start()
        if self._server is not None:
            self._server.start()

    def tick(self) -> None:
        if self.autoscaler is not None:
            self.autoscaler.tick()

    def stop(self) -> None:
        self.probe.stop()
        if self._server is not None:
            self._server.stop()


def run_up(args: argparse.Namespace) -> int:
    configure(args.log_level)
    up: UpSettings = from_args(UpSettings, args)
    bounds = up.workers
    signals = StopSignals()
    server: RedisServer | None = None
    listeners: list[socket.socket] = []
    supervisor: Supervisor | None = None
    scaling: WorkerScaler | None = None
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
            # At MIN = 0 the gateways queue requests for models no worker serves yet.
            on_demand = {"workers_on_demand": True} if bounds.min == 0 else {}
            supervisor = Supervisor(
                [
                    *_redis_specs(server),
                    *_worker_specs(args, redis_url),
                    *gateway_specs(args, redis_url, listeners, **on_demand),
                ],
                spawn=_spawner(server),
                on_event=EventLog(log),
            )
            supervisor.start({"worker": bounds.initial})
            if not bounds.fixed:
                scaling = WorkerScaler(up, args, redis_url)
                try:
                    scaling.start(supervisor)
                except OSError as e:
                    print(
                        f"inferq up: cannot serve --scale-metrics-port {up.scale_metrics_port}: "
                        f"{e.strerror or e}",
                        file=sys.stderr,
                    )
                    return EXIT_FAILED
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
            workers = str(bounds) if bounds.fixed else f"{bounds} (scaled on the backlog)"
            print(
                f"\ninferq is serving at {url}{grpc} with {workers} worker(s) and "
                f"{args.gateways} gateway(s). Try:\n\n"
                f"  {example_curl(url, args.model_repository)}\n\n"
                f"{_scrape_targets(args, host)}\n"
                "Ctrl-C stops everything; a process that exits is restarted.\n",
                flush=True,
            )
            supervise(supervisor, signals.stop, on_tick=scaling.tick if scaling else None)
            if supervisor.failure is not None:
                print(f"inferq up: {supervisor.failure}; stopping", file=sys.stderr)
                return EXIT_FAILED
            return EXIT_OK
        finally:
            if scaling is not None:
                scaling.stop()
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

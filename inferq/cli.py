"""The ``inferq`` command line: ``up``, ``gateway``, ``worker``.

Every flag can also be set with an ``INFERQ_*`` environment variable (the flag's name in capitals,
dashes as underscores: ``--redis`` is ``INFERQ_REDIS_URL``, ``--max-batch`` is
``INFERQ_MAX_BATCH``); a flag on the command line wins. This is the only module that reads the
environment; it builds one settings object per process and passes it down.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import inferq
from inferq.argtypes import non_negative_float, positive_int
from runtime.connections import RedisSettings

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
EXIT_OK = 0
EXIT_USAGE = 2
EXIT_FAILED = 1


class _Env:
    """Adds flags whose defaults come from ``INFERQ_*`` variables, and says so in the help."""

    def __init__(self, parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
        self.parser = parser
        self.environ = environ

    def add(
        self,
        flag: str,
        *,
        env: str,
        type: Callable[[str], Any] = str,
        default: Any = None,
        help: str,
        **kwargs: Any,
    ) -> None:
        raw = self.environ.get(env)
        value = default
        if raw is not None:
            try:
                value = type(raw)
            except (TypeError, ValueError):
                self.parser.error(f"environment variable {env}={raw!r} is not a valid {flag}")
        shown = "" if default is None else f" (default: {default})"
        self.parser.add_argument(
            flag, type=type, default=value, help=f"{help}{shown} [env {env}]", **kwargs
        )


def connection_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """``--redis`` and ``--namespace``: every command that talks to Redis takes these two."""
    e = _Env(parser, environ)
    e.add(
        "--redis",
        env="INFERQ_REDIS_URL",
        default=DEFAULT_REDIS,
        dest="redis_url",
        help="Redis URL (redis:// or rediss:// for TLS; user:password@ for AUTH)",
    )
    e.add(
        "--namespace",
        env="INFERQ_NAMESPACE",
        default="inferq",
        help="prefix of every Redis key, so deployments can share one Redis",
    )


def _redis_flags(e: _Env) -> None:
    connection_flags(e.parser, e.environ)
    e.add(
        "--log-level",
        env="INFERQ_LOG_LEVEL",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level",
    )


def _gateway_flags(e: _Env) -> None:
    e.add("--host", env="INFERQ_HOST", default="127.0.0.1", help="address to listen on")
    e.add("--port", env="INFERQ_PORT", type=int, default=8000, help="HTTP port")
    e.add(
        "--max-body-bytes",
        env="INFERQ_MAX_BODY_BYTES",
        type=positive_int,
        default=64 * 1024 * 1024,
        help="larger request bodies get 413",
    )
    e.add(
        "--max-timeout-ms",
        env="INFERQ_MAX_TIMEOUT_MS",
        type=positive_int,
        default=300_000,
        help="cap on any request's deadline",
    )
    e.add(
        "--max-backlog",
        env="INFERQ_MAX_BACKLOG",
        type=positive_int,
        default=10_000,
        help="per model: requests beyond this many queued get 429 at once",
    )
    e.add(
        "--job-ttl",
        env="INFERQ_JOB_TTL",
        type=positive_int,
        default=86_400,
        help="seconds job records and results are kept",
    )
    e.add(
        "--job-timeout-s",
        env="INFERQ_JOB_TIMEOUT_S",
        type=positive_int,
        default=3_600,
        help="a job's deadline when the request names no timeout",
    )
    e.add(
        "--max-job-backlog",
        env="INFERQ_MAX_JOB_BACKLOG",
        type=positive_int,
        default=100_000,
        help="per model: job submissions beyond this many queued requests get 429",
    )
    e.add(
        "--max-job-wait-s",
        env="INFERQ_MAX_JOB_WAIT_S",
        type=non_negative_float,
        default=60.0,
        help="longest long poll on GET /v2/jobs/{id}?wait=",
    )
    e.add(
        "--result-ttl-s",
        env="INFERQ_RESULT_TTL_S",
        type=positive_int,
        default=60,
        help="how long an uncached result stays in Redis",
    )
    e.add(
        "--admin-token",
        env="INFERQ_ADMIN_TOKEN",
        help="bearer token of the model-control API (/v2/repository/...); unset disables it "
        "(prefer the environment variable: flags show in the process list)",
    )
    e.add(
        "--admin-load-timeout-s",
        env="INFERQ_ADMIN_LOAD_TIMEOUT_S",
        type=non_negative_float,
        default=120.0,
        help="how long a model load waits for every worker to load and warm the new versions",
    )


def _worker_flags(e: _Env) -> None:
    e.add(
        "--model-repository",
        env="INFERQ_MODEL_REPOSITORY",
        type=Path,
        default=Path("models"),
        help="model repository folder ({name}/config.toml, {name}/{version}/model.onnx)",
    )
    e.add(
        "--models",
        env="INFERQ_MODELS",
        default="",
        help="comma-separated models to serve; empty serves every model in the repository",
    )
    e.add(
        "--max-batch",
        env="INFERQ_MAX_BATCH",
        type=positive_int,
        help="override every model's max_batch (rows per model call)",
    )
    e.add(
        "--flush-ms",
        env="INFERQ_FLUSH_MS",
        type=non_negative_float,
        help="override every model's flush window (longest wait for a batch to fill)",
    )
    e.add(
        "--device",
        env="INFERQ_DEVICE",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where models run",
    )
    e.add(
        "--drain-timeout-s",
        env="INFERQ_DRAIN_TIMEOUT_S",
        type=non_negative_float,
        default=30.0,
        help="on SIGTERM, how long to finish in-flight batches",
    )
    e.add(
        "--metrics-port",
        env="INFERQ_METRICS_PORT",
        type=int,
        default=9100,
        help="port of the worker's Prometheus /metrics (0: off); under `inferq up` worker i "
        "(from 0) gets this port + i",
    )
    e.add(
        "--worker-id",
        env="INFERQ_WORKER_ID",
        help="consumer name in the group (default: host-pid-random); reuse a dead worker's "
        "name to recover its pending entries at once",
    )
    e.add(
        "--claim-idle-ms",
        env="INFERQ_CLAIM_IDLE_MS",
        type=positive_int,
        default=30_000,
        help="take over entries another worker has held this long without renewing them",
    )
    e.add(
        "--max-deliveries",
        env="INFERQ_MAX_DELIVERIES",
        type=positive_int,
        default=5,
        help="dead-letter an entry delivered more often than this (it keeps crashing workers)",
    )
    e.add(
        "--heartbeat-s",
        env="INFERQ_HEARTBEAT_S",
        type=non_negative_float,
        default=2.0,
        help="how often the worker refreshes its advertisement",
    )
    e.add(
        "--retire-after-s",
        env="INFERQ_RETIRE_AFTER_S",
        type=non_negative_float,
        default=30.0,
        help="after a model version change, how long dropped versions still answer requests "
        "routed to them before it",
    )


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inferq",
        description="Queue-driven inference: an Open Inference Protocol (KServe V2) gateway "
        "over Redis Streams with dynamic-batching workers.",
    )
    parser.add_argument("--version", action="version", version=f"inferq {inferq.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser(
        "up",
        help="run Redis (if needed), a gateway and workers on this machine",
        description="All-in-one local run. Uses the Redis at --redis if one "
        "answers, else starts a private redis-server on a free port.",
    )
    e = _Env(up, environ)
    _redis_flags(e)
    _gateway_flags(e)
    _worker_flags(e)
    e.add(
        "--workers",
        env="INFERQ_WORKERS",
        type=positive_int,
        default=1,
        help="worker processes to start",
    )

    gw = sub.add_parser(
        "gateway",
        help="run the HTTP gateway",
        description="Serve the Open Inference Protocol over HTTP, queueing "
        "requests on Redis Streams.",
    )
    e = _Env(gw, environ)
    _redis_flags(e)
    _gateway_flags(e)

    wk = sub.add_parser(
        "worker",
        help="run a worker that serves models from the repository",
        description="Join the consumer group of each served model, batch "
        "requests and run them. Start as many as you like, anywhere that "
        "reaches the same Redis.",
    )
    e = _Env(wk, environ)
    _redis_flags(e)
    _worker_flags(e)

    from inferq import dlq, lag, models_cli
    from loadgen import cli as loadgen_cli

    lag.add_parser(sub, environ)
    dlq.add_parser(sub, environ)
    loadgen_cli.add_parser(sub, environ)
    models_cli.add_parser(sub, environ)
    return parser


def _redis_settings(args: argparse.Namespace) -> RedisSettings:
    return RedisSettings(url=args.redis_url)


def _start_tracing(command: str, environ: Mapping[str, str]) -> bool:
    """Tracing as the ``OTEL_*`` variables say (off unless they name an exporter)."""
    from runtime import tracing

    try:
        tracing.configure(environ, service=f"inferq-{command}")
    except tracing.TracingError as e:
        print(f"inferq {command}: {e}", file=sys.stderr)
        return False
    return True


def run_gateway(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> int:
    import uvicorn

    from producer.app import create_app
    from producer.settings import GatewaySettings
    from runtime.logging import configure

    configure(args.log_level)
    if not _start_tracing("gateway", environ):
        return EXIT_USAGE
    settings = GatewaySettings(
        redis=_redis_settings(args),
        namespace=args.namespace,
        host=args.host,
        port=args.port,
        max_body_bytes=args.max_body_bytes,
        max_timeout_ms=args.max_timeout_ms,
        result_ttl_s=args.result_ttl_s,
        max_backlog=args.max_backlog,
        job_ttl_s=args.job_ttl,
        job_timeout_s=args.job_timeout_s,
        max_job_backlog=args.max_job_backlog,
        max_job_wait_s=args.max_job_wait_s,
        admin_token=args.admin_token or None,
        admin_load_timeout_s=args.admin_load_timeout_s,
        log_level=args.log_level,
    )
    uvicorn.run(
        create_app(settings),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=10,
    )
    return EXIT_OK


def run_worker(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> int:
    from consumer.repository import RepositoryError
    from consumer.settings import WorkerSettings
    from consumer.worker import MetricsPortError, Worker
    from runtime.logging import configure

    configure(args.log_level)
    if not _start_tracing("worker", environ):
        return EXIT_USAGE
    settings = WorkerSettings(
        redis=_redis_settings(args),
        namespace=args.namespace,
        model_repository=args.model_repository,
        models=tuple(m.strip() for m in args.models.split(",") if m.strip()),
        max_batch=args.max_batch,
        flush_ms=args.flush_ms,
        device=args.device,
        drain_timeout_s=args.drain_timeout_s,
        claim_idle_ms=args.claim_idle_ms,
        metrics_port=args.metrics_port,
        **({"worker_id": args.worker_id} if args.worker_id else {}),
        max_deliveries=args.max_deliveries,
        heartbeat_s=args.heartbeat_s,
        retire_after_s=args.retire_after_s,
        log_level=args.log_level,
    )
    worker = Worker(settings)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        signals = 0

        def on_signal() -> None:
            nonlocal signals
            signals += 1
            if signals > 1:
                os._exit(EXIT_FAILED)  # a second signal forces exit, as promised in --help
            worker.request_stop()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        await worker.run()

    try:
        _run(main())
    except (RepositoryError, MetricsPortError) as e:
        print(f"inferq worker: {e}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK


def _run(coro: Any) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    args = build_parser(environ).parse_args(argv)
    if args.command == "gateway":
        return run_gateway(args, environ)
    if args.command == "worker":
        return run_worker(args, environ)
    if args.command == "dlq":
        from inferq import dlq

        return dlq.run(args)
    if args.command == "lag":
        from inferq import lag

        return lag.run(args)
    if args.command == "models":
        from inferq import models_cli

        return models_cli.run(args)
    if args.command == "loadgen":
        from loadgen import cli as loadgen_cli

        return loadgen_cli.run(args)
    from inferq.up import run_up

    return run_up(args)


if __name__ == "__main__":
    sys.exit(main())

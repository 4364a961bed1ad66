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
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

import structlog

import inferq
from consumer.settings import WorkerSettings
from inferq.gateways import FleetSettings, ListenError
from inferq.up import UpSettings
from producer.settings import GatewaySettings
from protocol.exits import (
    EXIT_FAILED,
    EXIT_LOOP_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    StopSignals,
    restarts_from,
)
from protocol.options import add_flags, from_args
from runtime import runner


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
    add_flags(up, environ, GatewaySettings, WorkerSettings, UpSettings, FleetSettings)

    gw = sub.add_parser(
        "gateway",
        help="run the HTTP gateway",
        description="Serve the Open Inference Protocol over HTTP, queueing "
        "requests on Redis Streams.",
    )
    add_flags(gw, environ, GatewaySettings, FleetSettings)
    # Internal: a gateway process that `inferq up` or `inferq gateway --gateways N` started
    # serves the listening socket it inherited instead of binding one.
    gw.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)

    wk = sub.add_parser(
        "worker",
        help="run a worker that serves models from the repository",
        description="Join the consumer group of each served model, batch "
        "requests and run them. Start as many as you like, anywhere that "
        "reaches the same Redis.",
    )
    add_flags(wk, environ, WorkerSettings)

    from inferq import batch_cli, console_cli, dlq, lag, models_cli
    from loadgen import cli as loadgen_cli

    console_cli.add_parser(sub, environ)
    lag.add_parser(sub, environ)
    batch_cli.add_parser(sub, environ)
    dlq.add_parser(sub, environ)
    loadgen_cli.add_parser(sub, environ)
    models_cli.add_parser(sub, environ)
    _usage_of_each_command(parser)
    return parser


def _usage_of_each_command(parser: argparse.ArgumentParser) -> None:
    """Each (sub)command remembers its own parser: argparse reports an argument no parser took
    with the top-level usage, which says nothing about ``inferq dlq list``'s flags."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                command.set_defaults(usage_parser=command)  # the innermost command's wins
                _usage_of_each_command(command)


def parse(argv: Sequence[str] | None, environ: Mapping[str, str]) -> argparse.Namespace:
    """The command line, with an argument no command takes reported by the command it was
    given to (``inferq dlq list digits``: dlq list's usage and error, exit 2)."""
    parser = build_parser(environ)
    args, extra = parser.parse_known_args(argv)
    if extra:
        command: argparse.ArgumentParser = getattr(args, "usage_parser", parser)
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


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
    from producer.server import server_config
    from producer.settings import GatewaySettings
    from runtime.logging import configure

    configure(args.log_level)
    if args.gateways > 1 and args.listen_fd is None:
        from inferq.gateways import run_gateways

        return run_gateways(args)  # the gateways it starts set up tracing, each for itself
    if not _start_tracing("gateway", environ):
        return EXIT_USAGE
    settings: GatewaySettings = from_args(GatewaySettings, args)
    try:
        listener = _gateway_listener(args, settings)
    except ListenError as e:  # before anything starts: one line, and no restart can fix it
        print(f"inferq gateway: {e}", file=sys.stderr)
        return EXIT_USAGE
    app = create_app(settings)
    server = uvicorn.Server(server_config(app, settings))
    gateway = app.state.gateway
    try:
        metrics = _gateway_metrics(gateway.metrics.registry, settings)
    except ListenError as e:
        print(f"inferq gateway: {e}", file=sys.stderr)
        return EXIT_USAGE

    def stop_server() -> None:
        server.should_exit = True

    gateway.on_fatal = stop_server  # a crashed loop: stop, then exit non-zero

    def exit_code(error: BaseException | None = None) -> int:
        if gateway.failure is not None:
            return EXIT_LOOP_FAILED
        return EXIT_OK if server.started and error is None else EXIT_FAILED

    try:
        runner.run(
            server.serve(sockets=[listener]),
            exit_code=exit_code,
            what="inferq gateway",
            loop_factory=server.config.get_loop_factory(),
        )
    finally:
        if metrics is not None:
            metrics.stop()
    if gateway.failure is not None:
        print(
            f"inferq gateway: {gateway.failure}; exiting so that a supervisor restarts it",
            file=sys.stderr,
        )
    return exit_code()


def _gateway_listener(args: argparse.Namespace, settings: GatewaySettings) -> socket.socket:
    """The HTTP socket: inherited from `inferq up` or `inferq gateway --gateways N` (its family
    and type are read from the descriptor), else bound here; and the gRPC port checked. Raises
    ``ListenError``."""
    from inferq.gateways import bind_listeners, check_grpc_port

    if settings.grpc_port:
        check_grpc_port(settings.host, settings.grpc_port)
    if args.listen_fd is not None:
        return socket.socket(fileno=args.listen_fd)
    (listener,) = bind_listeners(settings.host, settings.port, 1)
    host, port = listener.getsockname()[:2]
    structlog.get_logger("inferq.gateway").info("HTTP listening", address=f"{host}:{port}")
    return listener


def _gateway_metrics(registry: Any, settings: GatewaySettings) -> Any:
    """This gateway's ``/metrics`` on a port of its own (``--gateway-metrics-port``), started;
    None when off. Raises ``ListenError``. One per process, so that with several gateways on
    one port Prometheus scrapes each of them (see docs/monitoring.md)."""
    from inferq.gateways import ListenError
    from runtime.metrics import MetricsServer

    if not settings.metrics_port:
        return None
    server = MetricsServer(registry, settings.metrics_port, settings.host)
    try:
        server.start()
    except OSError as e:
        raise ListenError(
            f"cannot serve metrics on {settings.host}:{settings.metrics_port}: "
            f"{e.strerror or e}; pick another with --gateway-metrics-port, or 0 for none"
        ) from e
    structlog.get_logger("inferq.gateway").info(
        "metrics listening", address=f"{settings.host}:{server.port}"
    )
    return server


def run_worker(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> int:
    from consumer.repository import RepositoryError
    from consumer.worker import LoopCrashed, MetricsPortError, Worker
    from runtime.logging import configure

    configure(args.log_level)
    if not _start_tracing("worker", environ):
        return EXIT_USAGE
    settings: WorkerSettings = from_args(WorkerSettings, args, restarts=restarts_from(environ))
    worker = Worker(settings)

    # A second signal forces exit, as promised in --help: no drain, no cleanup.
    signals = StopSignals(on_stop=worker.request_stop, on_force=lambda: os._exit(EXIT_FAILED))

    async def main() -> None:
        with signals.installed_on(asyncio.get_running_loop()):
            await worker.run()

    def exit_code(error: BaseException | None) -> int:
        if isinstance(error, (RepositoryError, MetricsPortError)):
            return EXIT_USAGE
        if isinstance(error, LoopCrashed):
            return EXIT_LOOP_FAILED
        return EXIT_OK if error is None else EXIT_FAILED

    try:
        runner.run(main(), exit_code=exit_code, what="inferq worker", loop_factory=_loop_factory())
    except (RepositoryError, MetricsPortError) as e:
        print(f"inferq worker: {e}", file=sys.stderr)
        return EXIT_USAGE
    except LoopCrashed as e:
        print(f"inferq worker: {e}; exiting so that a supervisor restarts it", file=sys.stderr)
        return EXIT_LOOP_FAILED
    return EXIT_OK


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop where it is installed (as for the gateway, uvicorn's "auto")."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    args = parse(argv, environ)
    if args.command == "gateway":
        return run_gateway(args, environ)
    if args.command == "worker":
        return run_worker(args, environ)
    if args.command == "dlq":
        from inferq import dlq

        return dlq.run(args)
    if args.command == "console":
        from inferq import console_cli

        return console_cli.run(args)
    if args.command == "lag":
        from inferq import lag

        return lag.run(args)
    if args.command == "batch":
        from inferq import batch_cli

        return batch_cli.run(args)
    if args.command == "models":
        from inferq import models_cli

        return models_cli.run(args)
    if args.command == "loadgen":
        from loadgen import cli as loadgen_cli

        return loadgen_cli.run(args)
    from inferq.up import run_up

    return run_up(args)


def entry() -> NoReturn:
    """The ``inferq`` command (its console script, ``python -m inferq``): ``main``, then an exit
    that a thread left running cannot hold up (``runtime.runner.exit``)."""
    runner.exit(main(), what="inferq")


if __name__ == "__main__":
    entry()

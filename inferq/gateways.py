"""Several gateway processes on one port (``--gateways N``): for ``inferq up``, and for
``inferq gateway`` on hosts that run it under a process manager.

The supervising process binds one listening socket per gateway slot, all on the same address
with ``SO_REUSEPORT``, so the kernel spreads new connections evenly over them (one shared socket
would let whichever process wakes first take a burst of connections). Each gateway process
inherits its slot's socket (``--listen-fd``) and serves it with uvicorn. The supervisor keeps the
sockets open for the life of the stack: when a gateway dies, connections queued on its socket are
not reset but wait for its replacement (about a second), which inherits the same socket; every
other slot keeps answering meanwhile.

Each gateway process has its own gateway id and so its own reply stream; they share nothing but
Redis.
"""

from __future__ import annotations

import argparse
import socket
import sys
from dataclasses import dataclass
from typing import Any

import structlog

from inferq.supervisor import (
    ChildSpec,
    EventLog,
    Supervisor,
    spawn_inferq,
    supervise,
)
from producer.settings import DEFAULT_GATEWAY_METRICS_PORT, GatewaySettings
from protocol.argtypes import positive_int
from protocol.exits import EXIT_FAILED, EXIT_OK, StopSignals
from protocol.options import forward_argv, option

STOP_TIMEOUT_S = 15.0
"""How long a gateway may take to finish the requests it holds (uvicorn's graceful shutdown is
10 s) before it is killed."""


class ListenError(OSError):
    """The gateways' address cannot be bound (in use, not local, no permission)."""


def _resolve(host: str, port: int, what: str) -> tuple[tuple[int, int, int, Any], str]:
    """(family, type, proto, address) to bind ``host:port``, and how errors name it."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise ListenError(f"cannot listen{what} on {where}: {e}") from e
    return (family, kind, proto, address), where


def bind_listeners(host: str, port: int, n: int, backlog: int = 2048) -> list[socket.socket]:
    """``n`` listening sockets on ``host:port``; with ``SO_REUSEPORT`` when ``n > 1``. The
    sockets are inheritable, for the gateway processes."""
    (family, kind, proto, address), where = _resolve(host, port, "")
    listeners: list[socket.socket] = []
    try:
        for _ in range(n):
            sock = socket.socket(family, kind, proto)
            listeners.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if n > 1:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(address)
            sock.listen(backlog)
            sock.set_inheritable(True)
    except OSError as e:
        for sock in listeners:
            sock.close()
        raise ListenError(f"cannot listen on {where}: {e.strerror or e}") from e
    return listeners


def check_grpc_port(host: str, port: int) -> None:
    """Raise ``ListenError`` now, before the gateway connects to anything, if its gRPC server
    could not bind ``host:port``. grpc binds inside the app's lifespan, where a failure is a
    traceback (and, under a supervisor, a restart that fails alike). This binds the port as
    grpc does, with ``SO_REUSEPORT`` (the gateways of one host share the port by it), without
    listening, and lets it go."""
    (family, kind, proto, address), where = _resolve(host, port, " for gRPC")
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            probe.bind(address)
        except OSError as e:
            raise ListenError(f"cannot listen for gRPC on {where}: {e.strerror or e}") from e


@dataclass(frozen=True)
class FleetSettings:
    """How many gateway processes serve the port: an option of ``inferq up`` and of
    ``inferq gateway`` (a supervising process; each gateway it starts serves one socket)."""

    gateways: int = option(
        1,
        flag="--gateways",
        env="INFERQ_GATEWAYS",
        parse=positive_int,
        forward=False,
        help="gateway processes serving the one port (SO_REUSEPORT), each restarted if it exits",
    )


def gateway_specs(
    args: argparse.Namespace, redis_url: str, listeners: list[socket.socket], **override: Any
) -> list[ChildSpec]:
    """One supervised slot per listening socket. Secrets (the Redis URL, which may hold a
    password, the admin token, the webhook key) travel in the environment: the process list
    shows every user of the host the command line. ``override``: gateway settings by field
    name (``workers_on_demand=True``)."""
    base = metrics_base(args.gateway_metrics_port, len(listeners))
    specs = []
    for i, sock in enumerate(listeners):
        argv, env = forward_argv(
            args,
            [GatewaySettings],
            redis=redis_url,
            metrics_port=base + i if base else 0,
            **override,
        )
        specs.append(
            ChildSpec(
                name=f"gateway {i}",
                role="gateway",
                # --gateways 1: the child serves; INFERQ_GATEWAYS in the environment must not
                # make it a supervisor of its own.
                argv=("gateway", *argv, "--gateways", "1", "--listen-fd", str(sock.fileno())),
                env=env,
                pass_fds=(sock.fileno(),),
            )
        )
    return specs


def metrics_base(given: int | None, gateways: int) -> int:
    """The metrics port of gateway 0 (gateway i: this + i; 0: none of their own). Unsaid, one
    gateway needs none (its /metrics on the shared port is the only process), several get
    ``DEFAULT_GATEWAY_METRICS_PORT`` + i: a scrape through the shared port would reach one of
    them at random."""
    if given is not None:
        return given
    return DEFAULT_GATEWAY_METRICS_PORT if gateways > 1 else 0


def run_gateways(args: argparse.Namespace) -> int:
    """``inferq gateway --gateways N``: bind, start N gateway processes, keep them running
    until SIGINT or SIGTERM, then stop them."""
    try:
        listeners = bind_listeners(args.host, args.port, args.gateways)
    except ListenError as e:
        print(f"inferq gateway: {e}", file=sys.stderr)
        return EXIT_FAILED

    supervisor = Supervisor(
        gateway_specs(args, args.redis_url, listeners),
        spawn=spawn_inferq,
        on_event=EventLog(structlog.get_logger("inferq.gateway")),
    )
    signals = StopSignals()
    try:
        with signals.installed():
            supervisor.start()
            supervise(supervisor, signals.stop)
            supervisor.stop([("gateway", STOP_TIMEOUT_S)], force=signals.force)
    finally:
        supervisor.kill_all()
        for sock in listeners:
            sock.close()
    if supervisor.failure:
        print(f"inferq gateway: {supervisor.failure}", file=sys.stderr)
    return EXIT_FAILED if supervisor.failure else EXIT_OK

"""Worker settings: one frozen object, built by the CLI from flags and ``INFERQ_*`` variables.

Each user-settable field declares its flag, variable and help here, once (``protocol.options``);
the ``inferq`` parsers and ``inferq up``'s forwarding derive from these declarations.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

from protocol.argtypes import (
    non_negative_float,
    non_negative_int,
    port_or_off,
    positive_float,
    positive_int,
)
from protocol.options import option
from runtime.settings import DEFAULT_HOST, ConnectionSettings

DEFAULT_METRICS_PORT = 8002
"""``--metrics-port`` of a worker started from the command line. Triton's metrics port, next to
the gateway's 8000 (HTTP) and 8001 (gRPC) that inferq already shares with Triton; and outside
9100-9999, the range Prometheus' list of default port allocations gives to exporters (9100 is
node_exporter's, on nearly every monitored host), since a worker often runs beside them."""
DEVICES = ("cpu", "cuda")
LOAD_MODES = ("start", "on-demand")
"""``--load``: every model at start (the default), or each when requests for it wait."""


def default_worker_id() -> str:
    """Unique per process, readable in ``XINFO CONSUMERS``: host, pid and a random suffix."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def model_list(raw: str) -> tuple[str, ...]:
    return tuple(m.strip() for m in raw.split(",") if m.strip())


@dataclass(frozen=True)
class WorkerSettings(ConnectionSettings):
    model_repository: Path = option(
        Path("models"),
        flag="--model-repository",
        env="INFERQ_MODEL_REPOSITORY",
        parse=Path,
        help="model repository folder ({name}/config.toml, {name}/{version}/model.onnx)",
    )
    models: tuple[str, ...] = option(
        (),
        flag="--models",
        env="INFERQ_MODELS",
        parse=model_list,
        render=",".join,
        help="comma-separated models to serve; empty serves every model in the repository",
    )
    max_batch: int | None = option(
        None,
        flag="--max-batch",
        env="INFERQ_MAX_BATCH",
        parse=positive_int,
        help="override every model's max_batch (rows per model call)",
    )
    flush_ms: float | None = option(
        None,
        flag="--flush-ms",
        env="INFERQ_FLUSH_MS",
        parse=non_negative_float,
        help="override every model's flush window (longest wait for a batch to fill)",
    )
    device: str = option(
        "cpu", flag="--device", env="INFERQ_DEVICE", choices=DEVICES, help="where models run"
    )
    worker_id: str = option(
        default_factory=default_worker_id,
        flag="--worker-id",
        env="INFERQ_WORKER_ID",
        # Each worker of `inferq up` must have its own consumer name: never hand one down.
        forward=False,
        help="consumer name in the group (default: host-pid-random); reuse a dead worker's "
        "name to recover its pending entries at once",
    )
    heartbeat_s: float = option(
        2.0,
        flag="--heartbeat-s",
        env="INFERQ_HEARTBEAT_S",
        parse=non_negative_float,
        help="how often the worker refreshes its advertisement",
    )
    worker_ttl_s: float = option(
        10.0,
        flag="--worker-ttl-s",
        env="INFERQ_WORKER_TTL_S",
        parse=positive_float,
        help="a worker whose last heartbeat is older than this counts as gone (keep it a few "
        "--heartbeat-s above the heartbeat)",
    )
    """A worker whose heartbeat is older than this counts as gone."""
    block_ms: int = 2000
    """How long one blocking read waits before looping (not a latency: reads return at once
    when a request arrives)."""
    metrics_port: int = option(
        0,
        flag="--metrics-port",
        env="INFERQ_METRICS_PORT",
        parse=port_or_off,
        # Off for workers built in code (tests, embedding) so they never fight over a port; on
        # for a worker started from the command line, where an operator expects a scrape target.
        cli_default=DEFAULT_METRICS_PORT,
        help="port of the worker's Prometheus /metrics (0: off); under `inferq up` worker i "
        "(from 0) gets this port + i",
    )
    metrics_host: str = option(
        DEFAULT_HOST,
        flag="--metrics-host",
        env="INFERQ_METRICS_HOST",
        # Unset on the command line, `inferq up` hands its --host to the workers, and
        # `inferq worker` keeps this field's default, the same as --host's.
        cli_default=None,
        follows="host",
        help=f"address the worker's /metrics listens on (default: --host under `inferq up`, "
        f"else {DEFAULT_HOST}; 0.0.0.0 for every interface, as in a container)",
    )
    drain_timeout_s: float = option(
        30.0,
        flag="--drain-timeout-s",
        env="INFERQ_DRAIN_TIMEOUT_S",
        parse=non_negative_float,
        help="on SIGTERM, how long to finish in-flight batches",
    )
    claim_idle_ms: int = option(
        30_000,
        flag="--claim-idle-ms",
        env="INFERQ_CLAIM_IDLE_MS",
        parse=positive_int,
        help="take over entries another worker has held this long without renewing them",
    )
    max_deliveries: int = option(
        5,
        flag="--max-deliveries",
        env="INFERQ_MAX_DELIVERIES",
        parse=positive_int,
        help="dead-letter an entry delivered more often than this (it keeps crashing workers)",
    )
    retire_after_s: float = option(
        30.0,
        flag="--retire-after-s",
        env="INFERQ_RETIRE_AFTER_S",
        parse=non_negative_float,
        help="after a model version change, how long dropped versions still answer requests "
        "routed to them before it",
    )
    load: str = option(
        "start",
        flag="--load",
        env="INFERQ_LOAD",
        choices=LOAD_MODES,
        help="when models load: `start` loads every model served at start; `on-demand` loads "
        "none and loads a model of the repository (or of --models) when requests for it wait "
        "(docs/on-demand.md)",
    )
    max_loaded_models: int = option(
        0,
        flag="--max-loaded-models",
        env="INFERQ_MAX_LOADED_MODELS",
        parse=non_negative_int,
        help="on demand: most models held at once; loading one more unloads the least recently "
        "used first (0: no limit)",
    )
    max_model_memory_mib: float = option(
        0.0,
        flag="--max-model-memory-mib",
        env="INFERQ_MAX_MODEL_MEMORY_MIB",
        parse=non_negative_float,
        help="on demand: most resident memory the loaded models may hold, as measured at each "
        "load; the least recently used are unloaded to make room (0: no limit)",
    )
    load_after_ms: int = option(
        2000,
        flag="--load-after-ms",
        env="INFERQ_LOAD_AFTER_MS",
        parse=non_negative_int,
        help="on demand: load a model another worker already holds only once its oldest unread "
        "request has waited this long (a model nobody holds loads at once)",
    )
    unload_idle_s: float = option(
        0.0,
        flag="--unload-idle-s",
        env="INFERQ_UNLOAD_IDLE_S",
        parse=non_negative_float,
        help="on demand: unload a model that ran no request for this long (0: never)",
    )
    restarts: int = 0
    """How many times ``inferq up`` restarted this worker's slot before this process: the CLI
    reads it from ``INFERQ_RESTARTS`` (``protocol.exits.RESTARTS_ENV``, set by the supervisor,
    not by users), and the worker advertises it."""
    demand_poll_s: float = 0.25
    """On demand: how often the worker looks for requests waiting for a model it does not hold
    (one GET of the published backlog snapshot while it is fresh)."""

    @property
    def on_demand(self) -> bool:
        return self.load == "on-demand"

"""Gateway settings: one frozen object, built by the CLI from flags and ``INFERQ_*`` variables.

Each user-settable field declares its flag, variable and help here, once (``protocol.options``);
the ``inferq`` parsers and ``inferq up``'s forwarding derive from these declarations.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from protocol.argtypes import non_negative_float, port_or_off, positive_float, positive_int
from protocol.options import option
from runtime.settings import DEFAULT_HOST, ConnectionSettings

JOB_DURABILITY = ("async", "replicated")


def default_gateway_id() -> str:
    return secrets.token_hex(6)


@dataclass(frozen=True)
class GatewaySettings(ConnectionSettings):
    host: str = option(DEFAULT_HOST, flag="--host", env="INFERQ_HOST", help="address to listen on")
    port: int = option(8000, flag="--port", env="INFERQ_PORT", parse=int, help="HTTP port")
    grpc_port: int = option(
        8001,
        flag="--grpc-port",
        env="INFERQ_GRPC_PORT",
        parse=port_or_off,
        help="port of the Open Inference Protocol over gRPC, on the same --host (0: off)",
    )
    gateway_id: str = field(default_factory=default_gateway_id)
    """Names this process's reply stream; unique per process."""
    max_body_bytes: int = option(
        64 * 1024 * 1024,
        flag="--max-body-bytes",
        env="INFERQ_MAX_BODY_BYTES",
        parse=positive_int,
        help="larger request bodies get 413",
    )
    max_inflight_bytes: int = option(
        256 * 1024 * 1024,
        flag="--max-inflight-bytes",
        env="INFERQ_MAX_INFLIGHT_BYTES",
        parse=positive_int,
        help="bytes of request bodies the gateway holds at once (being read, queued, waiting "
        "for their answer); beyond it a request gets 429 with Retry-After, and one larger than "
        "all of it 413",
    )
    header_timeout_s: float = option(
        10.0,
        flag="--header-timeout-s",
        env="INFERQ_HEADER_TIMEOUT_S",
        parse=positive_float,
        help="a connection that has not sent a request's complete headers this long after it "
        "opened (or after the first byte of its next request) gets 408 and is closed",
    )
    body_timeout_s: float = option(
        60.0,
        flag="--body-timeout-s",
        env="INFERQ_BODY_TIMEOUT_S",
        parse=positive_float,
        help="a request body not fully received this long after its headers gets 408",
    )
    max_timeout_ms: int = option(
        300_000,
        flag="--max-timeout-ms",
        env="INFERQ_MAX_TIMEOUT_MS",
        parse=positive_int,
        help="cap on any request's deadline",
    )
    result_ttl_s: int = option(
        60,
        flag="--result-ttl-s",
        env="INFERQ_RESULT_TTL_S",
        parse=positive_int,
        help="how long an uncached result stays in Redis",
    )
    registry_refresh_s: float = 1.0
    """How often the gateway re-reads which workers are live and what they serve."""
    reply_block_ms: int = 2000
    heartbeat_s: float = 5.0
    """How often the gateway refreshes its reply stream's TTL (and sweeps for lost requests)."""
    max_backlog: int = option(
        10_000,
        flag="--max-backlog",
        env="INFERQ_MAX_BACKLOG",
        parse=positive_int,
        help="per model: requests beyond this many queued get 429 at once",
    )
    job_ttl_s: int = option(
        86_400,
        flag="--job-ttl",
        env="INFERQ_JOB_TTL",
        parse=positive_int,
        help="seconds job records and results are kept",
    )
    job_timeout_s: int = option(
        3_600,
        flag="--job-timeout-s",
        env="INFERQ_JOB_TIMEOUT_S",
        parse=positive_int,
        help="a job's deadline when the request names no timeout",
    )
    max_job_backlog: int = option(
        100_000,
        flag="--max-job-backlog",
        env="INFERQ_MAX_JOB_BACKLOG",
        parse=positive_int,
        help="per model: job submissions beyond this many queued requests get 429",
    )
    max_job_wait_s: float = option(
        60.0,
        flag="--max-job-wait-s",
        env="INFERQ_MAX_JOB_WAIT_S",
        parse=non_negative_float,
        help="longest long poll on GET /v2/jobs/{id}?wait=",
    )
    job_durability: str = option(
        "async",
        flag="--job-durability",
        env="INFERQ_JOB_DURABILITY",
        choices=JOB_DURABILITY,
        help="async: a job is accepted (202) once Redis has it, as fast as it gets; replicated: "
        "only once WAIT confirms at least one replica has the job's record and its request, "
        "so a master failing right after cannot lose it (needs replicas)",
    )
    job_replica_wait_ms: int = 1000
    """Under ``job_durability = "replicated"``: how long a submission waits for a replica to
    confirm; unconfirmed, the job is cancelled and the client gets 503."""
    stream_gauges_s: float = 5.0
    """How often the stream gauges (length, lag, pending, ...) are refreshed from Redis."""
    admin_token: str | None = option(
        None,
        flag="--admin-token",
        env="INFERQ_ADMIN_TOKEN",
        secret=True,
        help="bearer token of the model-control API (/v2/repository/...); unset disables it "
        "(prefer the environment variable: flags show in the process list)",
    )
    admin_load_timeout_s: float = option(
        120.0,
        flag="--admin-load-timeout-s",
        env="INFERQ_ADMIN_LOAD_TIMEOUT_S",
        parse=non_negative_float,
        help="how long a model load waits for every worker to load and warm the new versions",
    )

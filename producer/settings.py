"""Gateway settings: one frozen object, built by the CLI from flags and ``INFERQ_*`` variables."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from runtime.connections import RedisSettings


def default_gateway_id() -> str:
    return secrets.token_hex(6)


@dataclass(frozen=True)
class GatewaySettings:
    redis: RedisSettings = field(default_factory=RedisSettings)
    namespace: str = "inferq"
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 8001
    """Port of the Open Inference Protocol over gRPC, on ``host`` too (Triton's); 0 turns it off."""
    gateway_id: str = field(default_factory=default_gateway_id)
    """Names this process's reply stream; unique per process."""
    max_body_bytes: int = 64 * 1024 * 1024
    """Larger request bodies are refused with 413."""
    max_timeout_ms: int = 300_000
    """Upper bound on any request's deadline, whatever the client asks for."""
    result_ttl_s: int = 60
    """How long a result stays readable when the model's cache is off."""
    registry_refresh_s: float = 1.0
    """How often the gateway re-reads which workers are live and what they serve."""
    reply_block_ms: int = 2000
    heartbeat_s: float = 5.0
    """How often the gateway refreshes its reply stream's TTL."""
    max_backlog: int = 10_000
    """Per model: synchronous requests beyond this many queued get 429 at once."""
    job_ttl_s: int = 86_400
    """How long job records and results are kept (``--job-ttl``)."""
    job_timeout_s: int = 3_600
    """A job's deadline when the request names no ``timeout``."""
    max_job_backlog: int = 100_000
    """Per model: job submissions beyond this many queued requests get 429."""
    max_job_wait_s: float = 60.0
    """Upper bound on ``GET /v2/jobs/{id}?wait=``."""
    stream_gauges_s: float = 5.0
    """How often the stream gauges (length, lag, pending, ...) are refreshed from Redis."""
    admin_token: str | None = None
    """Bearer token of the model-control API (``--admin-token``); unset disables it."""
    admin_load_timeout_s: float = 120.0
    """How long a model load waits for every worker to load and warm the new versions."""
    log_level: str = "info"

"""Gateway settings: one frozen object, built by the CLI from flags and ``INFERQ_*`` variables.

Each user-settable field declares its flag, variable and help here, once (``protocol.options``);
the ``inferq`` parsers and ``inferq up``'s forwarding derive from these declarations.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import ipaddress
import re
import secrets
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from protocol.argtypes import boolean, non_negative_float, port_or_off, positive_float, positive_int
from protocol.jobs import job_id_key
from protocol.options import option
from runtime.settings import DEFAULT_HOST, ConnectionSettings

JOB_DURABILITY = ("async", "replicated")
DEFAULT_GATEWAY_METRICS_PORT = 8100
"""``--gateway-metrics-port`` under ``--gateways N > 1``: gateway i serves its /metrics on
8100 + i. Clear of the gateway's 8000 and 8001, of the workers' 8002 + i, and of 9100-9999, the
range Prometheus' list of default port allocations gives to exporters."""


def default_gateway_id() -> str:
    return secrets.token_hex(6)


HOSTNAME = re.compile(r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.?)+$")
"""A DNS host name (ASCII: IDNA-encoded), as webhook URLs and ``--webhook-allow`` name them."""


def webhook_allow_list(raw: str) -> tuple[str, ...]:
    """``--webhook-allow``: comma-separated host names (exact) and addresses or CIDRs, checked
    here so a typo fails at start, not at the first delivery."""
    entries = tuple(e.strip().lower() for e in raw.split(",") if e.strip())
    for entry in entries:
        try:
            ipaddress.ip_network(entry, strict=False)
        except ValueError:
            if not HOSTNAME.match(entry):
                raise argparse.ArgumentTypeError(
                    f"{entry!r} is neither a host name nor an address or CIDR"
                ) from None
    return entries


def webhook_secret(raw: str) -> str:
    """``INFERQ_WEBHOOK_SECRET``: a Standard Webhooks secret, ``whsec_`` and base64 of 24 to 64
    random bytes (the form the receivers' libraries take). The value is never echoed."""
    body = raw.strip().removeprefix("whsec_")
    try:
        key = base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if not raw.strip().startswith("whsec_") or not 24 <= len(key) <= 64:
        raise argparse.ArgumentTypeError(
            "a webhook secret is 'whsec_' then the base64 of 24 to 64 random bytes; make one "
            'with: python -c "import base64, os; '
            "print('whsec_' + base64.b64encode(os.urandom(32)).decode())\""
        )
    return raw.strip()


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
    metrics_port: int = option(
        0,
        flag="--gateway-metrics-port",
        env="INFERQ_GATEWAY_METRICS_PORT",
        dest="gateway_metrics_port",
        parse=port_or_off,
        # Unset tells apart "off" (0) from "not said": with --gateways N > 1 the supervisor
        # then gives each gateway a port of its own (DEFAULT_GATEWAY_METRICS_PORT + i).
        cli_default=None,
        help="a port of the gateway's own for /metrics, on --host, besides /metrics on --port "
        "(0: none); with --gateways N gateway i (from 0) gets this port + i, so Prometheus "
        "scrapes each process instead of one at random through the shared port (default: "
        f"{DEFAULT_GATEWAY_METRICS_PORT} with --gateways N > 1, else none)",
    )
    gateway_id: str = field(default_factory=default_gateway_id)
    """Names this process's reply stream; unique per process."""
    workers_on_demand: bool = option(
        False,
        flag="--workers-on-demand",
        env="INFERQ_WORKERS_ON_DEMAND",
        kind="switch",
        parse=boolean,
        help="a known model that no live worker serves is still taken: its requests wait (up "
        "to their deadline, then 504) for a worker that a scaler starts on the backlog "
        "(`inferq up --workers 0:N` sets it; KEDA at minReplicaCount 0), instead of 503 at once",
    )
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
        help="bytes of unfinished requests, headers and bodies, the gateway holds at once "
        "(being read, queued, waiting for their answer); beyond it a request gets 429 with "
        "Retry-After, and one larger than all of it 413",
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
    max_batch_lines: int = option(
        50_000,
        flag="--max-batch-lines",
        env="INFERQ_MAX_BATCH_LINES",
        parse=positive_int,
        help="a batch (POST /v2/batches) of more input lines gets 413",
    )
    max_batch_bytes: int = option(
        64 * 1024 * 1024,
        flag="--max-batch-bytes",
        env="INFERQ_MAX_BATCH_BYTES",
        parse=positive_int,
        help="a batch whose body is larger than this many bytes gets 413",
    )
    max_batches_in_flight: int = option(
        16,
        flag="--max-batches-in-flight",
        env="INFERQ_MAX_BATCHES_IN_FLIGHT",
        parse=positive_int,
        help="a new batch while this many are not yet final gets 429",
    )
    batch_ttl_s: int = option(
        7 * 86_400,
        flag="--batch-ttl",
        env="INFERQ_BATCH_TTL",
        parse=positive_int,
        help="seconds a batch, its input and its output are kept after it was created",
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
    stream_gauges_s: float = option(
        5.0,
        flag="--stream-gauges-s",
        env="INFERQ_STREAM_GAUGES_S",
        parse=positive_float,
        help="how often the stream gauges of /metrics (length, lag, pending, live consumers) "
        "are refreshed from Redis",
    )
    """How often the stream gauges (length, lag, pending, ...) are refreshed from Redis."""
    admin_token: str | None = option(
        None,
        flag="--admin-token",
        env="INFERQ_ADMIN_TOKEN",
        secret=True,
        help="bearer token of the model-control API (/v2/repository/...); unset disables it "
        "(prefer the environment variable: flags show in the process list)",
    )
    job_id_key: str | None = option(
        None,
        flag="--job-id-key",
        env="INFERQ_JOB_ID_KEY",
        secret=True,
        help="key of the MAC in job ids, so an id no gateway issued answers 404, never 410 "
        "(Redis lost it); every gateway needs the same one. Unset: derived from the namespace "
        "and the Redis URL's credentials, as secret as they are",
    )
    console_token: str | None = option(
        None,
        flag="--console-token",
        env="INFERQ_CONSOLE_TOKEN",
        secret=True,
        help="read-only bearer token of the operator console (/console); the admin token reads "
        "it too, and only the admin token acts from it",
    )
    webhook_secret: str | None = option(
        None,
        flag="--webhook-secret",
        env="INFERQ_WEBHOOK_SECRET",
        parse=webhook_secret,
        secret=True,
        help="the key webhooks are signed with (Standard Webhooks: whsec_ and base64); unset, "
        "submissions that ask for a webhook get 400. Every gateway needs the same one",
    )
    webhook_allow: tuple[str, ...] = option(
        (),
        flag="--webhook-allow",
        env="INFERQ_WEBHOOK_ALLOW",
        parse=webhook_allow_list,
        render=",".join,
        help="comma-separated hosts, addresses or CIDRs webhooks may go to although they are "
        "loopback, link-local or private (refused by default, against SSRF): e.g. "
        "127.0.0.1 for a receiver on this machine",
    )
    webhook_timeout_s: float = option(
        10.0,
        flag="--webhook-timeout-s",
        env="INFERQ_WEBHOOK_TIMEOUT_S",
        parse=positive_float,
        help="one webhook attempt (connect, send, answer) fails after this long",
    )
    webhook_max_attempts: int = option(
        12,
        flag="--webhook-max-attempts",
        env="INFERQ_WEBHOOK_MAX_ATTEMPTS",
        parse=positive_int,
        help="attempts of a webhook delivery before it goes to the dead-letter stream "
        "(inferq dlq list)",
    )
    webhook_retry_s: float = option(
        1.0,
        flag="--webhook-retry-s",
        env="INFERQ_WEBHOOK_RETRY_S",
        parse=positive_float,
        help="wait before the first retry of a webhook; it doubles each time, up to 300 s",
    )
    webhook_concurrency: int = option(
        32,
        flag="--webhook-concurrency",
        env="INFERQ_WEBHOOK_CONCURRENCY",
        parse=positive_int,
        help="webhook requests one gateway has in flight at once",
    )
    webhook_reclaim_s: float = option(
        30.0,
        flag="--webhook-reclaim-s",
        env="INFERQ_WEBHOOK_RECLAIM_S",
        parse=positive_float,
        help="a webhook a gateway has held this long without renewing it (it died) is taken "
        "over by another gateway",
    )
    sse_heartbeat_s: float = option(
        15.0,
        flag="--sse-heartbeat-s",
        env="INFERQ_SSE_HEARTBEAT_S",
        parse=positive_float,
        help="an event stream (GET /v2/jobs/{id}/events) sends a comment this often, so "
        "proxies keep it open",
    )
    admin_load_timeout_s: float = option(
        120.0,
        flag="--admin-load-timeout-s",
        env="INFERQ_ADMIN_LOAD_TIMEOUT_S",
        parse=non_negative_float,
        help="how long a model load waits for every worker to load and warm the new versions",
    )

    def job_id_mac_key(self) -> bytes:
        """The MAC key of job ids (``protocol.jobs.new_job_id``): ``--job-id-key``, else one
        every gateway of a deployment derives alike from what they share, the namespace and
        the Redis URL's credentials (changing either makes earlier ids' lost records read
        404 rather than 410)."""
        if self.job_id_key:
            return job_id_key(self.job_id_key)
        credentials = [urlsplit(u).password or "" for u in self.redis.url.split(",")]
        return job_id_key("\0".join([self.namespace, *credentials]))

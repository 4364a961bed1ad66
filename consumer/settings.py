"""Worker settings: one frozen object, built by the CLI from flags and ``INFERQ_*`` variables."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from runtime.connections import RedisSettings


def default_worker_id() -> str:
    """Unique per process, readable in ``XINFO CONSUMERS``: host, pid and a random suffix."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class WorkerSettings:
    redis: RedisSettings = field(default_factory=RedisSettings)
    namespace: str = "inferq"
    model_repository: Path = Path("models")
    models: tuple[str, ...] = ()
    """Models to serve; empty serves every model in the repository."""
    max_batch: int | None = None
    """Overrides every model's ``max_batch``."""
    flush_ms: float | None = None
    """Overrides every model's ``flush_ms``."""
    device: str = "cpu"
    worker_id: str = field(default_factory=default_worker_id)
    heartbeat_s: float = 2.0
    worker_ttl_s: float = 10.0
    """A worker whose heartbeat is older than this counts as gone."""
    block_ms: int = 2000
    """How long one blocking read waits before looping (not a latency: reads return at once
    when a request arrives)."""
    metrics_port: int = 0
    """Port of the worker's ``/metrics``; 0 is off (the CLI's default is 9100)."""
    drain_timeout_s: float = 30.0
    claim_idle_ms: int = 30_000
    """An entry pending this long without its worker renewing it is taken over by another."""
    max_deliveries: int = 5
    """An entry delivered more often than this is dead-lettered instead of run again."""
    retire_after_s: float = 30.0
    """After a model version change, how long dropped versions keep answering requests routed
    to them before the switch (then they are unloaded)."""
    log_level: str = "info"

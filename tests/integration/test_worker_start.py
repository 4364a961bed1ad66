"""A worker started before its Redis answers (as under Compose or Kubernetes) waits and retries
with backoff, logging why, instead of exiting; it joins once Redis is up, and a SIGTERM while it
waits stops it cleanly."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from inferq.redisserver import RedisServer, free_port
from protocol.keys import Keys
from tests.support import wait_until
from tests.upstack import UpProcess

# serial: binds a port it freed.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(90), pytest.mark.serial]


def worker_process(redis_url: str, namespace: str, repo: Path) -> UpProcess:
    """A real ``inferq worker``, every line it prints kept (``UpProcess`` reads any inferq)."""
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "inferq", "worker",
            "--redis", redis_url,
            "--namespace", namespace,
            "--model-repository", str(repo),
            "--models", "sim",
            "--metrics-port", "0",
            "--heartbeat-s", "0.5",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    return UpProcess(proc, 0, namespace)


def said(worker: UpProcess, text: str) -> bool:
    return any(text in line for line in worker.lines)


@pytest.fixture
def worker_before_redis(model_repo: Path) -> Iterator[tuple[UpProcess, int, str]]:
    port = free_port()  # nothing listens here yet
    namespace = f"test-{uuid.uuid4().hex[:8]}"
    worker = worker_process(f"redis://127.0.0.1:{port}/0", namespace, model_repo)
    try:
        yield worker, port, namespace
    finally:
        if worker.proc.poll() is None:
            worker.proc.kill()
        worker.stop()


def test_a_worker_started_before_redis_waits_then_joins(worker_before_redis):
    worker, port, namespace = worker_before_redis
    wait_until(lambda: said(worker, "start: ") and said(worker, "retrying"), 30, "a retry line")
    assert worker.proc.poll() is None, "\n".join(worker.lines)  # waiting, not exited
    assert not said(worker, "Traceback")
    with RedisServer(port=port) as server, redis.Redis.from_url(server.url) as r:
        keys = Keys(namespace)
        wait_until(lambda: said(worker, '"worker started"'), 30, "the worker to start")
        assert said(worker, "Redis answers again")
        # Advertised: gateways count it from now on.
        wait_until(lambda: r.zcard(keys.workers) == 1, 10, "the worker's advertisement")
        assert worker.stop() == 0


def test_a_worker_waiting_for_redis_stops_at_once_on_sigterm(worker_before_redis):
    worker, _, _ = worker_before_redis
    wait_until(lambda: said(worker, "retrying"), 30, "a retry line")
    assert worker.stop() == 0
    assert not said(worker, "Traceback")

"""A worker started before its Redis answers (as under Compose or Kubernetes) waits and retries
with backoff, logging why, instead of exiting; it joins once Redis is up, and a SIGTERM while it
waits stops it cleanly."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from inferq.redisserver import RedisServer, free_port
from protocol.keys import Keys
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


class WorkerProcess:
    def __init__(self, redis_url: str, namespace: str, repo: Path) -> None:
        self.proc = subprocess.Popen(
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
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout:
            for line in self.proc.stdout:
                self.lines.append(line)

    def said(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(30)
        self._reader.join(10)
        return code


@pytest.fixture
def worker_before_redis(model_repo: Path) -> Iterator[tuple[WorkerProcess, int, str]]:
    port = free_port()  # nothing listens here yet
    namespace = f"test-{uuid.uuid4().hex[:8]}"
    worker = WorkerProcess(f"redis://127.0.0.1:{port}/0", namespace, model_repo)
    try:
        yield worker, port, namespace
    finally:
        if worker.proc.poll() is None:
            worker.proc.kill()
        worker.stop()


def test_a_worker_started_before_redis_waits_then_joins(worker_before_redis):
    worker, port, namespace = worker_before_redis
    wait_until(lambda: worker.said("start: ") and worker.said("retrying"), 30, "a retry line")
    assert worker.proc.poll() is None, "".join(worker.lines)  # waiting, not exited
    assert not worker.said("Traceback")
    with RedisServer(port=port) as server, redis.Redis.from_url(server.url) as r:
        keys = Keys(namespace)
        wait_until(lambda: worker.said('"worker started"'), 30, "the worker to start")
        assert worker.said("Redis answers again")
        # Advertised: gateways count it from now on.
        wait_until(lambda: r.zcard(keys.workers) == 1, 10, "the worker's advertisement")
        assert worker.stop() == 0


def test_a_worker_waiting_for_redis_stops_at_once_on_sigterm(worker_before_redis):
    worker, _, _ = worker_before_redis
    wait_until(lambda: worker.said("retrying"), 30, "a retry line")
    assert worker.stop() == 0
    assert not worker.said("Traceback")

"""Fixtures of the chaos suite: a repository of simulated models that record every row they run,
real worker processes (so they can be SIGKILLed), and an in-process gateway."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferq.redisserver import free_port
from tests.support import GatewayThread, Stack, WorkerThread, write_simulated_model

MODELS = {
    # name: (base_ms, per_row_ms, max_batch)
    "chaos": (20, 0.1, 16),
    "long": (900, 0, 8),
    "crashy": (10, 0.1, 8),
}


class ChaosRepo:
    """A model repository whose simulated models record their executions under ``runs/``."""

    def __init__(self, root: Path) -> None:
        self.path = root / "models"
        self._runs = root / "runs"
        for name, (base_ms, per_row_ms, max_batch) in MODELS.items():
            self.add(name, base_ms=base_ms, per_row_ms=per_row_ms, max_batch=max_batch)
        config = self.path / "crashy" / "config.toml"
        config.write_text(
            config.read_text().replace("[simulated]\n", "[simulated]\ncrash_value = -1\n")
        )

    def add(self, name: str, *, base_ms: float, per_row_ms: float, max_batch: int) -> None:
        """Another simulated model, recording its executions too."""
        write_simulated_model(
            self.path,
            name,
            base_ms=base_ms,
            per_row_ms=per_row_ms,
            max_batch=max_batch,
            executions_dir=self.runs(name),
        )

    def runs(self, model: str) -> Path:
        """Where ``model`` records the rows it ran (``accounting.read_executions`` reads it)."""
        return self._runs / model


@pytest.fixture
def chaos_repo(tmp_path: Path) -> ChaosRepo:
    return ChaosRepo(tmp_path)


class Workers:
    """Real ``inferq worker`` processes; all are stopped (SIGKILL if need be) at the end."""

    def __init__(self, redis_url: str, namespace: str, repo: Path) -> None:
        self.redis_url, self.namespace, self.repo = redis_url, namespace, repo
        self.procs: list[subprocess.Popen[bytes]] = []
        self.metrics_ports: dict[int, int] = {}
        """pid -> metrics port, for workers started with ``metrics=True``."""

    def start(
        self, model: str, *extra: str, worker_id: str | None = None, metrics: bool = False
    ) -> subprocess.Popen[bytes]:
        port = free_port() if metrics else 0
        named = ("--worker-id", worker_id) if worker_id else ()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "inferq",
                "worker",
                "--redis",
                self.redis_url,
                "--namespace",
                self.namespace,
                "--model-repository",
                str(self.repo),
                "--models",
                model,
                "--log-level",
                "warning",
                "--heartbeat-s",
                "0.5",
                "--metrics-port",
                str(port),
                *named,
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.procs.append(proc)
        if metrics:
            self.metrics_ports[proc.pid] = port
        return proc

    def counter(self, name: str, procs: list[subprocess.Popen[bytes]] | None = None) -> float:
        """A worker metric (e.g. ``inferq_worker_reclaimed_total``) summed over every label set
        and over ``procs`` (default: every running worker started with ``metrics=True``)."""
        chosen = procs if procs is not None else self.procs
        return sum(
            scrape(self.metrics_ports[p.pid], name)
            for p in chosen
            if p.pid in self.metrics_ports and p.poll() is None
        )

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def scrape(port: int, name: str) -> float:
    """The sum of a metric's samples on a Prometheus endpoint (0 when it has none yet)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture
def workers(redis_url: str, namespace: str, chaos_repo: ChaosRepo) -> Iterator[Workers]:
    w = Workers(redis_url, namespace, chaos_repo.path)
    yield w
    w.stop_all()


@pytest.fixture
def gateway(redis_url: str, namespace: str, chaos_repo: ChaosRepo) -> Iterator[Stack]:
    """A gateway in this process (registry refresh every 0.2 s), on the suite's Redis."""
    started: list[GatewayThread | WorkerThread] = []
    s = Stack(redis_url, namespace, chaos_repo.path, started)
    s.start_gateway()
    yield s
    for thing in reversed(started):
        thing.stop()


def live_workers(s: Stack, model: str) -> int:
    """Live workers serving ``model`` as the gateway of ``s`` last saw them."""
    assert s.gateway is not None
    entry = s.gateway.gateway.registry.models.get(model)
    return entry.workers if entry else 0

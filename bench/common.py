"""Shared pieces of the benchmark scripts: a private Redis, `inferq up`, command counting."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import redis

from inferq.redisserver import RedisServer, free_port

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
    }


def command_calls(url: str) -> dict[str, int]:
    """Calls per command from INFO commandstats (cumulative since the server started)."""
    with redis.Redis.from_url(url) as r:
        stats = r.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


def calls_between(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    diff = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return {k: v for k, v in sorted(diff.items(), key=lambda kv: -kv[1]) if v}


class Service:
    """`inferq up` against a private Redis, for one benchmark run."""

    def __init__(self, *extra: str, workers: int = 1) -> None:
        self.redis = RedisServer()
        self.port = free_port()
        self.extra = extra
        self.workers = workers
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Service:
        self.redis.start()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "inferq",
                "up",
                "--redis",
                self.redis.url,
                "--port",
                str(self.port),
                "--workers",
                str(self.workers),
                "--log-level",
                "warning",
                "--model-repository",
                str(ROOT / "models"),
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            cwd=ROOT,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/v2/health/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        self.__exit__()
        raise RuntimeError("inferq up did not become ready")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(60)
        self.redis.stop()


def save(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2))
    return path

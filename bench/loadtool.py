"""Closed-loop HTTP load for bench/peers.py: `wrk` when it is installed, else inferq's loadgen.

wrk (Debian package ``wrk``; ``make bench-peers`` installs it) is a C load generator with an
epoll loop per thread: at these rates it uses a few percent of a core, so it takes less of the
two shared cores from the servers under test than any Python client. One thread, ``c``
keep-alive connections, each sending its next request when the previous one is answered; the
body and headers come from ``bench/wrk_post.lua``, which also prints the figures as JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

LUA = Path(__file__).resolve().parent / "wrk_post.lua"


@dataclass(frozen=True, slots=True)
class Load:
    """What one closed-loop run measured."""

    tool: str
    concurrency: int
    duration_s: float
    requests: int
    """Responses received in the window (any status)."""
    errors: int
    """Non-2xx/3xx responses, socket errors and timeouts."""
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def tool() -> str:
    return "wrk" if shutil.which("wrk") else "loadgen"


def run(
    url: str, body: bytes, headers: dict[str, str], *, concurrency: int, duration_s: float
) -> Load:
    """A closed loop of ``concurrency`` connections POSTing ``body`` to ``url``."""
    if tool() == "wrk":
        return _wrk(url, body, headers, concurrency, duration_s)
    return _loadgen(url, body, headers, concurrency, duration_s)


def _wrk(
    url: str, body: bytes, headers: dict[str, str], concurrency: int, duration_s: float
) -> Load:
    with tempfile.NamedTemporaryFile(prefix="inferq-wrk-", suffix=".body") as f:
        f.write(body)
        f.flush()
        env = {
            **os.environ,
            "WRK_BODY": f.name,
            "WRK_HEADERS": "\n".join(f"{k}: {v}" for k, v in headers.items()),
        }
        seconds = max(1, round(duration_s))
        out = subprocess.run(
            [
                "wrk",
                "-t1",
                f"-c{concurrency}",
                f"-d{seconds}s",
                "--timeout",
                "10s",
                "-s",
                str(LUA),
                url,
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=seconds + 30,
            check=True,
        ).stdout
    line = next(x for x in out.splitlines() if x.startswith("WRK_JSON "))
    d = json.loads(line.removeprefix("WRK_JSON "))
    elapsed = d["duration_us"] / 1e6
    errors = d["connect"] + d["read"] + d["write"] + d["status"] + d["timeout"]
    return Load(
        tool="wrk",
        concurrency=concurrency,
        duration_s=elapsed,
        requests=d["requests"],
        errors=errors,
        rps=d["requests"] / elapsed,
        p50_ms=d["p50_us"] / 1000,
        p90_ms=d["p90_us"] / 1000,
        p99_ms=d["p99_us"] / 1000,
        max_ms=d["max_us"] / 1000,
    )


def _loadgen(
    url: str, body: bytes, headers: dict[str, str], concurrency: int, duration_s: float
) -> Load:
    from bench.common import closed_loop
    from loadgen.http import PreparedRequest

    parts = urlsplit(url)
    r = closed_loop(
        f"{parts.scheme}://{parts.netloc}",
        PreparedRequest("POST", parts.path, body, headers),
        concurrency=concurrency,
        duration_s=duration_s,
        warmup_s=0.0,
    )
    lat = r.latency_ms

    def ms(key: str) -> float:
        return float(lat.get(key) or 0.0)

    return Load(
        tool="loadgen",
        concurrency=concurrency,
        duration_s=r.duration_s,
        requests=r.requests,
        errors=r.requests - r.ok,
        rps=r.throughput_rps,
        p50_ms=ms("p50"),
        p90_ms=ms("p90"),
        p99_ms=ms("p99"),
        max_ms=ms("max"),
    )

"""No secret of ``inferq up`` reaches a place other users or tools read: not its children's
command lines (``ps`` shows them to every user of the host), not the log, not the metrics, not
an error body, not ``inferq models status``.

The secret here is the password of a real ``redis-server --requirepass``, given to ``inferq up``
only in ``INFERQ_REDIS_URL``, as the red team did; the admin token is one too.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from inferq.redisserver import RedisServer, free_port
from tests.support import free_port_pair, sim_body
from tests.upstack import UpProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PASSWORD = f"Pw-{secrets.token_hex(8)}"
TOKEN = f"Tk-{secrets.token_hex(8)}"


def _descendants(pid: int) -> list[int]:
    """Live descendants: an exited child its parent has not reaped yet (a zombie) is left
    out, since it has no command line left to show."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    children = [int(p) for p in path.read_text().split()] if path.exists() else []
    return [
        grand
        for child in children
        if _state(child) not in ("Z", "X", "")
        for grand in (child, *_descendants(child))
    ]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""  # gone meanwhile


def _argv(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""  # exited meanwhile


@pytest.fixture
def protected() -> Iterator[RedisServer]:
    with RedisServer(password=PASSWORD) as server:
        yield server


def _models_status(url: str, namespace: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "inferq", "models", "status", "--namespace", namespace],
        env={**os.environ, "INFERQ_REDIS_URL": url},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.stdout + done.stderr


def test_no_secret_reaches_argv_logs_metrics_error_bodies_or_models_status(
    protected, namespace, model_repo
):
    port, metrics_port, gateway_metrics = free_port(), free_port(), free_port_pair()
    env = {
        **os.environ,
        "INFERQ_REDIS_URL": protected.url,
        "INFERQ_ADMIN_TOKEN": TOKEN,
        "PYTHONUNBUFFERED": "1",
    }
    argv = [
        sys.executable, "-m", "inferq", "up",
        "--namespace", namespace,
        "--port", str(port),
        "--grpc-port", "0",
        "--metrics-port", str(metrics_port),
        "--gateway-metrics-port", str(gateway_metrics),
        "--model-repository", str(model_repo),
        "--models", "sim",
        "--workers", "1",
        "--gateways", "2",
        "--drain-timeout-s", "2",
        "--log-level", "debug",
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    u = UpProcess(proc, port, namespace)
    seen: dict[str, str] = {}
    try:
        u.wait_ready()
        assert f"127.0.0.1:{protected.port}" in protected.url and PASSWORD in protected.url
        pids = _descendants(proc.pid)
        roles = sorted(_argv(pid).split(" -m inferq ")[-1].split(" ")[0] for pid in pids)
        # Two gateways and one worker (Redis is the suite's own).
        assert roles == ["gateway", "gateway", "worker"], [_argv(pid) for pid in pids]
        seen["argv"] = "\n".join(_argv(pid) for pid in [proc.pid, *pids])
        with httpx.Client(base_url=u.url, timeout=30) as c:
            assert c.post("/v2/models/sim/infer", json=sim_body(1)).status_code == 200
            bodies = [
                c.post("/v2/models/nope/infer", json=sim_body(1)),
                c.post("/v2/models/sim/infer", content=b"{not json"),
                c.get("/v2/jobs/not-a-job"),
                c.post("/v2/repository/models/sim/load"),
                c.post("/v2/repository/index", headers={"Authorization": "Bearer wrong"}),
            ]
            assert all(400 <= r.status_code < 500 for r in bodies), [r.status_code for r in bodies]
            ports = [metrics_port, gateway_metrics, gateway_metrics + 1]
            seen["metrics"] = "\n".join(
                [c.get("/metrics").text]
                + [httpx.get(f"http://127.0.0.1:{p}/metrics").text for p in ports]
            )
            # Redis gone: the errors that name it (readiness, a refused request, the log).
            protected.stop()
            ready = c.get("/v2/health/ready")
            assert ready.status_code == 503
            bodies += [ready, c.post("/v2/models/sim/infer", json=sim_body(2))]
            seen["error bodies"] = "\n".join(f"{r.status_code} {r.text}" for r in bodies)
            seen["models status (Redis down)"] = _models_status(protected.url, namespace)
            protected.start()
            u.wait_for(lambda: c.get("/v2/health/ready").status_code == 200, "ready again")
        seen["models status"] = _models_status(protected.url, namespace)
        assert "sim" in seen["models status"]
        assert u.stop() == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        u.join()
    seen["logs"] = "\n".join(u.lines)
    assert "inferq is serving" in seen["logs"]
    for where, text in seen.items():
        assert PASSWORD not in text, f"the Redis password is in the {where}"
        assert TOKEN not in text, f"the admin token is in the {where}"

"""A real Prometheus scrapes a live ``inferq up`` and evaluates the shipped dashboard and alerts.

Debian's ``prometheus`` server (installed by ``make test`` with promtool) runs on a free port with
a temporary storage folder. Its configuration is ``ops/prometheus/prometheus.yml`` rewritten
only where a test must differ: the targets (this gateway's port and the workers' metrics ports
instead of Compose's DNS names), a 1 s scrape and evaluation interval instead of 5 s and 15 s,
and the path of the rule file. The rules are ``ops/prometheus/alerts.yml`` unchanged: their
``for:`` durations (1 to 15 minutes) are what keeps a provoked alert *pending* for the whole
test, and their windows (``[5m]``, ``[10m]``) work on the few seconds of data the test has.

With traffic flowing (a healthy cached model, a model that always fails, a model slower than the
SLO, one undecodable entry), every query of every dashboard panel and every alert expression is
evaluated through the HTTP API and must return series, unless this file lists it as legitimately
empty (and says why). Then the alerts that matter are provoked, each waited for on a condition:
a worker paused (SIGSTOP: Prometheus cannot scrape it, as if it had crashed) sets off
``InferqWorkerDown`` for that worker alone; all workers paused with jobs arriving set off
``InferqLagGrowing`` and ``InferqNoLiveConsumers``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from inferq.redisserver import free_port
from protocol.keys import Keys, Lane
from protocol.messages import FIELD
from tests.ops.queries import ALERTS, OPS, alert_rules, panel_queries
from tests.support import free_port_pair, missing, sim_body, wait_until, write_simulated_model

try:
    import yaml
except ImportError:  # pragma: no cover - pyyaml is part of dev
    missing("PyYAML (pip install -e '.[dev]')", module=True)

# serial: bounds when the alerts go pending.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(180), pytest.mark.serial]

INTERVAL_S = 1
INTERVAL = f"{INTERVAL_S}s"

ALLOWED_EMPTY_PANELS = {
    # Nothing expires while the workers keep up: every request starts before its deadline.
    ("Expired, rejected, dead-lettered, retried, reclaimed", "A"),
    # No worker has died or stalled past --claim-idle-ms (30 s), so nothing was reclaimed or
    # run a second time.
    ("Expired, rejected, dead-lettered, retried, reclaimed", "D"),
    ("Expired, rejected, dead-lettered, retried, reclaimed", "E"),
    # No caller hangs up before its request runs, so workers drop nothing as cancelled.
    ("Expired, rejected, dead-lettered, retried, reclaimed", "G"),
}
"""Dashboard queries (panel title, refId) that may return no series in a healthy run."""

ALLOWED_EMPTY_ALERTS = {
    # Needs a gateway that cannot reach Redis for over a minute; the gauges here refresh every 1 s.
    "InferqStreamGaugesStale",
    # Every loop is healthy here: the test provokes no Redis errors.
    "InferqLoopUnhealthy",
    # The suite's Redis runs with noeviction, as inferq asks.
    "InferqRedisEvicting",
}
"""Alert expressions that may return no series even after the test has provoked the others."""


# -- Prometheus --------------------------------------------------------------------------------


class Prometheus:
    """A prometheus server process and the three calls of its HTTP API the test needs."""

    def __init__(self, folder: Path, config: dict[str, Any]) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            missing("the prometheus server (Debian: apt-get install prometheus)")
        self.port = free_port()
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (folder / "prometheus.log").open("wb")
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={folder / 'prometheus.yml'}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_until(self._ready, 30, "prometheus to start", poll_s=0.1)

    def _ready(self) -> bool:
        assert self.process.poll() is None, "prometheus exited; see prometheus.log"
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        return False

    def _get(self, path: str, **params: Any) -> Any:
        r = httpx.get(f"{self.url}{path}", params=params, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (path, params, body)
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self._get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", expr
        result: list[dict[str, Any]] = data["result"]
        return result

    def label_values(self, label: str, match: str) -> list[str]:
        values: list[str] = self._get(f"/api/v1/label/{label}/values", **{"match[]": match})
        return values

    def alerts(self) -> list[dict[str, Any]]:
        alerts: list[dict[str, Any]] = self._get("/api/v1/alerts")["alerts"]
        return alerts

    def pending(self, alertname: str) -> list[dict[str, str]]:
        """Label sets of the alert's pending instances."""
        return [
            a["labels"]
            for a in self.alerts()
            if a["labels"]["alertname"] == alertname and a["state"] == "pending"
        ]

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)
        self.log.close()


def scrape_config(gateway: str, workers: list[str], rules: Path) -> dict[str, Any]:
    """The shipped prometheus.yml with local targets, short intervals and this rule file."""
    config: dict[str, Any] = yaml.safe_load((OPS / "prometheus" / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = INTERVAL
    config["global"]["evaluation_interval"] = INTERVAL
    config["rule_files"] = [str(rules)]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"inferq-gateway", "inferq-worker"}
    jobs["inferq-gateway"]["static_configs"] = [{"targets": [gateway]}]
    # Compose finds workers by DNS; here they are this machine's ports.
    del jobs["inferq-worker"]["dns_sd_configs"]
    jobs["inferq-worker"]["static_configs"] = [{"targets": workers}]
    return config


# -- what the test queries ---------------------------------------------------------------------


def empty(prometheus: Prometheus, queries: dict[Any, str]) -> set[Any]:
    return {key for key, expr in queries.items() if not prometheus.query(expr)}


# -- the system under test ---------------------------------------------------------------------


def children(pid: int) -> dict[int, list[str]]:
    """The argv of each child process of ``pid``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                argv = (entry / "cmdline").read_bytes().decode().split("\0")
                found[int(entry.name)] = argv
    return found


class Traffic:
    """Background clients, each sending one request after another until stopped, paced so the
    2-core machine keeps room for the processes under test."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stop = threading.Event()
        self.statuses: dict[str, dict[int, int]] = {}
        self._threads: list[threading.Thread] = []

    def loop(self, model: str, body: Callable[[int], dict[str, Any]], pause_s: float) -> None:
        counts = self.statuses.setdefault(model, {})

        def run() -> None:
            with httpx.Client(base_url=self.url, timeout=10) as client:
                i = 0
                while not self.stop.is_set():
                    with contextlib.suppress(httpx.HTTPError):
                        status = client.post(f"/v2/models/{model}/infer", json=body(i)).status_code
                        counts[status] = counts.get(status, 0) + 1
                    i += 1
                    self.stop.wait(pause_s)  # pacing a load generator, not waiting for a result

        thread = threading.Thread(target=run, name=f"traffic-{model}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def close(self) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(15)


DEADLINE_US = 2_000_000
"""Each request's V2 timeout: with the workers paused, a request gives up after 2 s."""


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    models = tmp_path / "models"
    write_simulated_model(models, "sim", base_ms=1, per_row_ms=0, max_batch=32, cache=True)
    write_simulated_model(models, "broken", base_ms=0, per_row_ms=0, max_batch=1, failure_rate=1)
    write_simulated_model(models, "slow", base_ms=700, per_row_ms=0, max_batch=64)
    return models


FAST = {
    "INFERQ_STREAM_GAUGES_S": str(INTERVAL_S),
    "INFERQ_HEARTBEAT_S": "1",
    "INFERQ_WORKER_TTL_S": "3",
}
"""Gateway and worker intervals of the stack, shorter than the defaults (5 s, 2 s, 10 s) so
that the alerts' conditions hold sooner; the conditions themselves are the shipped ones."""


@contextlib.contextmanager
def inferq_up(
    repo: Path, redis_url: str, namespace: str, port: int, metrics_base: int
) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "inferq", "up",
            "--redis", redis_url,
            "--namespace", namespace,
            "--port", str(port),
            "--grpc-port", "0",
            "--workers", "2",
            "--model-repository", str(repo),
            "--log-level", "warning",
        ],
        # The worker metrics ports are inferq up's default (base + i); only the base moves
        # off the default, which another run on this machine may hold. The gauges refresh
        # at the scrape interval, and a paused worker counts as gone after 3 s, not 10 s.
        env={**os.environ, "INFERQ_METRICS_PORT": str(metrics_base), **FAST},
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield proc
    finally:
        for pid in children(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


def test_a_real_prometheus_evaluates_every_panel_and_alert_and_the_alerts_that_matter_go_pending(
    tmp_path, repo, redis_url, namespace
):
    port, metrics_base = free_port(), free_port_pair()
    workers = [f"127.0.0.1:{metrics_base}", f"127.0.0.1:{metrics_base + 1}"]
    config = scrape_config(f"127.0.0.1:{port}", workers, tmp_path / "alerts.yml")
    shutil.copy(ALERTS, tmp_path / "alerts.yml")
    prometheus = Prometheus(tmp_path, config)
    traffic = Traffic(f"http://127.0.0.1:{port}")
    try:
        with inferq_up(repo, redis_url, namespace, port, metrics_base) as up:
            wait_until(
                lambda: len(prometheus.query("up == 1")) == 3,
                60,
                "Prometheus to scrape the gateway and both workers",
                poll_s=0.25,
            )
            worker_pids = {
                int(argv[argv.index("--metrics-port") + 1]): pid
                for pid, argv in children(up.pid).items()
                if "worker" in argv
            }
            assert sorted(worker_pids) == [metrics_base, metrics_base + 1]

            # -- healthy traffic, a failing model, a slow model, one dead letter ----------
            timeout = {"timeout": DEADLINE_US}

            def hit_or_miss(i: int) -> dict[str, Any]:  # a repeated input, then a new one
                return sim_body(0.0 if i % 2 else float(i), **timeout)

            traffic.loop("sim", hit_or_miss, 0.02)
            traffic.loop("broken", lambda i: sim_body(i, **timeout), 0.1)
            for _ in range(2):
                traffic.loop("slow", lambda i: sim_body(i, **timeout), 0.05)
            with redis.Redis.from_url(redis_url) as r:
                r.xadd(Keys(namespace).stream("sim", Lane.NORMAL), {FIELD: b"not a request"})

            panels = panel_queries(INTERVAL_S)
            assert len(panels) > 30
            unanswered: set[tuple[str, str]] = set()

            def every_panel_answers() -> bool:
                nonlocal unanswered
                unanswered = empty(prometheus, panels) - ALLOWED_EMPTY_PANELS
                return not unanswered

            try:
                wait_until(every_panel_answers, 60, "dashboard queries", poll_s=0.5)
            except AssertionError:
                raise AssertionError(f"dashboard queries with no series: {unanswered}") from None
            models = set(prometheus.label_values("model", "inferq_stream_lag"))
            assert models >= {"sim", "broken", "slow"}  # the dashboard's $model choices
            for alert, model in [
                ("InferqErrorRatioHigh", "broken"),
                ("InferqLatencyP99AboveSLO", "slow"),
                ("InferqDeadLetters", "sim"),
            ]:
                wait_until(
                    lambda a=alert, m=model: m in {x["model"] for x in prometheus.pending(a)},
                    30,
                    f"{alert} pending for {model}",
                    poll_s=0.5,
                )
            assert {x["model"] for x in prometheus.pending("InferqErrorRatioHigh")} == {"broken"}
            report("healthy traffic, a failing model, a slow model, one dead letter", prometheus)

            # -- a worker gone --------------------------------------------------------------
            os.kill(worker_pids[metrics_base], signal.SIGSTOP)
            wait_until(
                lambda: prometheus.pending("InferqWorkerDown"),
                30,
                "InferqWorkerDown pending",
                poll_s=0.5,
            )
            (down,) = prometheus.pending("InferqWorkerDown")
            assert down["instance"] == workers[0] and down["job"] == "inferq-worker"
            report("worker 0 stopped answering (SIGSTOP)", prometheus)

            # -- all workers paused while work arrives ------------------------------------
            os.kill(worker_pids[metrics_base + 1], signal.SIGSTOP)
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
                for i in range(100):
                    r = client.post("/v2/models/sim/jobs", json=sim_body(1000 + i))
                    assert r.status_code == 202
            for alert in ("InferqLagGrowing", "InferqNoLiveConsumers"):
                wait_until(
                    lambda a=alert: "sim" in {x["model"] for x in prometheus.pending(a)},
                    45,
                    f"{alert} pending for sim",
                    poll_s=0.5,
                )
            assert empty(prometheus, alert_rules()) <= ALLOWED_EMPTY_ALERTS
            assert {x["instance"] for x in prometheus.pending("InferqWorkerDown")} == set(workers)
            report("both workers paused, 100 jobs queued", prometheus)
    finally:
        traffic.close()
        prometheus.stop()
    # The traffic really was what the phases needed: successes, failures, slow successes.
    assert traffic.statuses["sim"].get(200, 0) > 50
    assert traffic.statuses["broken"].get(500, 0) >= 1
    assert traffic.statuses["slow"].get(200, 0) > 2


def report(phase: str, prometheus: Prometheus) -> None:
    """The alert states at the end of a phase (run with -s to see them; README: Monitoring)."""
    print(f"\n# {phase}")
    for alert in sorted(prometheus.alerts(), key=lambda a: sorted(a["labels"].items())):
        labels = {k: v for k, v in alert["labels"].items() if k not in ("alertname", "severity")}
        shown = ", ".join(f"{k}={v}" for k, v in sorted(labels.items()))
        print(f"{alert['labels']['alertname']:26} {alert['state']:8} {shown}")

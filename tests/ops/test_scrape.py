"""Every metric the Grafana dashboard and the alert rules use appears in a real scrape of a
running gateway (``GET /metrics``) and worker (``--metrics-port``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inferq.redisserver import free_port
from tests.support import sim_body, wait_until

pytestmark = [pytest.mark.integration]

OPS = Path(__file__).resolve().parents[2] / "ops"
METRIC = re.compile(r"\binferq_[a-z0-9_]*[a-z0-9]\b")
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "info": ("_info",),
}


def used_metric_names() -> set[str]:
    board = json.loads((OPS / "grafana" / "dashboards" / "inferq.json").read_text())
    queries = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    queries += [v["query"]["query"] for v in board["templating"]["list"]]
    alerts = "\n".join(
        line
        for line in (OPS / "prometheus" / "alerts.yml").read_text().splitlines()
        if not line.lstrip().startswith("#")
    )
    return {name for text in (*queries, alerts) for name in METRIC.findall(text)}


def scraped_names(text: str) -> set[str]:
    """Sample names the scrape exposes or declares (a # TYPE line with no sample yet counts)."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
        names.update(s.name for s in family.samples)
    return names


def test_every_dashboard_and_alert_metric_is_in_a_scrape_of_a_gateway_and_a_worker(stack):
    s = stack(workers=0)
    metrics_port = free_port()
    s.add_worker(("sim",), metrics_port=metrics_port)
    with s.client() as client:
        wait_until(
            lambda: client.get("/v2/models/sim/ready").status_code == 200,
            what="the gateway to see the worker",
        )
    assert s.infer("sim", sim_body(1.0)).status_code == 200
    assert s.infer("no-such-model", sim_body(1.0)).status_code == 404

    def gateway_scrape() -> str:
        return httpx.get(f"{s.url}/metrics", timeout=10).text

    # The stream gauges refresh on a schedule: wait for one that has seen the model.
    def gauges_include_sim() -> bool:
        return any(
            sample.labels == {"model": "sim", "lane": "normal"}
            for family in text_string_to_metric_families(gateway_scrape())
            if family.name == "inferq_stream_lag"
            for sample in family.samples
        )

    wait_until(
        gauges_include_sim,
        timeout_s=20,
        what="the gateway's stream gauges to include the sim model",
    )
    worker = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    scraped = scraped_names(gateway_scrape()) | scraped_names(worker)

    used = used_metric_names()
    assert len(used) > 15
    assert used - scraped == set()
    assert "inferq_worker_rows_total" in scraped_names(worker)
    assert "inferq_gateway_requests_total" in scraped_names(gateway_scrape())


def _bindable(host: str, port: int) -> bool:
    import socket

    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
        return True


@pytest.mark.parametrize(("host", "other_loopback_free"), [("127.0.0.1", True), ("0.0.0.0", False)])
def test_a_workers_metrics_listen_on_its_metrics_host_only(stack, host, other_loopback_free):
    # 127.0.0.2 is loopback too, but another address: a listener on 127.0.0.1 leaves it free,
    # one on every interface (0.0.0.0, as in a container) holds it as well.
    s = stack(workers=0)
    port = free_port()
    s.add_worker(("sim",), metrics_port=port, metrics_host=host)
    assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).status_code == 200
    assert _bindable("127.0.0.2", port) is other_loopback_free

"""The PromQL that ops/ ships, for the tests that evaluate it on a real Prometheus: every panel
query of the Grafana dashboard (with Grafana's variables substituted) and every alert rule."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

OPS = Path(__file__).resolve().parents[2] / "ops"
DASHBOARD = OPS / "grafana" / "dashboards" / "inferq.json"
ALERTS = OPS / "prometheus" / "alerts.yml"

ALL_MODELS = ".*"
"""What ``$model`` is with "All" selected (the variable's ``allValue``)."""


def rate_interval(scrape_interval_s: float) -> str:
    """What Grafana's ``$__rate_interval`` is at this scrape interval: four of them (at least,
    for the short ranges a dashboard shows)."""
    return f"{4 * scrape_interval_s:g}s"


def panel_queries(scrape_interval_s: float) -> dict[tuple[str, str], str]:
    """Every panel query of the dashboard, by (panel title, refId), with Grafana's variables
    substituted."""
    board = json.loads(DASHBOARD.read_text())
    return {
        (panel["title"], target["refId"]): target["expr"]
        .replace("$__rate_interval", rate_interval(scrape_interval_s))
        .replace("$model", ALL_MODELS)
        for panel in board["panels"]
        for target in panel.get("targets", [])
    }


def alert_rules() -> dict[str, str]:
    """Every alert's expression, by alert name."""
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return {rule["alert"]: rule["expr"] for group in groups for rule in group["rules"]}

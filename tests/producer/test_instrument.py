"""Request metrics are labelled by the route Starlette matched, as the route table names it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.testclient import TestClient

from producer import console
from producer.app import routes
from producer.instrument import Instrument, RequestMetrics
from producer.metrics import ENDPOINTS


class Recorded:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def observe_request(
        self, model: Any, version: Any, endpoint: str, status: int, seconds: float, **_: Any
    ) -> None:
        self.calls.append((endpoint, model, version, status))


@pytest.fixture
def client_and_calls() -> Any:
    table = routes()
    metadata = SimpleNamespace(versions=("1", "2"), default_version="1")
    gateway = SimpleNamespace(
        registry=SimpleNamespace(models={"digits": SimpleNamespace(metadata=metadata)}),
        metrics=Recorded(),
    )
    instrument = Instrument(gateway, None)  # type: ignore[arg-type]
    app = Starlette(
        routes=table, middleware=[Middleware(RequestMetrics, instrument=instrument, routes=table)]
    )
    with TestClient(app) as client:
        yield client, gateway.metrics.calls


@pytest.mark.parametrize(
    ("method", "path", "label"),
    [
        ("GET", "/v2/health/live", ("health_live", None, None, 200)),
        # A wrong method still names the route the path matched, with its model and version.
        ("GET", "/v2/models/digits/infer", ("infer", "digits", "1", 405)),
        ("GET", "/v2/models/digits/versions/2/jobs", ("job_submit", "digits", "2", 405)),
        ("DELETE", "/v2/models/digits", ("model_metadata", "digits", "1", 405)),
        ("POST", "/v2/jobs/abc", ("job_status", None, None, 405)),
        ("PUT", "/v2/jobs/abc", ("job_status", None, None, 405)),
        # A model nobody serves is never a label value; nor is a version the model lacks.
        ("GET", "/v2/models/made-up/infer", ("infer", None, None, 405)),
        ("POST", "/v2/models/digits/versions/9/ready", ("model_ready", "digits", None, 405)),
        # Routes outside the endpoint label set, and paths no route matches, are "other".
        ("GET", "/v2/repository/models/digits/load", ("other", None, None, 405)),
        ("GET", "/v2/nothing/here", ("other", None, None, 404)),
        ("GET", "/v2/models/digits/", ("other", None, None, 307)),  # Starlette's slash redirect
    ],
)
def test_each_request_is_labelled_by_its_route(client_and_calls, method, path, label) -> None:
    client, calls = client_and_calls
    response = client.request(method, path, follow_redirects=False)
    assert response.status_code == label[3]
    assert calls == [label]


def test_every_named_route_is_a_known_endpoint_label_or_other() -> None:
    names = {r.name for r in routes()}
    assert set(ENDPOINTS) <= names
    # Labelled "other": model control, introspection, the Swagger UI page and its assets, and
    # the operator console.
    assert names - set(ENDPOINTS) == {
        *(r.name for r in console.routes()),
        "repository_index",
        "repository_load",
        "repository_reset",
        "repository_unload",
        "model_config",
        "model_stats",
        "docs",
        "docs_asset",
    }

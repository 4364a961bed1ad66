"""The infer route is served by the fast path alone, under a root path too, and counted in
the request metrics under the route table's ``infer`` endpoint; every other method and path is
left to Starlette."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, cast

import httpx
import pytest
import uvicorn

from inferq.redisserver import free_port
from producer.app import routes
from producer.fastpath import InferFastPath, route_path
from producer.server import server_config
from tests.support import GatewayThread, Stack

pytestmark = pytest.mark.integration

ROOT = "/api"
ROW = [0.5] * 64


def _json(inputs: list[dict[str, object]] | None = None) -> bytes:
    tensor = {"name": "input", "datatype": "FP32", "shape": [1, 64], "data": ROW}
    return json.dumps({"inputs": inputs if inputs is not None else [tensor]}).encode()


@pytest.fixture
def two_ways(stack) -> Iterator[tuple[Stack, GatewayThread]]:
    """A stack's gateway, and a second gateway on the same Redis under a root path (as behind
    a proxy that strips it)."""
    s = stack(models=("digits",))
    settings = replace(s.gateway.settings, port=free_port(), gateway_id="under-a-root-path")
    routed = GatewayThread(settings)
    config = server_config(routed.app, replace(settings, host="127.0.0.1"))
    config.root_path = ROOT
    routed.server = uvicorn.Server(config)
    routed.start()
    s.wait_ready("digits")
    try:
        yield s, routed
    finally:
        routed.stop()


def test_under_a_root_path_the_fast_path_answers_and_refuses_alike(two_ways):
    s, routed = two_ways
    with s.client() as plain, httpx.Client(base_url=routed.url, timeout=30) as rooted:
        for path, body, status in [
            ("/v2/models/digits/infer", _json(), 200),
            ("/v2/models/digits/versions/1/infer", _json(), 200),
            ("/v2/models/nope/infer", _json(), 404),
            ("/v2/models/digits/infer", b"{nope", 400),
        ]:
            a, b = plain.post(path, content=body), rooted.post(path, content=body)
            assert a.status_code == b.status_code == status, path
            if status != 200:
                assert a.content == b.content
            else:
                assert a.json()["outputs"] == b.json()["outputs"]


def test_both_ways_count_the_request_under_the_infer_endpoint(two_ways):
    s, routed = two_ways
    with s.client() as fast_client, httpx.Client(base_url=routed.url, timeout=30) as routed_client:
        for client in (fast_client, routed_client):
            assert client.post("/v2/models/digits/infer", content=_json()).status_code == 200
            assert client.post("/v2/models/nope/infer", content=_json()).status_code == 404
            metrics = client.get("/metrics").text
            for status, model in (("200", "digits"), ("404", "")):
                line = next(
                    line
                    for line in metrics.splitlines()
                    if line.startswith("inferq_gateway_requests_total{")
                    and 'endpoint="infer"' in line
                    and f'status="{status}"' in line
                )
                assert f'model="{model}"' in line and line.endswith(" 1.0"), line


def test_other_methods_and_paths_are_left_to_starlette(two_ways):
    s, _ = two_ways
    with s.client() as c:
        wrong_method = c.get("/v2/models/digits/infer")
        assert wrong_method.status_code == 405
        assert "method GET is not allowed" in wrong_method.json()["error"]
        assert c.post("/v2/models/digits/infer/more", content=_json()).status_code == 404


def scope(path: str, method: str = "POST", root: str = "") -> dict[str, object]:
    return {"type": "http", "method": method, "path": path, "root_path": root}


def test_the_fast_path_recognises_exactly_the_infer_routes_of_the_table():
    fast = InferFastPath(cast(Any, None), cast(Any, None), routes())  # matching needs no gateway

    assert fast.match(scope("/v2/models/m/infer")) == ("m", None)
    assert fast.match(scope("/v2/models/m/versions/3/infer")) == ("m", "3")
    assert fast.match(scope("/api/v2/models/m/infer", root="/api")) == ("m", None)
    assert fast.match(scope("/v2/models/m/infer", "GET")) is None
    assert fast.match(scope("/v2/models/m/jobs")) is None
    assert fast.match(scope("/v2/models/a/b/infer")) is None
    assert fast.match(scope("/v2/models//infer")) is None
    assert fast.match({**scope("/v2/models/m/infer"), "type": "websocket"}) is None


@pytest.mark.parametrize(
    ("path", "root", "route"),
    [
        ("/api/v2", "/api", "/v2"),
        ("/api", "/api", ""),
        ("/apiv2", "/api", "/apiv2"),  # not under the root path: left as it is
        ("/v2", "/api", "/v2"),
        ("/v2", "", "/v2"),
    ],
)
def test_the_root_path_is_stripped_as_starlette_strips_it(path, root, route):
    from starlette._utils import get_route_path  # private: this test pins the two together

    assert route_path(scope(path, root=root)) == route == get_route_path(scope(path, root=root))

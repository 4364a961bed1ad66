"""The inference fast path answers exactly as the Starlette route it bypasses: the same
statuses, bodies and headers for answers and for every kind of refusal, counted in the same
request metrics. The Starlette route is what serves an infer request under a root path."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, cast

import httpx
import numpy as np
import pytest
import uvicorn

from inferq.redisserver import free_port
from producer.fastpath import INFER_PATH, InferFastPath
from producer.server import server_config
from tests.support import GatewayThread, Stack, binary_body

pytestmark = pytest.mark.integration

ROOT = "/api"
ROW = [0.5] * 64


def _json(inputs: list[dict[str, object]] | None = None) -> bytes:
    tensor = {"name": "input", "datatype": "FP32", "shape": [1, 64], "data": ROW}
    return json.dumps({"inputs": inputs if inputs is not None else [tensor]}).encode()


def _binary() -> tuple[bytes, dict[str, str]]:
    return binary_body("input", np.full((1, 64), 0.5), binary_data_output=True)


CASES: list[tuple[str, str, bytes, dict[str, str]]] = [
    ("answer", "/v2/models/digits/infer", _json(), {"content-type": "application/json"}),
    ("versioned answer", "/v2/models/digits/versions/1/infer", _json(), {}),
    ("binary answer", "/v2/models/digits/infer", *_binary()),
    ("bad JSON", "/v2/models/digits/infer", b"{nope", {}),
    ("unknown model", "/v2/models/nope/infer", _json(), {}),
    ("unknown version", "/v2/models/digits/versions/9/infer", _json(), {}),
    ("wrong input", "/v2/models/digits/infer", _json([{"name": "x"}]), {}),
    ("media type", "/v2/models/digits/infer", _json(), {"content-type": "text/plain"}),
    ("unknown encoding", "/v2/models/digits/infer", _json(), {"content-encoding": "br"}),
]
COMPARED_HEADERS = (
    "content-type",
    "inference-header-content-length",
    "retry-after",
)


@pytest.fixture
def two_ways(stack) -> Iterator[tuple[Stack, GatewayThread]]:
    """A stack whose gateway takes the fast path, and a second gateway on the same Redis under
    a root path (as behind a proxy that strips it), where every infer request goes through
    Starlette."""
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


@pytest.mark.parametrize(("case", "path", "body", "headers"), CASES, ids=[c[0] for c in CASES])
def test_the_fast_path_and_the_starlette_route_answer_alike(two_ways, case, path, body, headers):
    s, routed = two_ways
    with s.client() as fast_client, httpx.Client(base_url=routed.url, timeout=30) as routed_client:
        fast = fast_client.post(path, content=body, headers=headers)
        slow = routed_client.post(path, content=body, headers=headers)
    assert fast.status_code == slow.status_code
    assert fast.status_code != 500
    assert fast.content == slow.content, case
    for name in COMPARED_HEADERS:
        assert fast.headers.get(name) == slow.headers.get(name), name
    assert fast.headers["content-length"] == str(len(fast.content))
    if fast.status_code == 200:  # the second asker gets the first one's cached answer
        assert (fast.headers["x-inferq-cache"], slow.headers["x-inferq-cache"]) == ("miss", "hit")


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


def test_the_fast_path_recognises_exactly_the_two_infer_paths():
    fast = InferFastPath(cast(Any, None), None)  # matching needs neither gateway nor tracer

    def scope(path: str, method: str = "POST", root: str = "") -> dict[str, object]:
        return {"type": "http", "method": method, "path": path, "root_path": root}

    assert fast.match(scope("/v2/models/m/infer")) == ("m", None)
    assert fast.match(scope("/v2/models/m/versions/3/infer")) == ("m", "3")
    assert fast.match(scope("/v2/models/m/infer", "GET")) is None
    assert fast.match(scope("/v2/models/m/jobs")) is None
    assert fast.match(scope("/v2/models/a/b/infer")) is None
    assert fast.match(scope("/api/v2/models/m/infer", root="/api")) is None
    assert INFER_PATH.fullmatch("/v2/models//infer") is None

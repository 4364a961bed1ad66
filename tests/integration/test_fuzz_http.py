"""Bad input everywhere: requests generated from the gateway's own OpenAPI document, with the
model path parameter pinned to served models so generation reaches the validation layer. No
input may produce a 5xx or hang."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from inferq.redisserver import RedisServer
from producer.app import routes
from producer.openapi import document
from tests.support import Stack

MODELS = ["digits", "sim"]


@pytest.fixture(scope="module")
def fuzz_stack(redis_server: RedisServer, model_repo: Path):
    started: list = []
    s = Stack(redis_server.url, "fuzz", model_repo, started)
    s.add_worker(tuple(MODELS))
    # Short long-polls and deadlines, so nothing generated can hold a test for long.
    s.start_gateway(max_job_wait_s=0.2, max_timeout_ms=2_000, max_body_bytes=256 * 1024)
    yield s
    for thing in reversed(started):
        thing.stop()


def pinned_document() -> dict:
    doc = copy.deepcopy(document(routes()))
    for item in doc["paths"].values():
        for param in item.get("parameters", []):
            if param["name"] == "model":
                param["schema"] = {"type": "string", "enum": MODELS}
            if param["name"] == "version":
                param["schema"] = {"type": "string", "enum": ["1", "2"]}
    return doc


schema = schemathesis.openapi.from_dict(pinned_document())


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_generated_request_gets_a_5xx_or_hangs(case, fuzz_stack):
    response = case.call(base_url=fuzz_stack.url, timeout=10)
    assert response.status_code < 500, (case.path, case.body, response.text)
    if response.status_code >= 400:
        assert response.json()["error"]  # a V2 error body with a message

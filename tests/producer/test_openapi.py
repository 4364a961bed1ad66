"""/openapi.json is derived from the route table: every documented route once, nothing else."""

from __future__ import annotations

import json
import re
from typing import Any

import schemathesis
from starlette.routing import Route

from producer import console
from producer.app import routes
from producer.openapi import SCHEMAS, ApiRoute, Operation, Reply, document


def operations(doc: dict[str, Any]) -> set[tuple[str, str]]:
    methods = {"get", "post", "delete", "put", "patch"}
    return {(m.upper(), p) for p, item in doc["paths"].items() for m in item if m in methods}


def test_every_documented_route_is_one_operation_and_nothing_else_is() -> None:
    table = routes()
    doc = document(table)
    routed = {
        (m, r.path)
        for r in table
        if isinstance(r, ApiRoute)
        for m in r.methods or ()
        if m != "HEAD"
    }
    assert operations(doc) == routed
    # 16, config (2), stats (3), GET index and reset (issue #23), job and batch events (#24),
    # batches: create, list, get, delete, cancel, output, errors (#24)
    assert len(routed) == 32
    undocumented = {r.path for r in table if isinstance(r, Route) and not isinstance(r, ApiRoute)}
    # The operator console's page and views: a page and its own reads, described in
    # docs/console.md, not part of the inference API.
    page = {r.path for r in console.routes()}
    assert undocumented == {"/openapi.json", "/metrics", "/docs", "/docs/{asset}", *page}
    assert not undocumented & set(doc["paths"])


def test_path_parameters_come_from_the_route_path() -> None:
    doc = document(routes())
    for path, item in doc["paths"].items():
        declared = [p["name"] for p in item.get("parameters", [])]
        assert declared == re.findall(r"{(\w+)}", path), path
        assert all(p["in"] == "path" and p["required"] for p in item.get("parameters", []))


def test_every_reference_resolves_and_every_error_has_the_error_body() -> None:
    table = routes()
    doc = document(table)
    for name in re.findall(r'"#/components/schemas/(\w+)"', json.dumps(doc)):
        assert name in doc["components"]["schemas"]
    for route in table:
        if isinstance(route, ApiRoute):
            for method in route.methods - {"HEAD"}:
                answers = doc["paths"][route.path][method.lower()]["responses"]
                for status in route.operation.errors:
                    content = answers[str(status)]["content"]["application/json"]
                    assert content["schema"] == {"$ref": "#/components/schemas/Error"}


def test_admin_routes_need_the_token_and_inference_takes_a_v2_body() -> None:
    doc = document(routes())
    for path in ("/v2/repository/index", "/v2/repository/models/{model}/load"):
        assert doc["paths"][path]["post"]["security"] == [{"adminToken": []}]
    infer = doc["paths"]["/v2/models/{model}/versions/{version}/infer"]["post"]
    body = infer["requestBody"]
    assert body["required"]
    assert body["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/InferRequest"
    }
    assert set(infer["responses"]) == {
        "200",
        "400",
        "404",
        "408",
        "413",
        "415",
        "429",
        "500",
        "503",
        "504",
    }
    headers = doc["paths"]["/v2/models/{model}/jobs"]["post"]["parameters"]
    assert [(h["name"], h["in"], h["required"]) for h in headers] == [
        ("Idempotency-Key", "header", False),
        ("Inferq-Webhook", "header", False),
        ("Inferq-Webhook-Events", "header", False),
    ]


def test_the_document_loads_as_openapi_and_is_not_shared_between_calls() -> None:
    doc = document(routes())
    assert len(list(schemathesis.openapi.from_dict(doc).get_all_operations())) == 32
    doc["components"]["schemas"]["Error"]["properties"].clear()
    assert SCHEMAS["Error"]["properties"] == {"error": {"type": "string"}}


def test_a_new_route_documents_itself() -> None:
    async def endpoint(request: Any) -> Any:
        raise NotImplementedError

    op = Operation("Echo", {200: Reply("the same", {"type": "object"})}, errors=(400,))
    doc = document([ApiRoute("/v2/echo/{word}", endpoint, op, name="echo", methods=["PUT"])])
    item = doc["paths"]["/v2/echo/{word}"]
    assert item["parameters"][0]["name"] == "word"
    assert item["put"]["summary"] == "Echo" and set(item["put"]["responses"]) == {"200", "400"}

"""GET /docs: Swagger UI over /openapi.json, everything it loads served by the gateway itself."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from urllib.parse import urljoin

import httpx
import pytest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.testclient import TestClient
from swagger_ui_bundle import swagger_ui_path

from producer import docs
from producer.app import gateway_error, http_error, routes
from producer.errors import GatewayError
from producer.openapi import document
from tests.support import missing


@pytest.fixture
def client() -> Iterator[TestClient]:
    table = routes()
    app = Starlette(
        routes=table, exception_handlers={GatewayError: gateway_error, HTTPException: http_error}
    )
    app.state.openapi = document(table)
    with TestClient(app) as c:
        yield c


def loaded(html: str) -> list[str]:
    """Every URL the page makes the browser load, its script's spec included."""
    urls = re.findall(r'(?:src|href)="([^"]+)"', html)
    urls += re.findall(r'url: "([^"]+)"', html)
    return urls


def test_docs_is_swagger_ui_over_the_gateways_own_openapi_document(client):
    r = client.get("/docs")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert "SwaggerUIBundle(" in r.text
    urls = loaded(r.text)
    assert "openapi.json" in urls
    # Nothing from elsewhere (no CDN): every URL is relative, so the page works offline and
    # behind a proxy that mounts the gateway under a prefix.
    assert all(not re.match(r"^(\w+:)?//", url) and not url.startswith("/") for url in urls)
    for url in urls:
        answer = client.get(urljoin("http://testserver/docs", url))
        assert answer.status_code == 200, url
    spec = client.get(urljoin("http://testserver/docs", "openapi.json")).json()
    assert "/v2/models/{model}/infer" in spec["paths"]


def test_docs_assets_are_the_packaged_swagger_ui_files_with_their_types(client):
    for name, media_type in docs.ASSETS.items():
        r = client.get(f"/docs/{name}")
        assert r.status_code == 200
        assert r.headers["content-type"].split(";")[0] == media_type
        assert r.content == (swagger_ui_path / name).read_bytes()


@pytest.mark.parametrize(
    "path", ["/docs/index.j2", "/docs/nope.js", "/docs/..%2F__init__.py", "/docs/%2e%2e%2fx"]
)
def test_only_the_listed_assets_are_served(client, path):
    r = client.get(path)
    assert r.status_code == 404
    assert r.json()["error"]


CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.mark.integration
def test_a_real_browser_renders_every_operation_from_the_gateways_own_files(stack, tmp_path):
    chromium = shutil.which("chromium")
    if chromium is None:
        missing("chromium (Debian: apt-get install chromium)")
    s = stack(workers=0)  # /docs needs no worker
    done = subprocess.run(
        [
            chromium,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=15000",  # until the page's scripts have run
            "--dump-dom",
            f"{s.url}/docs",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rendered = {
        (method.upper(), path)
        for method, path in re.findall(
            r'opblock opblock-(\w+).*?opblock-summary-path" data-path="([^"]+)"',
            done.stdout,
            flags=re.S,
        )
    }
    spec = httpx.get(f"{s.url}/openapi.json", timeout=10).json()
    operations = {
        (method.upper(), path)
        for path, item in spec["paths"].items()
        for method in item
        if method in ("get", "post", "delete")
    }
    assert rendered == operations

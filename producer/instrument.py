"""ASGI middleware that counts and times every HTTP request, errors included.

Exception handlers turn errors into responses below this layer, so one place sees every status.
Model and version labels are set only for models the registry knows: a label never carries a
name a client made up (which would let anyone grow the metric's series without bound).
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from producer.routing import ROUTED_VERSION

if TYPE_CHECKING:
    from producer.gateway import Gateway
    from producer.registry import ModelRegistry

_MODEL_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?(/ready|/infer|/jobs)?$")
_FIXED = {
    "/v2/health/live": "health_live",
    "/v2/health/ready": "health_ready",
    "/v2": "server_metadata",
    "/metrics": "metrics",
    "/openapi.json": "openapi",
}
_MODEL_ENDPOINTS = {
    None: "model_metadata",
    "/ready": "model_ready",
    "/infer": "infer",
    "/jobs": "job_submit",
}


def classify(path: str, method: str) -> tuple[str, str | None, str | None]:
    """(endpoint, model, version) as named in the path, before any check that they exist."""
    if path in _FIXED:
        return _FIXED[path], None, None
    if path.startswith("/v2/jobs/"):
        return ("job_cancel" if method == "DELETE" else "job_status"), None, None
    m = _MODEL_PATH.match(path)
    if m is None:
        return "other", None, None
    return _MODEL_ENDPOINTS[m.group(3)], m.group(1), m.group(2)


def known_labels(
    registry: ModelRegistry, model: str | None, version: str | None, routed: str | None
) -> tuple[str | None, str | None]:
    """The (model, version) labels of a request that named ``model`` and ``version``: None for
    names the registry does not know; the version the request was routed to, if any."""
    entry = registry.models.get(model) if model else None
    if entry is None:
        return None, None
    if routed is not None:
        return model, routed  # a version the registry knew when the request was routed
    if version not in entry.metadata.versions:
        return model, entry.metadata.default_version if version is None else None
    return model, version


class RequestMetrics:
    def __init__(self, app: ASGIApp, gateway: Gateway) -> None:
        self.app = app
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_and_watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        routed = ROUTED_VERSION.set(None)
        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            self._observe(scope, status, time.perf_counter() - started, ROUTED_VERSION.get())
            ROUTED_VERSION.reset(routed)

    def _observe(self, scope: Scope, status: int, seconds: float, routed: str | None) -> None:
        endpoint, model, version = classify(scope["path"], scope["method"])
        model, version = known_labels(self.gateway.registry, model, version, routed)
        body_bytes = None
        if endpoint in ("infer", "job_submit"):
            for name, value in scope["headers"]:
                if name == b"content-length" and value.isdigit():
                    body_bytes = int(value)
        self.gateway.metrics.observe_request(
            model, version, endpoint, status, seconds, body_bytes=body_bytes
        )

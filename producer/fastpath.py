"""The infer route, the only way ``POST /v2/models/{model}[/versions/{version}]/infer`` is served.

It is nearly all of a gateway's traffic, and Starlette's routing, Request object, exception
wrappers and middleware took about a quarter of the gateway's CPU on it (BENCHMARKS.md, issue
#14). So ``GatewayApp`` (``producer.app``) hands it to ``InferFastPath`` straight from the
server's ASGI call, and the fast path does what those layers did, once: it matches the path
with the route table's own patterns after stripping ``root_path`` as Starlette does (so it
serves under a root path too, and Starlette never sees an infer POST), observes the request
(``producer.instrument``), and answers a refusal with its V2 error body (``producer.errors``).
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from producer.errors import GatewayError, http_form
from producer.httpbody import (
    body_received,
    caller_traceparent,
    header_bytes,
    no_cache,
    read_inference_body,
    request_headers,
)
from producer.instrument import Instrument, content_length
from producer.v2_request import parse_infer_request
from producer.v2_response import encode_infer_response, response_document
from runtime.tracing import REQUEST_TRACE

if TYPE_CHECKING:
    from producer.gateway import Gateway

_JSON = b"application/json"
_BINARY = b"application/octet-stream"


def route_path(scope: Scope) -> str:
    """The path the routes match: ``path`` less ``root_path``, as Starlette's
    ``get_route_path`` (``starlette._utils``, private; written against Starlette 1.10)."""
    path: str = scope["path"]
    root_path: str = scope.get("root_path", "")
    if not root_path or not path.startswith(root_path):
        return path
    if path == root_path:
        return ""
    return path[len(root_path) :] if path[len(root_path)] == "/" else path


async def _disconnect(receive: Receive) -> None:
    """Returns once the client has hung up. Only once the body is read: uvicorn's ``receive``
    then blocks until the connection is lost (or the response is complete)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def respond(
    gateway: Gateway, scope: Scope, receive: Receive, send: Send, model: str, version: str | None
) -> str:
    """Answer one infer request with its outputs (JSON, or binary tensors when asked for), and
    return the version it was routed to. Refusals raise ``GatewayError``."""
    headers = request_headers(scope)
    service = gateway.service
    with service.hold_body(header_bytes(scope)) as hold:
        raw, length = await read_inference_body(
            headers, receive, hold, gateway.settings, received=body_received(scope)
        )
        trace_context = caller_traceparent(headers)
        outcome = await service.infer(
            model,
            version,
            functools.partial(parse_infer_request, raw, length),
            no_cache=no_cache(headers),
            traceparent=trace_context,
            disconnected=functools.partial(_disconnect, receive),
        )
        result = outcome.result
        with REQUEST_TRACE.get().span("encode response"):
            body, json_length = encode_infer_response(
                *response_document(
                    client_id=outcome.body.client_id,
                    model_name=result.model,
                    model_version=result.version,
                    outputs=result.outputs,
                    binary_outputs=outcome.body.binary_outputs,
                    binary_all=outcome.body.binary_all,
                )
            )
    response_headers = [
        (b"content-length", str(len(body)).encode()),
        (b"content-type", _JSON if json_length is None else _BINARY),
        (b"traceparent", trace_context.encode()),
        (b"x-inferq-cache", b"hit" if outcome.cached else b"miss"),
    ]
    if json_length is not None:
        response_headers.append((b"inference-header-content-length", str(json_length).encode()))
    await send({"type": "http.response.start", "status": 200, "headers": response_headers})
    await send({"type": "http.response.body", "body": body})
    return outcome.version


async def send_error(send: Send, error: GatewayError) -> None:
    """The refusal's V2 error body, as the Starlette routes' exception handlers send it."""
    status, body, headers = http_form(error)
    raw = [(b"content-length", str(len(body)).encode()), (b"content-type", _JSON)]
    raw += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class InferFastPath:
    """The infer route with its observation and error answers (see the module docstring)."""

    def __init__(
        self, gateway: Gateway, instrument: Instrument, routes: Iterable[BaseRoute]
    ) -> None:
        self.gateway = gateway
        self.instrument = instrument
        self._paths: list[tuple[re.Pattern[str], bool]] = [
            (route.path_regex, "version" in route.param_convertors)
            for route in routes
            if isinstance(route, Route) and route.name == "infer"
        ]
        """The infer routes' patterns, and whether each names a version."""

    def match(self, scope: Scope) -> tuple[str, str | None] | None:
        """(model, version) when ``scope`` is an infer request, exactly as the route table's
        infer routes match it."""
        if scope["type"] != "http" or scope["method"] != "POST":
            return None
        path = route_path(scope)
        for pattern, versioned in self._paths:
            found = pattern.match(path)
            if found is not None:
                return found["model"], found["version"] if versioned else None
        return None

    async def serve(
        self, scope: Scope, receive: Receive, send: Send, model: str, version: str | None
    ) -> None:
        seen = self.instrument.start("infer", model, version, body_bytes=content_length(scope))
        seen.trace_http(scope, "infer", model, version)
        try:
            seen.routed = await respond(self.gateway, scope, receive, send, model, version)
        except asyncio.CancelledError as e:
            seen.failed(e)
            raise
        except Exception as e:
            await send_error(send, seen.failed(e, path=scope["path"]))
            return
        seen.end(200)


async def starlette_endpoint(request: Request) -> Response:
    """The endpoint the route table names for infer, which is never called: ``InferFastPath``
    serves every POST the route matches before Starlette routes it, and Starlette answers other
    methods with 405 before it would call an endpoint. The route is in the table for OpenAPI,
    the metric labels and those 405s."""
    raise RuntimeError("an infer request reached Starlette; InferFastPath serves every one")

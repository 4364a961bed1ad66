"""``/console``: the operator console, a small static page over JSON views.

The page (``producer/console_assets``: one HTML file, one script, one stylesheet, shipped in
the package, no CDN) holds no data: it asks for the token, then reads ``/console/api/*`` with
it as a bearer token and refreshes the view shown every few seconds. Why a static page rather
than server-rendered templates, in ARCHITECTURE.md ("The operator console").

Security:
- Reading a view needs the console token (``--console-token``, read-only) or the admin token;
  without one every view is 401, with a wrong one 403. The page itself is public: it is the
  same bytes for everyone and holds nothing from Redis or from the request.
- Acting needs the admin token. The page acts through the existing APIs (model load and unload:
  ``/v2/repository/...``; a job's cancel: ``DELETE /v2/jobs/{id}``) and through the two dead
  letter actions here (``POST``, the admin token; ``runtime.deadletters``, as ``inferq dlq``).
  No request that changes anything is a GET.
- The script writes every value as text (``textContent``, never ``innerHTML``), and the page
  is served with a Content-Security-Policy allowing only its own script and stylesheet, so a
  model name, an error message or a dead letter's payload is shown, never run.
- No secret reaches the page: the views carry no token, password or Redis URL.
- A view that cannot reach Redis is a 503 with a message (``redis_down``): the page shows it as
  a banner over the last data it had.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from producer import jobindex
from producer.admin import check_token
from producer.console_views import ConsoleViews
from producer.errors import BadRequest, Forbidden, NotFound, Unauthorized
from producer.gateway import Gateway
from producer.httpbody import body_chunks, read_body
from protocol.jobs import JobStatus
from protocol.keys import is_valid_name
from runtime import deadletters
from runtime.faults import RETRYABLE, describe

ASSETS = {
    "console.js": "text/javascript",
    "console.css": "text/css",
}
"""The page's files (``producer/console_assets``), with their media types."""
PAGE_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}
MAX_PAGE = 100
ACTION_BODY_LIMIT = 64 * 1024


def _asset(name: str) -> bytes:
    return (resources.files("producer") / "console_assets" / name).read_bytes()


def _views(request: Request) -> ConsoleViews:
    views: ConsoleViews = request.app.state.console
    return views


def role(gateway: Gateway, authorization: str | None) -> str:
    """``admin`` or ``read`` for a valid token; 401 without one, 403 with a wrong one (and
    when neither token is configured: the console is off)."""
    settings = gateway.settings
    if not settings.admin_token and not settings.console_token:
        raise Forbidden(
            "the console is disabled: start the gateway with --console-token (read-only) or "
            "--admin-token (INFERQ_CONSOLE_TOKEN, INFERQ_ADMIN_TOKEN)"
        )
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise Unauthorized("the console needs a token: send 'Authorization: Bearer <token>'")
    for name, token in (("admin", settings.admin_token), ("read", settings.console_token)):
        if token:
            try:
                check_token(token, authorization)
            except Forbidden:
                continue
            return name
    raise Forbidden("the token is not valid for the console")


def _redis_down(e: BaseException) -> Response:
    return JSONResponse({"error": describe(e), "redis_down": True}, status_code=503)


def reading(
    build: Callable[[Request, ConsoleViews], Awaitable[Any]],
) -> Callable[[Request], Awaitable[Response]]:
    """A view's handler: the token checked, the view built, Redis failures as 503."""

    async def handler(request: Request) -> Response:
        role(request.app.state.gateway, request.headers.get("authorization"))
        try:
            doc = await build(request, _views(request))
        except RETRYABLE as e:
            return _redis_down(e)
        return JSONResponse(doc, headers={"cache-control": "no-store"})

    return handler


async def page(request: Request) -> Response:
    return Response(_asset("index.html"), media_type="text/html", headers=PAGE_HEADERS)


async def asset(request: Request) -> Response:
    name = request.path_params["asset"]
    media_type = ASSETS.get(name)
    if media_type is None:
        raise NotFound(f"no such file: /console/static/{name}")
    return Response(
        _asset(name), media_type=media_type, headers={"x-content-type-options": "nosniff"}
    )


async def _whoami(request: Request, views: ConsoleViews) -> Any:
    gateway: Gateway = request.app.state.gateway
    who = role(gateway, request.headers.get("authorization"))
    return {
        "role": who,
        "gateway": gateway.settings.gateway_id,
        "namespace": gateway.settings.namespace,
        "redis_ok": gateway.registry.redis_ok,
    }


async def _overview(request: Request, views: ConsoleViews) -> Any:
    return await views.cached("overview", views.overview)


async def _workers(request: Request, views: ConsoleViews) -> Any:
    return await views.cached("workers", views.workers)


async def _models(request: Request, views: ConsoleViews) -> Any:
    return await views.cached("models", views.models)


async def _dead_letters(request: Request, views: ConsoleViews) -> Any:
    return await views.cached("dead_letters", views.dead_letters)


async def _jobs(request: Request, views: ConsoleViews) -> Any:
    q = request.query_params
    try:
        limit = int(q.get("limit", "25"))
    except ValueError:
        raise BadRequest("'limit' must be a whole number") from None
    if not 1 <= limit <= MAX_PAGE:
        raise BadRequest(f"'limit' must be between 1 and {MAX_PAGE}")
    model = q.get("model") or None
    if model is not None and not is_valid_name(model):
        raise BadRequest("'model' is not a model name")
    status = None
    if q.get("status"):
        try:
            status = JobStatus(q["status"])
        except ValueError:
            choices = ", ".join(s.value for s in JobStatus)
            raise BadRequest(f"'status' must be one of {choices}") from None
    cursor = None
    if q.get("cursor"):
        try:
            cursor = jobindex.Cursor.parse(q["cursor"])
        except ValueError:
            raise BadRequest("'cursor' is not one this list gave") from None
    return await views.jobs(limit=limit, model=model, status=status, cursor=cursor)


async def _job(request: Request, views: ConsoleViews) -> Any:
    return await views.job(request.path_params["job"])


async def _action_body(request: Request) -> tuple[str, list[str] | None]:
    """The admin token, then ``{"ids": [...]}`` or ``{"all": true}``: (model, ids or None)."""
    gateway: Gateway = request.app.state.gateway
    gateway.admin.authorize(request.headers.get("authorization"))
    model = request.path_params["model"]
    if not is_valid_name(model):
        raise BadRequest("not a model name")
    raw = await read_body(
        request.headers,
        body_chunks(request.receive),
        ACTION_BODY_LIMIT,
        timeout_s=gateway.settings.body_timeout_s,
    )
    try:
        body = json.loads(raw or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if body.get("all") is True:
        return model, None
    ids = body.get("ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        raise BadRequest('name the dead letters: {"ids": ["<id>", ...]} or {"all": true}')
    return model, ids


def acting(
    act: Callable[[Gateway, str, list[str] | None], Awaitable[dict[str, Any]]],
) -> Callable[[Request], Awaitable[Response]]:
    async def handler(request: Request) -> Response:
        model, ids = await _action_body(request)
        gateway: Gateway = request.app.state.gateway
        try:
            doc = await act(gateway, model, ids)
        except (RedisError, OSError) as e:
            return _redis_down(e)
        _views(request).forget("dead_letters")
        return JSONResponse(doc)

    return handler


async def _selected(
    gateway: Gateway, model: str, ids: list[str] | None
) -> list[tuple[bytes, dict[bytes, bytes]]]:
    found = await deadletters.entries(gateway.redis, gateway.keys.dlq(model), ids)
    gone = deadletters.missing(ids, found) if ids is not None else []
    if gone:
        raise NotFound(f"no dead letter {gone[0]} for model '{model}'")
    return found


async def _retry(gateway: Gateway, model: str, ids: list[str] | None) -> dict[str, Any]:
    found = await _selected(gateway, model, ids)
    done = await deadletters.replay(gateway.redis, gateway.keys, model, found)
    return {"replayed": done.replayed, "skipped": [list(s) for s in done.skipped]}


async def _purge(gateway: Gateway, model: str, ids: list[str] | None) -> dict[str, Any]:
    found = await _selected(gateway, model, ids)
    return {"purged": await deadletters.purge(gateway.redis, gateway.keys.dlq(model), found)}


def routes() -> list[Route]:
    """The page, its files and its views (not in the OpenAPI document: a page, not an API)."""
    api = "/console/api"
    return [
        Route("/console", page, name="console"),
        Route("/console/static/{asset}", asset, name="console_asset"),
        Route(api + "/whoami", reading(_whoami), name="console_whoami"),
        Route(api + "/overview", reading(_overview), name="console_overview"),
        Route(api + "/workers", reading(_workers), name="console_workers"),
        Route(api + "/models", reading(_models), name="console_models"),
        Route(api + "/jobs", reading(_jobs), name="console_jobs"),
        Route(api + "/jobs/{job}", reading(_job), name="console_job"),
        Route(api + "/deadletters", reading(_dead_letters), name="console_dead_letters"),
        Route(
            api + "/deadletters/{model}/retry",
            acting(_retry),
            name="console_dlq_retry",
            methods=["POST"],
        ),
        Route(
            api + "/deadletters/{model}/purge",
            acting(_purge),
            name="console_dlq_purge",
            methods=["POST"],
        ),
    ]

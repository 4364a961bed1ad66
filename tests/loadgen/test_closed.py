from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest

from loadgen.closed import run_closed_loop
from loadgen.http import PreparedRequest
from loadgen.loop import LoadOptions


def test_closed_loop_measures_after_warmup(tiny_server, response_bytes) -> None:
    async def main() -> None:
        async with tiny_server(lambda req: response_bytes(b'{"ok": true}')) as srv:
            # Both phases bounded by count, not by a fraction of a second of wall time: a
            # shared machine that stalls for 0.3 s must not make this test fail.
            res = await run_closed_loop(
                LoadOptions(
                    srv.url + "/v2/models/m/infer",
                    duration_s=30,
                    warmup_s=30,
                    max_requests=60,
                    body=b'{"inputs": []}',
                    headers={"content-type": "application/json"},
                ),
                4,
            )
        assert res.requests == res.ok == 60
        assert res.errors == {} and res.status_counts == {200: res.requests}
        assert res.warmup_requests == 60
        # every request the server saw was either warm-up or recorded
        assert len(srv.requests) == res.warmup_requests + res.requests
        assert srv.connections == 4
        assert {r.path for r in srv.requests} == {"/v2/models/m/infer"}
        assert all(r.method == "POST" and r.body == b'{"inputs": []}' for r in srv.requests)
        assert 0 < res.duration_s < 30
        assert res.throughput_rps == pytest.approx(res.requests / res.duration_s, rel=0.05)
        lat = res.latency_ms
        assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["p99.9"] <= lat["max"]
        assert res.client_cpu_s > 0
        d = json.loads(json.dumps(res.to_dict()))
        assert d["mode"] == "closed" and d["requests"] == res.requests
        assert "requests" in res.summary()

    asyncio.run(main())


def test_max_requests_bounds_warmup_and_measurement(tiny_server, response_bytes) -> None:
    async def main() -> None:
        async with tiny_server(lambda req: response_bytes()) as srv:
            res = await run_closed_loop(
                LoadOptions(srv.url, duration_s=30, warmup_s=30, max_requests=25, method="GET"), 3
            )
        assert res.warmup_requests == 25
        assert res.requests == res.ok == 25
        assert len(srv.requests) == 50
        assert res.duration_s < 10

    asyncio.run(main())


def test_request_list_is_cycled_and_errors_counted(tiny_server, response_bytes) -> None:
    def handler(req):
        if req.path == "/fail":
            return response_bytes(b"no", status=503, reason="Unavailable")
        if req.path == "/drop":
            return (b"", True)  # close without answering
        return response_bytes()

    reqs = [
        PreparedRequest("POST", "/ok", b"1", {"content-type": "application/json"}),
        PreparedRequest("POST", "/fail", b"2"),
        PreparedRequest("GET", "/drop"),
    ]

    async def main() -> None:
        async with tiny_server(handler) as srv:
            res = await run_closed_loop(
                LoadOptions(srv.url, duration_s=30, warmup_s=0, requests=reqs, max_requests=300), 2
            )
        assert res.requests == 300
        assert res.ok == 100
        assert res.errors == {"503": 100, "ConnectionClosed": 100}
        assert res.error_count == 200
        assert res.status_counts == {200: 100, 503: 100}
        assert res.warmup_requests == 0

    asyncio.run(main())


@pytest.mark.serial  # counts timeouts in 0.3 s
def test_timeouts_are_errors_and_the_loop_goes_on(tiny_server, response_bytes) -> None:
    async def main() -> None:
        never = asyncio.Event()

        async def handler(req):
            if req.path == "/hang":
                await never.wait()
            return response_bytes()

        reqs = [PreparedRequest("GET", "/hang"), PreparedRequest("GET", "/")]
        async with tiny_server(handler) as srv:
            res = await run_closed_loop(
                LoadOptions(srv.url, duration_s=0.3, warmup_s=0, requests=reqs, timeout_s=0.05), 1
            )
        assert res.errors.get("RequestTimeout", 0) >= 2
        assert res.ok >= 2
        assert abs(res.ok - res.errors["RequestTimeout"]) <= 1

    asyncio.run(main())


def test_refused_connections_are_counted_not_raised() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        res = asyncio.run(
            run_closed_loop(
                # Bounded by a count (the duration only bounds it): however starved the process,
                # the refusals are made and counted.
                LoadOptions(
                    f"http://127.0.0.1:{port}/", duration_s=30, warmup_s=0, max_requests=10
                ),
                2,
            )
        )
    assert res.ok == 0 and res.requests > 0
    assert set(res.errors) == {"ConnectError"}
    assert res.latency_ms["p50"] is None
    json.dumps(res.to_dict())


@pytest.mark.parametrize(
    ("url", "kwargs", "match"),
    [
        ("https://127.0.0.1/", {}, "https:// is not supported"),
        ("http://127.0.0.1/", {"concurrency": 0}, "concurrency"),
        ("http://127.0.0.1/", {"duration_s": 0}, "duration_s"),
        ("http://127.0.0.1/", {"max_requests": 0}, "max_requests"),
        ("http://127.0.0.1/", {"requests": [], "body": b""}, "empty"),
        ("http://127.0.0.1/", {"requests": PreparedRequest("GET", "/"), "body": b"x"}, "either"),
    ],
)
def test_bad_arguments(url: str, kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"concurrency": 1, "duration_s": 0.1} | kwargs
    concurrency = args.pop("concurrency")
    with pytest.raises(ValueError, match=match):
        asyncio.run(run_closed_loop(LoadOptions(url, **args), concurrency))


def test_against_uvicorn_and_starlette() -> None:
    uvicorn = pytest.importorskip("uvicorn")
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def infer(request: Request) -> JSONResponse:
        payload = await request.json()
        return JSONResponse({"model_name": "m", "outputs": payload["inputs"]})

    app = Starlette(routes=[Route("/v2/models/m/infer", infer, methods=["POST"])])

    async def main() -> None:
        config = uvicorn.Config(
            app, host="127.0.0.1", port=0, lifespan="off", log_config=None, log_level="warning"
        )
        config.load()
        server = uvicorn.Server(config)
        # What Server.serve() does, minus its signal handlers and its 0.1 s tick loop.
        server.lifespan = config.lifespan_class(config)
        await server.startup()
        try:
            port = server.servers[0].sockets[0].getsockname()[1]
            res = await run_closed_loop(
                LoadOptions(
                    f"http://127.0.0.1:{port}/v2/models/m/infer",
                    duration_s=30,  # bounds it; the count ends it
                    max_requests=200,
                    warmup_s=0.1,
                    body=json.dumps({"inputs": [{"name": "x", "data": [1, 2]}]}).encode(),
                    headers={"content-type": "application/json"},
                ),
                8,
            )
        finally:
            await server.shutdown()
        assert res.requests > 0 and res.ok == res.requests, res.errors

    asyncio.run(main())

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from loadgen.http import (
    ConnectError,
    ConnectionClosed,
    HTTPConnection,
    PreparedRequest,
    ProtocolError,
    RequestTimeout,
    Response,
    _ClientProtocol,
    parse_url,
    prepare,
    run,
)


def _runners() -> list[Any]:
    runners = [pytest.param(asyncio.run, id="asyncio")]
    try:
        import uvloop  # noqa: F401
    except ImportError:
        pass
    else:
        runners.append(pytest.param(lambda coro: run(coro, use_uvloop=True), id="uvloop"))
    return runners


RUNNERS = _runners()
Runner = Callable[[Coroutine[Any, Any, None]], None]


# --------------------------------------------------------------------------------------------
# prepare / parse_url
# --------------------------------------------------------------------------------------------


def test_prepare_builds_one_request() -> None:
    raw = prepare("post", "/v2/x?y=1", b"abc", {"Content-Type": "application/json"}, host="h:1")
    assert raw == (
        b"POST /v2/x?y=1 HTTP/1.1\r\nHost: h:1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 3\r\n\r\nabc"
    )


def test_prepare_get_has_no_content_length_and_keeps_callers_host() -> None:
    raw = prepare("GET", "/", headers={"host": "example"})
    assert raw == b"GET / HTTP/1.1\r\nhost: example\r\n\r\n"
    assert b"Content-Length: 0" in prepare("POST", "/")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"headers": {"x": "a\r\nInjected: 1"}},
        {"headers": {"bad name": "v"}},
        {"headers": {"content-length": "99"}},
        {"headers": {"transfer-encoding": "chunked"}},
        {"path": "/a b"},
        {"method": "GE T"},
    ],
)
def test_prepare_rejects_bad_input(kwargs: dict[str, Any]) -> None:
    args = {"method": "POST", "path": "/", "body": b"x", "headers": None} | kwargs
    with pytest.raises(ValueError):
        prepare(**args)


def test_prepare_accepts_matching_content_length() -> None:
    raw = prepare("POST", "/", b"xy", {"Content-Length": "2"})
    assert raw.count(b"Content-Length") == 1


def test_prepared_request_encode() -> None:
    req = PreparedRequest("HEAD", "/health")
    assert req.is_head
    assert req.encode("srv:80").startswith(b"HEAD /health HTTP/1.1\r\nHost: srv:80\r\n")


def test_parse_url() -> None:
    t = parse_url("http://127.0.0.1:8000/v2/models/m/infer?x=1")
    assert (t.host, t.port, t.path, t.host_header) == (
        "127.0.0.1",
        8000,
        "/v2/models/m/infer?x=1",
        "127.0.0.1:8000",
    )
    t = parse_url("http://example.com")
    assert (t.port, t.path, t.host_header) == (80, "/", "example.com")
    t = parse_url("http://[::1]:9000/")
    assert (t.host, t.host_header) == ("::1", "[::1]:9000")


@pytest.mark.parametrize("url", ["https://127.0.0.1/", "ftp://x/", "http:///nohost", "localhost"])
def test_parse_url_refuses(url: str) -> None:
    with pytest.raises(ValueError, match=r"https:// is not supported|only http://|no host"):
        parse_url(url)


# --------------------------------------------------------------------------------------------
# The parser, fed byte by byte through a fake transport
# --------------------------------------------------------------------------------------------


class FakeTransport(asyncio.Transport):
    def __init__(self, proto: _ClientProtocol) -> None:
        super().__init__()
        self.proto = proto
        self.closed = False

    def close(self) -> None:
        self._lose()

    def abort(self) -> None:
        self._lose()

    def _lose(self) -> None:
        if not self.closed:
            self.closed = True
            self.proto.connection_lost(None)

    def is_closing(self) -> bool:
        return self.closed

    def write(self, data: bytes | bytearray | memoryview) -> None:
        pass


def _feed(data: bytes, splits: list[int], *, head: bool = False) -> tuple[Response, bool]:
    """Feed ``data`` to a fresh protocol in pieces; return the response and whether the
    connection is still usable."""

    async def main() -> tuple[Response, bool]:
        proto = _ClientProtocol(asyncio.get_running_loop())
        transport = FakeTransport(proto)
        proto.connection_made(transport)
        fut = proto.begin(head, None)
        pos = 0
        for cut in [*splits, len(data)]:
            if cut > pos:
                proto.data_received(data[pos:cut])
                pos = cut
        if not fut.done():
            transport.close()
        return fut.result(), not proto.closed

    return asyncio.run(main())


def _all_splits(data: bytes, seed: int = 0) -> list[list[int]]:
    rnd = random.Random(seed)
    splits = [[], list(range(1, len(data)))]  # whole, then byte by byte
    for _ in range(20):
        k = rnd.randint(1, 6)
        splits.append(sorted(rnd.sample(range(1, len(data)), min(k, len(data) - 1))))
    return splits


def test_parser_content_length_any_split() -> None:
    data = b"HTTP/1.1 201 Created\r\nContent-Length: 5\r\nX-A: 1\r\nx-a: 2\r\n\r\nhello"
    for splits in _all_splits(data):
        resp, usable = _feed(data, splits)
        assert (resp.status, resp.body) == (201, b"hello")
        assert resp.headers == {"content-length": "5", "x-a": "1, 2"}
        assert usable


def test_parser_chunked_any_split() -> None:
    data = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\nhello\r\n1\r\n \r\nA\r\n0123456789\r\n0\r\nX-Trailer: t\r\n\r\n"
    )
    for splits in _all_splits(data, seed=1):
        resp, usable = _feed(data, splits)
        assert resp.body == b"hello 0123456789"
        assert usable


def test_parser_until_close_body() -> None:
    data = b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it"
    for splits in _all_splits(data, seed=2):
        resp, usable = _feed(data, splits)
        assert resp.body == b"all of it"
        assert not usable


def test_parser_interim_and_bodyless_responses() -> None:
    data = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n"
    resp, usable = _feed(data, [])
    assert (resp.status, resp.body, usable) == (204, b"", True)
    resp, usable = _feed(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", [], head=True)
    assert (resp.status, resp.body, usable) == (200, b"", True)


def test_parser_connection_close_header_drops_connection() -> None:
    data = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"
    resp, usable = _feed(data, [])
    assert resp.body == b"ok" and not usable
    data = b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok"
    assert _feed(data, [])[1]


@pytest.mark.parametrize(
    "data",
    [
        b"HTTX/1.1 200 OK\r\n\r\n",
        b"HTTP/1.1 2x0 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXX",
    ],
)
def test_parser_rejects_malformed(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        _feed(data, [])


# --------------------------------------------------------------------------------------------
# Against a real (tiny) server
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("runner", RUNNERS)
def test_request_roundtrip_and_keepalive(runner: Runner, tiny_server, response_bytes) -> None:
    def handler(req):
        return response_bytes(req.body[::-1], headers={"X-Path": req.path})

    async def main() -> None:
        async with tiny_server(handler) as srv:
            async with HTTPConnection.from_url(srv.url) as conn:
                resp = await conn.request("POST", "/echo", b"abc", {"X-Token": "t"})
                assert (resp.status, resp.body, resp.ok) == (200, b"cba", True)
                assert resp.headers["x-path"] == "/echo"
                raw = conn.prepare("POST", "/again", b"12345")
                for _ in range(5):
                    assert (await conn.send(raw)).body == b"54321"
            assert srv.connections == 1
            first = srv.requests[0]
            assert first.method == "POST" and first.body == b"abc"
            assert first.headers["host"] == f"127.0.0.1:{srv.port}"
            assert first.headers["x-token"] == "t"
            assert [r.index for r in srv.requests] == [0, 1, 2, 3, 4, 5]

    runner(main())


@pytest.mark.parametrize("runner", RUNNERS)
def test_large_bodies(runner: Runner, tiny_server, response_bytes) -> None:
    big = bytes(range(256)) * 4096  # 1 MiB

    async def main() -> None:
        async with tiny_server(lambda req: response_bytes(req.body + big)) as srv:
            async with HTTPConnection.from_url(srv.url) as conn:
                resp = await conn.request("POST", "/", big)
                assert resp.body == big + big

    runner(main())


@pytest.mark.parametrize("runner", RUNNERS)
def test_chunked_response_from_server(runner: Runner, tiny_server) -> None:
    def handler(req):
        parts = [b"%x\r\n%s\r\n" % (len(p), p) for p in (b"abc", b"x" * 70000, b"!")]
        return (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"".join(parts)
            + b"0\r\n\r\n"
        )

    async def main() -> None:
        async with tiny_server(handler) as srv:
            async with HTTPConnection.from_url(srv.url) as conn:
                for _ in range(2):
                    resp = await conn.request("GET", "/")
                    assert resp.body == b"abc" + b"x" * 70000 + b"!"
            assert srv.connections == 1

    runner(main())


def test_response_without_length_read_until_close_then_reconnect(tiny_server) -> None:
    async def main() -> None:
        async with tiny_server(lambda req: (b"HTTP/1.1 200 OK\r\n\r\nuntil close", True)) as srv:
            async with HTTPConnection.from_url(srv.url) as conn:
                assert (await conn.request("GET", "/")).body == b"until close"
                assert (await conn.request("GET", "/")).body == b"until close"
                assert (conn.connects, conn.retries) == (2, 0)
            assert srv.connections == 2

    asyncio.run(main())


def test_connection_close_header_reconnects(tiny_server, response_bytes) -> None:
    async def main() -> None:
        reply = response_bytes(b"bye", headers={"Connection": "close"})
        async with tiny_server(lambda req: (reply, True)) as srv:
            async with HTTPConnection.from_url(srv.url) as conn:
                for _ in range(3):
                    assert (await conn.request("GET", "/")).body == b"bye"
                assert (conn.connects, conn.retries) == (3, 0)
            assert srv.connections == 3

    asyncio.run(main())


@pytest.mark.parametrize("runner", RUNNERS)
def test_idle_close_race_is_retried_once(runner: Runner, tiny_server, response_bytes) -> None:
    # The server reads the 2nd request on a connection but closes without answering: what a
    # client sees when its write races the server's idle keep-alive timeout.
    def handler(req):
        return response_bytes(b"fine") if req.index == 0 else (b"", True)

    async def main() -> None:
        async with tiny_server(handler) as srv:
            async with HTTPConnection.from_url(srv.url) as conn:
                assert (await conn.request("POST", "/", b"1")).body == b"fine"
                assert (await conn.request("POST", "/", b"2")).body == b"fine"
                assert (conn.connects, conn.retries) == (2, 1)
            assert [(r.conn_id, r.index, r.body) for r in srv.requests] == [
                (0, 0, b"1"),
                (0, 1, b"2"),
                (1, 0, b"2"),
            ]

    runner(main())


def test_server_closed_idle_connection_is_reopened_before_sending(
    tiny_server, response_bytes
) -> None:
    async def main() -> None:
        async with tiny_server(lambda req: (response_bytes(b"x"), True)) as srv:
            async with HTTPConnection.from_url(srv.url) as conn:
                await conn.request("GET", "/")
                await asyncio.wait_for(conn._proto.lost, 5)  # the server's FIN has arrived
                await conn.request("GET", "/")
                assert (conn.connects, conn.retries) == (2, 0)

    asyncio.run(main())


def test_fresh_connection_closed_before_response_raises(tiny_server, response_bytes) -> None:
    async def main() -> None:
        async with tiny_server(lambda req: (b"", True)) as srv:
            async with HTTPConnection.from_url(srv.url) as conn:
                with pytest.raises(ConnectionClosed, match="before any response byte") as ei:
                    await conn.request("GET", "/")
                assert not ei.value.partial
                assert conn.retries == 0
            assert srv.connections == 1

    asyncio.run(main())


def test_retry_happens_only_once(tiny_server, response_bytes) -> None:
    def handler(req):
        return response_bytes() if req.conn_id == 0 and req.index == 0 else (b"", True)

    async def main() -> None:
        async with tiny_server(handler) as srv:
            async with HTTPConnection.from_url(srv.url) as conn:
                await conn.request("GET", "/")
                with pytest.raises(ConnectionClosed):
                    await conn.request("GET", "/")
                assert (conn.connects, conn.retries) == (2, 1)
            assert len(srv.requests) == 3

    asyncio.run(main())


def test_partial_response_is_not_retried(tiny_server, response_bytes) -> None:
    def handler(req):
        if req.index == 0:
            return response_bytes(b"good")
        return (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", True)

    async def main() -> None:
        async with tiny_server(handler) as srv:
            async with HTTPConnection.from_url(srv.url) as conn:
                await conn.request("GET", "/")
                with pytest.raises(ConnectionClosed, match="middle of a response") as ei:
                    await conn.request("GET", "/")
                assert ei.value.partial and conn.retries == 0
            assert len(srv.requests) == 2

    asyncio.run(main())


@pytest.mark.parametrize("runner", RUNNERS)
def test_timeout_drops_connection_and_next_request_works(
    runner: Runner, tiny_server, response_bytes
) -> None:
    async def main() -> None:
        never = asyncio.Event()

        async def handler(req):
            if req.path == "/slow":
                await never.wait()
            return response_bytes(b"quick")

        async with tiny_server(handler) as srv:
            async with HTTPConnection.from_url(srv.url, timeout=5.0) as conn:
                with pytest.raises(RequestTimeout, match=r"within 0\.05s"):
                    await conn.request("GET", "/slow", timeout=0.05)
                assert not conn.connected
                assert (await conn.request("GET", "/fast")).body == b"quick"
                assert conn.connects == 2

    runner(main())


def test_timeout_is_a_timeout_error() -> None:
    assert issubclass(RequestTimeout, TimeoutError)


def test_connect_refused_raises_connect_error() -> None:
    with socket.socket() as s:  # a port nobody listens on (bound, never listening)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

        async def main() -> None:
            async with HTTPConnection("127.0.0.1", port) as conn:
                with pytest.raises(ConnectError, match=f"127.0.0.1:{port}"):
                    await conn.request("GET", "/")

        asyncio.run(main())


def test_malformed_response_raises_and_drops(tiny_server, response_bytes) -> None:
    def handler(req):
        return b"garbage\r\n\r\n" if req.path == "/bad" else response_bytes()

    async def main() -> None:
        async with tiny_server(handler) as srv:
            async with HTTPConnection.from_url(srv.url) as conn:
                with pytest.raises(ProtocolError):
                    await conn.request("GET", "/bad")
                assert not conn.connected
                assert (await conn.request("GET", "/ok")).status == 200

    asyncio.run(main())


def test_head_and_error_statuses(tiny_server, response_bytes) -> None:
    def handler(req):
        if req.method == "HEAD":
            return b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n"
        return response_bytes(b'{"error": "overloaded"}', status=503, reason="Unavailable")

    async def main() -> None:
        async with tiny_server(handler) as srv:
            async with HTTPConnection.from_url(srv.url) as conn:
                head = await conn.request("HEAD", "/")
                assert (head.status, head.body) == (200, b"")
                resp = await conn.request("POST", "/", b"{}")
                assert resp.status == 503 and not resp.ok
                assert resp.json() == {"error": "overloaded"}
            assert srv.connections == 1

    asyncio.run(main())


def test_unsolicited_bytes_on_idle_connection_force_reconnect(tiny_server, response_bytes) -> None:
    extra = b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n"

    def handler(req):
        return response_bytes() + extra if req.index == 0 else response_bytes()

    async def main() -> None:
        async with tiny_server(handler) as srv:
            async with HTTPConnection.from_url(srv.url) as conn:
                assert (await conn.request("GET", "/")).status == 200
                assert (await conn.request("GET", "/")).status == 200
                assert conn.connects == 2

    asyncio.run(main())


def test_one_request_at_a_time(tiny_server, response_bytes) -> None:
    async def main() -> None:
        release = asyncio.Event()
        got = asyncio.Event()

        async def handler(req):
            got.set()
            await release.wait()
            return response_bytes()

        async with tiny_server(handler) as srv:
            async with HTTPConnection.from_url(srv.url) as conn:
                first = asyncio.create_task(conn.request("GET", "/"))
                await asyncio.wait_for(got.wait(), 5)  # the server has the first request
                with pytest.raises(RuntimeError, match="busy"):
                    await conn.request("GET", "/")
                release.set()
                assert (await first).status == 200

    asyncio.run(main())


def test_cancelled_request_discards_connection(tiny_server, response_bytes) -> None:
    async def main() -> None:
        release = asyncio.Event()
        got = asyncio.Event()

        async def handler(req):
            if req.path == "/hang":
                got.set()
                await release.wait()
            return response_bytes(req.path.encode())

        async with tiny_server(handler) as srv:
            async with HTTPConnection.from_url(srv.url) as conn:
                task = asyncio.create_task(conn.request("GET", "/hang"))
                await asyncio.wait_for(got.wait(), 5)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert not conn.connected
                release.set()
                # the late answer to /hang must not be taken as the answer to /next
                assert (await conn.request("GET", "/next")).body == b"/next"

    asyncio.run(main())


@pytest.mark.parametrize("runner", RUNNERS)
def test_timer_is_rearmed_for_the_request_in_flight(
    runner: Runner, tiny_server, response_bytes
) -> None:
    # The connection's single timer was armed for a short-timeout request that completed; the
    # next request (longer timeout) must time out at its own deadline, not at the old one.
    async def main() -> None:
        never = asyncio.Event()

        async def handler(req):
            if req.path == "/slow":
                await never.wait()
            return response_bytes()

        loop = asyncio.get_running_loop()
        async with tiny_server(handler) as srv:
            async with HTTPConnection.from_url(srv.url) as conn:
                for _ in range(3):
                    assert (await conn.request("GET", "/", timeout=0.02)).ok
                t0 = loop.time()
                with pytest.raises(RequestTimeout):
                    await conn.request("GET", "/slow", timeout=0.25)
                assert 0.24 <= loop.time() - t0 < 5
                # no timeout at all: the stale timer must not fire on this one
                assert (await conn.request("GET", "/", timeout=None)).ok

    runner(main())

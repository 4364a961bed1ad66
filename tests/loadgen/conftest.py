"""A scriptable raw-asyncio HTTP/1.1 server for the load generator's tests.

Tests get the class through the ``tiny_server`` fixture and start it *inside* their own
``asyncio.run(...)``, so server and client share one event loop and no threads or sleeps are
needed.  The handler decides, per request, exactly which bytes go back and whether the
connection is then closed — enough to script chunked bodies, half-sent responses and idle
closes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest


@dataclass
class Req:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    conn_id: int  # which accepted connection (0, 1, ...) carried it
    index: int  # how many requests that connection carried before this one


def http_response(
    body: bytes = b"ok",
    status: int = 200,
    headers: dict[str, str] | None = None,
    reason: str = "OK",
) -> bytes:
    hdrs = {"content-type": "application/octet-stream", "content-length": str(len(body))}
    hdrs.update(headers or {})
    head = f"HTTP/1.1 {status} {reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items())
    return head.encode("latin-1") + b"\r\n" + body


#: A handler returns (or awaits to) the bytes to write, or ``(bytes, close)`` where ``close``
#: says to close the connection after writing them (``(b"", True)``: close without answering).
Reply = bytes | tuple[bytes, bool]
Handler = Callable[[Req], Awaitable[Reply] | Reply]


@dataclass
class TinyHTTPServer:
    handler: Handler
    port: int = 0
    connections: int = 0
    requests: list[Req] = field(default_factory=list)
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> TinyHTTPServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()
        for w in list(self._writers):
            w.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        conn_id = self.connections
        self.connections += 1
        try:
            index = 0
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if line:
                        k, _, v = line.partition(":")
                        headers[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                req = Req(method, path, headers, body, conn_id, index)
                self.requests.append(req)
                index += 1
                out = self.handler(req)
                if not isinstance(out, bytes | tuple):
                    out = await out
                data, close = out if isinstance(out, tuple) else (out, False)
                if data:
                    writer.write(data)
                    await writer.drain()
                if close:
                    return
        finally:
            self._writers.discard(writer)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            self._tasks.discard(task)


@pytest.fixture
def tiny_server() -> type[TinyHTTPServer]:
    """The server class: ``async with tiny_server(handler) as srv: ... srv.url ...``."""
    return TinyHTTPServer


@pytest.fixture
def response_bytes() -> Callable[..., bytes]:
    """``response_bytes(body=b"ok", status=200, headers=None)``: a Content-Length response."""
    return http_response

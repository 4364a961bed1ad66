"""A minimal, fast HTTP/1.1 keep-alive client for load generation.

Why not httpx/aiohttp: the benchmarks drive thousands of requests per second from one Python
process that shares two cores with the server under test, so the client's per-request cost must
be a few tens of microseconds. This module does the least that is correct:

* one :class:`HTTPConnection` is one TCP connection (an :class:`asyncio.Protocol`, no streams),
  with at most one request in flight (no pipelining);
* request bytes are built once by :func:`prepare` and written with a single ``transport.write``;
* responses are parsed by ``httptools`` (llhttp, the parser uvicorn uses; faster than the
  hand-written one it replaced): ``Content-Length``, chunked and read-until-close bodies;
* a keep-alive connection the server has closed is reopened transparently, and a request that a
  reused connection lost before *any* response byte arrived is retried once on a fresh one (the
  usual idle keep-alive race). Every other failure raises a :class:`HTTPClientError` subclass.

``https://`` is refused (:func:`parse_url`); TLS would dominate the client's CPU budget anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar
from urllib.parse import urlsplit

import httptools

__all__ = [
    "ConnectError",
    "ConnectionClosed",
    "HTTPClientError",
    "HTTPConnection",
    "PreparedRequest",
    "ProtocolError",
    "RequestTimeout",
    "Response",
    "Target",
    "parse_url",
    "prepare",
    "run",
]

T = TypeVar("T")

#: Largest response head (status line + headers) accepted, in bytes.
MAX_HEAD_BYTES = 64 * 1024


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


class HTTPClientError(Exception):
    """Base class of every error this client raises for a request that got no full response."""


class ConnectError(HTTPClientError):
    """The TCP connection could not be established (refused, unreachable, connect timeout)."""


class ConnectionClosed(HTTPClientError):
    """The server closed (or reset) the connection before the response was complete.

    ``partial`` tells whether some response bytes had already arrived; a request is retried
    transparently only when none had, and only once, on a connection that had been reused.
    """

    def __init__(self, message: str, *, partial: bool) -> None:
        super().__init__(message)
        self.partial = partial


class ProtocolError(HTTPClientError):
    """The server sent something that is not a valid HTTP/1.x response."""


class RequestTimeout(HTTPClientError, TimeoutError):
    """No complete response within the request's timeout; the connection was dropped."""


# --------------------------------------------------------------------------------------------
# Requests and responses
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Response:
    status: int
    #: Header names are lowercased; repeated headers are joined with ", ".
    headers: dict[str, str]
    body: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def json(self) -> Any:
        import json

        return json.loads(self.body)


class Target(NamedTuple):
    """Where a URL points: what to connect to and what to put in the request line / Host."""

    host: str
    port: int
    path: str  # path plus "?query", never empty
    host_header: str


def parse_url(url: str) -> Target:
    """Split an ``http://`` URL; ``https://`` and anything else is refused with a clear error."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "https":
        raise ValueError(
            f"{url!r}: https:// is not supported by the load generator yet "
            "(point it at the plain-HTTP listener, e.g. http://127.0.0.1:8000/...)"
        )
    if scheme != "http":
        raise ValueError(f"{url!r}: only http:// URLs are supported")
    host = parts.hostname
    if not host:
        raise ValueError(f"{url!r}: URL has no host")
    try:
        port = parts.port or 80
    except ValueError as exc:  # port out of range / not a number
        raise ValueError(f"{url!r}: {exc}") from None
    path = parts.path or "/"
    if parts.query:
        path = f"{path}?{parts.query}"
    host_for_header = f"[{host}]" if ":" in host else host
    host_header = host_for_header if port == 80 else f"{host_for_header}:{port}"
    return Target(host, port, path, host_header)


def _check(value: str, what: str, forbidden: str = "\r\n\0") -> None:
    if not value or any(c in value for c in forbidden):
        raise ValueError(f"invalid {what}: {value!r}")


def prepare(
    method: str,
    path: str,
    body: bytes = b"",
    headers: Mapping[str, str] | None = None,
    *,
    host: str = "localhost",
) -> bytes:
    """Serialise one HTTP/1.1 request (request line, headers, body) into one ``bytes``.

    ``Host`` comes from ``host`` unless ``headers`` has one; ``Content-Length`` is computed from
    ``body`` (a caller-supplied one must agree). The result can be written any number of times.
    """
    method = method.upper()
    _check(method, "method", " \t\r\n\0")
    _check(path, "path", " \t\r\n\0")
    body = bytes(body)
    lines = [f"{method} {path} HTTP/1.1"]
    seen: set[str] = set()
    for name, value in (headers or {}).items():
        name = name.strip()
        value = str(value).strip()
        _check(name, "header name", " \t:\r\n\0")
        if any(c in value for c in "\r\n\0"):
            raise ValueError(f"invalid value for header {name!r}: {value!r}")
        low = name.lower()
        if low == "content-length":
            if value != str(len(body)):
                raise ValueError(f"Content-Length {value!r} does not match the body ({len(body)})")
            continue
        if low == "transfer-encoding":
            raise ValueError("Transfer-Encoding is not supported on requests; send a plain body")
        seen.add(low)
        lines.append(f"{name}: {value}")
    if "host" not in seen:
        lines.insert(1, f"Host: {host}")
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}")
    return "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + body


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """One request of a workload, independent of the server's address.

    :meth:`encode` gives the wire bytes for a given ``Host``; load loops encode every request
    once and then write the same bytes over and over.
    """

    method: str
    path: str
    body: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def is_head(self) -> bool:
        return self.method.upper() == "HEAD"

    def encode(self, host: str = "localhost") -> bytes:
        return prepare(self.method, self.path, self.body, self.headers, host=host)


# --------------------------------------------------------------------------------------------
# The protocol: responses parsed by httptools
# --------------------------------------------------------------------------------------------


class _ClientProtocol(asyncio.Protocol):
    """Parses responses for one connection (``httptools``, llhttp's parser, as uvicorn uses);
    hands each one to the waiting request's future."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.lost: asyncio.Future[None] = loop.create_future()
        self._parser: httptools.HttpResponseParser | None = None
        self._waiter: asyncio.Future[Response] | None = None
        self._head_request = False
        self.got_bytes = False
        self._status = 0
        self._headers: dict[str, str] = {}
        self._head_bytes = 0
        """Bytes received before the head was complete (bounded by ``MAX_HEAD_BYTES``)."""
        self._head_done = False
        self._until_close = False
        self._body: bytes | bytearray = b""
        self._junk = False
        """A response started where none was asked for: the connection's state is unknown."""
        # Request timeout: one lazily re-armed timer per connection (see begin()).
        self._deadline = math.inf
        self._timeout: float | None = None
        self._timer: asyncio.TimerHandle | None = None

    # asyncio callbacks ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiter = self._waiter
        self._waiter = None
        if waiter is not None and not waiter.done():
            if self._until_close and exc is None:
                waiter.set_result(Response(self._status, self._headers, bytes(self._body)))
            else:
                why = f": {exc}" if exc else ""
                if self.got_bytes:
                    msg = f"connection closed in the middle of a response{why}"
                else:
                    msg = f"connection closed before any response byte{why}"
                waiter.set_exception(ConnectionClosed(msg, partial=self.got_bytes))
        self._body = b""
        if not self.lost.done():
            self.lost.set_result(None)

    def eof_received(self) -> bool | None:
        return None  # close our side too; connection_lost() settles any pending request

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if self._waiter is None or parser is None:
            # Bytes nobody asked for (e.g. a 408 on an idle connection): the connection's state
            # is unknown, so drop it; the next request reconnects.
            self._discard()
            return
        self.got_bytes = True
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._complete(b"", keep_alive=False)  # upgrades are not supported: drop it
        except httptools.HttpParserError as exc:
            self._fail(ProtocolError(f"malformed response: {exc}"))
            return
        if self._junk:
            self._discard()
        elif not self._head_done and self._waiter is not None:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._fail(ProtocolError("response head too large"))

    # httptools callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._headers = {}
        if self._waiter is None:
            self._junk = True  # we never pipeline: bytes after the response are junk

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        headers = self._headers
        headers[key] = f"{headers[key]}, {text}" if key in headers else text

    def on_headers_complete(self) -> None:
        assert self._parser is not None
        status = self._status = self._parser.get_status_code()
        if 100 <= status < 200:
            return  # an interim response (101 ends in HttpParserUpgrade): the real one follows
        self._head_done = True
        headers = self._headers
        self._until_close = (
            "content-length" not in headers
            and "chunked" not in headers.get("transfer-encoding", "").lower()
            and status not in (204, 304)
        )
        if self._head_request:
            # llhttp would wait for the Content-Length a HEAD response announces but never
            # sends: answer now, and parse the next response with a fresh parser.
            keep_alive = self._keep_alive()
            self._parser = None
            self._complete(b"", keep_alive=keep_alive)

    def on_body(self, body: bytes) -> None:
        if not self._body:
            self._body = body
        elif isinstance(self._body, bytearray):
            self._body += body
        else:
            self._body = bytearray(self._body) + body

    def on_message_complete(self) -> None:
        if self._waiter is None or not self._head_done:
            return  # the end of an interim 1xx response, or of junk
        self._complete(bytes(self._body), keep_alive=self._keep_alive())

    def _keep_alive(self) -> bool:
        return self._parser is not None and self._parser.should_keep_alive()

    # request side ---------------------------------------------------------------------------

    def begin(self, head_request: bool, timeout: float | None) -> asyncio.Future[Response]:
        """Expect a response; the caller writes the request right after.

        The timeout costs one ``loop.time()`` per request: the connection keeps a single timer,
        armed for the deadline of the request in flight when it was set; when it fires it fails
        the current request if *its* deadline has passed, and otherwise re-arms itself for that
        deadline.  (A ``call_later`` + ``cancel`` per request costs 1.5 us on uvloop and ~5 us on
        the default loop, a sizeable share of the whole per-request budget.)
        """
        loop = self._loop
        fut: asyncio.Future[Response] = loop.create_future()
        self._waiter = fut
        self._head_request = head_request
        self.got_bytes = False
        self._head_done = False
        self._head_bytes = 0
        self._until_close = False
        self._body = b""
        if self._parser is None:
            self._parser = httptools.HttpResponseParser(self)
        if timeout is None:
            self._deadline = math.inf
        else:
            self._deadline = loop.time() + timeout
            self._timeout = timeout
            timer = self._timer
            if timer is None:
                self._timer = loop.call_at(self._deadline, self._on_timer)
            elif timer.when() > self._deadline:
                # A shorter timeout than the armed timer's (timeouts vary per request, e.g. the
                # open loop's time left before an intended start's deadline): re-arm earlier.
                timer.cancel()
                self._timer = loop.call_at(self._deadline, self._on_timer)
        return fut

    def _on_timer(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done() or self._deadline == math.inf:
            return
        # Timers may fire a little early (uvloop rounds to milliseconds): allow 1 ms.
        if self._loop.time() >= self._deadline - 1e-3:
            self._fail(RequestTimeout(f"no complete response within {self._timeout}s"))
        else:
            self._timer = self._loop.call_at(self._deadline, self._on_timer)

    def _discard(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, exc: Exception) -> None:
        waiter = self._waiter
        self._waiter = None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        self._discard()

    def _complete(self, body: bytes, *, keep_alive: bool) -> None:
        waiter = self._waiter
        self._waiter = None
        self._body = b""
        if not keep_alive:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
        if waiter is not None and not waiter.done():
            waiter.set_result(Response(self._status, self._headers, body))


# --------------------------------------------------------------------------------------------
# The connection
# --------------------------------------------------------------------------------------------


class _Default:
    """Type of :data:`DEFAULT`: "use the connection's own timeout"."""

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT = _Default()


class HTTPConnection:
    """One keep-alive HTTP/1.1 connection to ``host:port``; one request at a time.

    >>> conn = HTTPConnection.from_url("http://127.0.0.1:8000")
    >>> resp = await conn.request("POST", "/v2/models/m/infer", body, {"content-type": "..."})
    >>> raw = conn.prepare("POST", "/v2/models/m/infer", body, headers)  # reuse in a loop:
    >>> resp = await conn.send(raw)
    >>> await conn.aclose()

    ``timeout`` bounds each request from the write to the last response byte (``None``: no
    bound); ``connect_timeout`` bounds establishing the TCP connection.  Connecting happens on
    the first request, or explicitly with :meth:`connect`.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        host_header: str | None = None,
        timeout: float | None = 30.0,
        connect_timeout: float = 10.0,
    ) -> None:
        self.host = host
        self.port = port
        if host_header is None:
            host_header = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.host_header = host_header
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._proto: _ClientProtocol | None = None
        self._busy = False
        #: How many TCP connections this object has opened (1 + reconnects).
        self.connects = 0
        #: Requests retried because a reused connection was closed before any response byte.
        self.retries = 0

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> HTTPConnection:
        target = parse_url(url)
        return cls(target.host, target.port, host_header=target.host_header, **kwargs)

    @property
    def connected(self) -> bool:
        return self._proto is not None and not self._proto.closed

    def prepare(
        self, method: str, path: str, body: bytes = b"", headers: Mapping[str, str] | None = None
    ) -> bytes:
        """:func:`prepare` with this connection's ``Host``."""
        return prepare(method, path, body, headers, host=self.host_header)

    async def connect(self) -> None:
        """Open the TCP connection now (if it is not open already)."""
        if self.connected:
            return
        loop = asyncio.get_running_loop()
        proto = _ClientProtocol(loop)
        try:
            async with asyncio.timeout(self.connect_timeout):
                await loop.create_connection(lambda: proto, self.host, self.port)
        except TimeoutError:
            raise ConnectError(
                f"connect to {self.host}:{self.port} timed out after {self.connect_timeout}s"
            ) from None
        except OSError as exc:
            raise ConnectError(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        self._proto = proto
        self.connects += 1

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        *,
        timeout: float | _Default | None = DEFAULT,  # noqa: ASYNC109 (see send())
    ) -> Response:
        """Send one request and return its response (any status; non-2xx does not raise)."""
        raw = prepare(method, path, body, headers, host=self.host_header)
        return await self.send(raw, head=method.upper() == "HEAD", timeout=timeout)

    async def send(
        self,
        raw: bytes,
        *,
        head: bool = False,
        # Much cheaper than ``asyncio.timeout()``: see _ClientProtocol.begin().
        timeout: float | _Default | None = DEFAULT,  # noqa: ASYNC109
    ) -> Response:
        """Write prepared request bytes (see :func:`prepare`) and await the response.

        ``head`` must be true for a HEAD request (its response has no body).  ``timeout``
        defaults to the connection's; on expiry :class:`RequestTimeout` is raised and the
        connection is dropped (the next request reconnects).
        """
        if self._busy:
            raise RuntimeError("HTTPConnection is already busy with a request (no pipelining)")
        if isinstance(timeout, _Default):
            timeout = self.timeout
        self._busy = True
        try:
            proto = self._proto
            reused = proto is not None and not proto.closed
            if not reused:
                await self.connect()
            while True:
                proto = self._proto
                assert proto is not None and proto.transport is not None
                try:
                    if proto.closed:  # closed by the server before we could write
                        msg = "connection closed before the request was sent"
                        raise ConnectionClosed(msg, partial=False)
                    fut = proto.begin(head, timeout)
                    proto.transport.write(raw)
                    return await fut
                except ConnectionClosed as exc:
                    if reused and not exc.partial:
                        # The server closed an idle keep-alive connection as we wrote: retry once
                        # on a fresh connection.
                        reused = False
                        self.retries += 1
                        await self.connect()
                        continue
                    raise
                except asyncio.CancelledError:
                    proto._discard()  # response state unknown: never reuse this connection
                    raise
        finally:
            self._busy = False

    def close(self) -> None:
        """Start closing the connection (the socket is released on the next loop iteration)."""
        if self._proto is not None and self._proto.transport is not None:
            self._proto.closed = True
            self._proto.transport.close()

    async def aclose(self) -> None:
        """Close the connection and wait until the socket is released."""
        proto = self._proto
        if proto is None:
            return
        self.close()
        await proto.lost

    async def __aenter__(self) -> HTTPConnection:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


# --------------------------------------------------------------------------------------------
# Event loop
# --------------------------------------------------------------------------------------------


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool = True) -> T:
    """``asyncio.run(main)``, on uvloop when it is installed (and ``use_uvloop``)."""
    factory = None
    if use_uvloop:
        with contextlib.suppress(ImportError):
            import uvloop

            factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)

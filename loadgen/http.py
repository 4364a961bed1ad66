"""A minimal, fast HTTP/1.1 keep-alive client for load generation.

Why not httpx/aiohttp: the benchmarks drive thousands of requests per second from one Python
process that shares two cores with the server under test, so the client's per-request cost must
be a few tens of microseconds.  This module does the least that is correct:

* one :class:`HTTPConnection` is one TCP connection (an :class:`asyncio.Protocol`, no streams),
  with at most one request in flight (no pipelining);
* request bytes are built once by :func:`prepare` and written with a single ``transport.write``;
* responses are parsed in ``data_received``: a fast path for ``Content-Length`` bodies, plus
  ``Transfer-Encoding: chunked`` and read-until-close bodies;
* a keep-alive connection the server has closed is reopened transparently, and a request that a
  reused connection lost before *any* response byte arrived is retried once on a fresh one (the
  usual idle keep-alive race).  Every other failure raises a :class:`HTTPClientError` subclass.

``https://`` is refused (:func:`parse_url`); TLS would dominate the client's CPU budget anyway.

One module of ~700 lines, on purpose: the parser, the protocol and the connection share the
per-connection state of one request in flight, and keeping them together keeps the hot path
free of indirection (``bench/http_clients.py`` measures it).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar
from urllib.parse import urlsplit

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
#: Longest chunk-size / trailer line accepted in a chunked body.
MAX_LINE_BYTES = 8 * 1024


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
# The protocol: response parser
# --------------------------------------------------------------------------------------------

_IDLE = 0
_HEAD = 1
_BODY = 2  # Content-Length body, self._remaining bytes left
_CHUNK_SIZE = 3
_CHUNK_DATA = 4
_TRAILERS = 5
_UNTIL_CLOSE = 6


class _ClientProtocol(asyncio.Protocol):
    """Parses responses for one connection; hands each one to the waiting request's future."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.lost: asyncio.Future[None] = loop.create_future()
        self._buf = bytearray()
        self._waiter: asyncio.Future[Response] | None = None
        self._head_request = False
        self.got_bytes = False
        self._state = _IDLE
        self._status = 0
        self._headers: dict[str, str] = {}
        self._keep_alive = True
        self._remaining = 0
        self._chunks: list[bytes] = []
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
            if self._state == _UNTIL_CLOSE and exc is None:
                waiter.set_result(Response(self._status, self._headers, bytes(self._buf)))
            else:
                why = f": {exc}" if exc else ""
                if self.got_bytes:
                    msg = f"connection closed in the middle of a response{why}"
                else:
                    msg = f"connection closed before any response byte{why}"
                waiter.set_exception(ConnectionClosed(msg, partial=self.got_bytes))
        self._buf = bytearray()
        self._chunks = []
        if not self.lost.done():
            self.lost.set_result(None)

    def eof_received(self) -> bool | None:
        return None  # close our side too; connection_lost() settles any pending request

    def data_received(self, data: bytes) -> None:
        if self._waiter is None:
            # Bytes nobody asked for (e.g. a 408 on an idle connection): the connection's state
            # is unknown, so drop it; the next request reconnects.
            self._discard()
            return
        self.got_bytes = True
        if self._buf:
            self._buf += data
            buf: bytes | bytearray = self._buf
        else:
            buf = data
        try:
            pos = self._parse(buf)
        except ProtocolError as exc:
            self._fail(exc)
            return
        except ValueError as exc:  # int() of a bad number
            self._fail(ProtocolError(f"malformed response: {exc}"))
            return
        if buf is self._buf:
            if pos:
                del self._buf[:pos]
        elif pos < len(buf):
            self._buf += buf[pos:]

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
        self._state = _HEAD
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
        self._state = _IDLE
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        self._discard()

    def _complete(self, body: bytes, buf: bytes | bytearray, pos: int) -> None:
        waiter = self._waiter
        self._waiter = None
        self._state = _IDLE
        keep_alive = self._keep_alive
        if pos < len(buf):
            keep_alive = False  # bytes beyond the response: we never pipeline, so it is junk
        if not keep_alive:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
        if waiter is not None and not waiter.done():
            waiter.set_result(Response(self._status, self._headers, body))

    # parser ---------------------------------------------------------------------------------

    def _parse(self, buf: bytes | bytearray) -> int:
        """Consume what it can of ``buf``; return how many bytes were used."""
        pos = 0
        while True:
            state = self._state
            if state == _HEAD:
                end = buf.find(b"\r\n\r\n", pos)
                if end < 0:
                    if len(buf) - pos > MAX_HEAD_BYTES:
                        raise ProtocolError("response head too large")
                    return pos
                head = buf[pos:end].decode("latin-1")
                pos = end + 4
                if not self._parse_head(head):
                    continue  # an interim 1xx response: the real one follows
                if self._state == _BODY:
                    n = self._remaining
                    if len(buf) - pos >= n:  # fast path: the whole body is here
                        body = bytes(buf[pos : pos + n])
                        pos += n
                        self._complete(body, buf, pos)
                        return len(buf)
                    return pos
                if self._state == _IDLE:  # no body
                    self._complete(b"", buf, pos)
                    return len(buf)
            elif state == _BODY:
                n = self._remaining
                if len(buf) - pos < n:
                    return pos
                body = bytes(buf[pos : pos + n])
                pos += n
                self._complete(body, buf, pos)
                return len(buf)
            elif state == _CHUNK_SIZE:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if len(buf) - pos > MAX_LINE_BYTES:
                        raise ProtocolError("chunk-size line too long")
                    return pos
                size_text = bytes(buf[pos:end]).split(b";", 1)[0].strip()
                try:
                    size = int(size_text, 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk size {size_text!r}") from None
                if size < 0:
                    raise ProtocolError(f"bad chunk size {size_text!r}")
                pos = end + 2
                if size == 0:
                    self._state = _TRAILERS
                else:
                    self._remaining = size
                    self._state = _CHUNK_DATA
            elif state == _CHUNK_DATA:
                n = self._remaining
                if len(buf) - pos < n + 2:
                    return pos
                if buf[pos + n : pos + n + 2] != b"\r\n":
                    raise ProtocolError("chunk data not followed by CRLF")
                self._chunks.append(bytes(buf[pos : pos + n]))
                pos += n + 2
                self._state = _CHUNK_SIZE
            elif state == _TRAILERS:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if len(buf) - pos > MAX_LINE_BYTES:
                        raise ProtocolError("trailer line too long")
                    return pos
                if end == pos:  # the empty line that ends the message
                    pos += 2
                    body = b"".join(self._chunks)
                    self._chunks = []
                    self._complete(body, buf, pos)
                    return len(buf)
                pos = end + 2  # trailers are ignored
            elif state == _UNTIL_CLOSE:
                return pos  # everything stays in the buffer until connection_lost()
            else:  # _IDLE: data after a completed response was already handled
                return len(buf)

    def _parse_head(self, head: str) -> bool:
        """Parse status line + headers; set up body framing. False for an interim 1xx."""
        lines = head.split("\r\n")
        version, _, rest = lines[0].partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
            raise ProtocolError(f"bad status line {lines[0]!r}")
        status = int(code)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name[-1] in " \t":
                raise ProtocolError(f"bad header line {line!r}")
            name = name.lower()
            value = value.strip()
            if name in headers:
                headers[name] = f"{headers[name]}, {value}"
            else:
                headers[name] = value
        if 100 <= status < 200 and status != 101:
            return False
        self._status = status
        self._headers = headers
        conn = headers.get("connection")
        if conn is not None:
            conn = conn.lower()
            self._keep_alive = "close" not in conn and (
                version != "HTTP/1.0" or "keep-alive" in conn
            )
        else:
            self._keep_alive = version != "HTTP/1.0"
        if self._head_request or status in (204, 304):
            self._state = _IDLE
        elif status == 101:
            self._keep_alive = False  # upgrades are not supported: drop the connection
            self._state = _IDLE
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self._chunks = []
            self._state = _CHUNK_SIZE
        elif (cl := headers.get("content-length")) is not None:
            if not cl.isdigit():
                raise ProtocolError(f"bad Content-Length {cl!r}")
            self._remaining = int(cl)
            self._state = _BODY
        else:
            self._keep_alive = False
            self._state = _UNTIL_CLOSE
        return True


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

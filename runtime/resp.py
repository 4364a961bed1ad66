"""A lean, pipelining Redis connection: one node, RESP2, batches of commands in flight together.

``runtime.broker`` sends the gateway's hot path (``AutoPipeline``'s batches on one Redis) and
every blocking stream read over it: hiredis packs and parses in C, a batch goes out in one
``transport.write``, and the next batch is written while earlier ones are in flight, where a
redis-py pipeline pays a pool checkout, Python packing and a reading coroutine per round trip
(ARCHITECTURE.md, "One face for Redis").

It is set up as redis-py sets up its connections (``Endpoint``: TCP, TLS or a Unix socket, AUTH,
database, client name) and asks its ``CLIENT ID``. Error replies are redis-py's exception
classes, returned in place, not raised. A connection that breaks, or whose oldest batch waited
longer than the reply timeout, fails every batch in flight (``ConnectionError``,
``TimeoutError``) and is replaced by the next batch. No command is ever sent twice. A host name
that misses a lookup is asked again until the connect timeout, or connects to the name's last
addresses (``runtime.lookup``).
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import hiredis
import redis.asyncio as aioredis
from redis._parsers import BaseParser
from redis.asyncio.connection import AbstractConnection, SSLConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from runtime import lookup

Command = Sequence[str | bytes | int | float]


@dataclass(frozen=True)
class Endpoint:
    """Where and how to connect, as the redis-py client it stands beside would."""

    host: str
    port: int
    path: str | None = None
    """A Unix socket (``unix://`` URLs) instead of host and port."""
    ssl: ssl.SSLContext | None = None
    username: str | None = None
    password: str | None = None
    db: int = 0
    client_name: str | None = None
    connect_timeout_s: float = 3.0
    reply_timeout_s: float = 5.0

    @classmethod
    def of(cls, client: aioredis.Redis) -> Endpoint:
        """The endpoint of ``client``'s connections (a client of one Redis, not a cluster)."""
        pool = client.connection_pool
        return cls.from_kwargs(pool.connection_class, pool.connection_kwargs)

    @classmethod
    def from_kwargs(
        cls, connection_class: type[AbstractConnection], kw: dict[str, Any]
    ) -> Endpoint:
        """The endpoint redis-py would connect to, given a connection class and its keyword
        arguments (as ``redis.asyncio.connection.parse_url`` and a pool hold them). A RESP3
        client (``protocol=3``) is answered in RESP2 here, which the callers parse."""
        context = None
        if issubclass(connection_class, SSLConnection):
            # redis-py 8.1.0: the context redis-py itself would use (certificates, verify mode,
            # ciphers from the URL's ssl_* options), built by its private RedisSSLContext.
            context = connection_class(**kw).ssl_context.get()
        return cls(
            host=kw.get("host", "localhost"),
            port=int(kw.get("port", 6379)),
            path=kw.get("path"),
            ssl=context,
            username=kw.get("username"),
            password=kw.get("password"),
            db=int(kw.get("db", 0) or 0),
            client_name=kw.get("client_name"),
            connect_timeout_s=kw.get("socket_connect_timeout") or 3.0,
            reply_timeout_s=kw.get("socket_timeout") or 5.0,
        )

    @property
    def where(self) -> str:
        return self.path or f"{self.host}:{self.port}"

    def setup(self) -> list[Command]:
        """The commands that open a session: AUTH, SELECT, CLIENT SETNAME as needed, then
        CLIENT ID (the id ``CLIENT UNBLOCK`` takes)."""
        commands: list[Command] = []
        if self.password is not None:
            commands.append(
                ("AUTH", self.username, self.password) if self.username else ("AUTH", self.password)
            )
        if self.db:
            commands.append(("SELECT", self.db))
        if self.client_name:
            commands.append(("CLIENT", "SETNAME", self.client_name))
        commands.append(("CLIENT", "ID"))
        return commands


@dataclass(slots=True)
class _Batch:
    count: int
    replies: list[Any]
    future: asyncio.Future[list[Any]]
    sent_at: float


class _Protocol(asyncio.Protocol):
    def __init__(self, reply_timeout_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        # redis-py 8.1.0: its private parser's error table turns "NOSCRIPT ...", "MOVED ..."
        # and the rest into redis-py's exception classes, which runtime.faults classifies.
        self._reader = hiredis.Reader(replyError=BaseParser.parse_error)
        self._pending: collections.deque[_Batch] = collections.deque()
        self._timeout = reply_timeout_s
        self._watchdog: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def send(self, commands: Sequence[Command]) -> asyncio.Future[list[Any]]:
        future: asyncio.Future[list[Any]] = self._loop.create_future()
        if self.closed or self.transport is None:
            future.set_exception(RedisConnectionError("the Redis connection is closed"))
            return future
        if not commands:  # no reply would ever come to end the batch
            future.set_result([])
            return future
        pack = hiredis.pack_command
        data = b"".join([pack(tuple(c)) for c in commands])  # type: ignore[arg-type]
        self._pending.append(_Batch(len(commands), [], future, self._loop.time()))
        self.transport.write(data)
        if self._watchdog is None:
            self._watchdog = self._loop.call_later(self._timeout, self._check)
        return future

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        gets = self._reader.gets
        pending = self._pending
        while (reply := gets()) is not False:
            if not pending:  # a reply to nothing: the stream is out of step, so end it
                self._fail(RedisConnectionError("Redis sent a reply nobody asked for"))
                return
            batch = pending[0]
            batch.replies.append(reply)
            if len(batch.replies) == batch.count:
                pending.popleft()
                if not batch.future.done():
                    batch.future.set_result(batch.replies)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RedisConnectionError(f"the connection to Redis was lost ({exc or 'closed'})"))

    def _check(self) -> None:
        """One timer per reply timeout, not per batch: fail everything once the oldest
        unanswered batch is overdue, else look again when it would be."""
        self._watchdog = None
        if not self._pending or self.closed:
            return
        overdue = self._loop.time() - self._pending[0].sent_at
        if overdue >= self._timeout:
            self._fail(RedisTimeoutError(f"Redis did not answer within {self._timeout:g} s"))
        else:
            self._watchdog = self._loop.call_later(self._timeout - overdue, self._check)

    def _fail(self, error: Exception) -> None:
        self.closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        while self._pending:
            batch = self._pending.popleft()
            if not batch.future.done():
                batch.future.set_exception(error)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()


class RespConnection:
    """One pipelining connection, opened on first use and again after it breaks."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._protocol: _Protocol | None = None
        self._opening: asyncio.Lock | None = None
        self.client_id: int | None = None
        """The server's id of the connection now open (None while none is)."""

    @property
    def open(self) -> bool:
        return self._protocol is not None and not self._protocol.closed

    async def execute(self, commands: Sequence[Command]) -> list[Any]:
        """Send ``commands`` in one write; their replies in order, an error reply as its
        redis-py exception (not raised). Raises ConnectionError or TimeoutError when the
        connection fails before every reply has arrived."""
        protocol = self._protocol
        if protocol is None or protocol.closed:
            protocol = await self._open()
        return await protocol.send(commands)

    async def _open(self) -> _Protocol:
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:  # one connect at a time, however many callers wait
            if self._protocol is not None and not self._protocol.closed:
                return self._protocol
            e = self.endpoint
            protocol = _Protocol(e.reply_timeout_s)
            unresolved: list[socket.gaierror] = []
            try:
                async with asyncio.timeout(e.connect_timeout_s):
                    await self._reach(protocol, unresolved)
                    replies = await protocol.send(e.setup())
            except TimeoutError:
                protocol._fail(RedisTimeoutError("timed out connecting to Redis"))
                if unresolved:  # the name never resolved: say so, not "timed out"
                    raise RedisConnectionError(
                        f"cannot connect to Redis at {e.where}: {unresolved[-1]}"
                        f" (looked up {len(unresolved)} times in {e.connect_timeout_s:g} s)"
                    ) from None
                raise RedisTimeoutError(f"timed out connecting to Redis at {e.where}") from None
            except OSError as err:
                protocol._fail(RedisConnectionError("could not connect"))
                raise RedisConnectionError(f"cannot connect to Redis at {e.where}: {err}") from err
            except BaseException:  # cancelled while setting the session up: close what opened
                protocol._fail(RedisConnectionError("connecting was cancelled"))
                raise
            for reply in replies:
                if isinstance(reply, Exception):
                    protocol._fail(RedisConnectionError("Redis refused the session"))
                    raise reply
            self._protocol = protocol
            self.client_id = int(replies[-1])
            return protocol

    async def _reach(self, protocol: _Protocol, unresolved: list[socket.gaierror]) -> None:
        """Open ``protocol``'s transport: to the Unix socket, else to the first of the host's
        addresses that takes the connection (``runtime.lookup``: a lookup that misses is asked
        again, or answered with the name's last addresses; failures go to ``unresolved``)."""
        e = self.endpoint
        loop = asyncio.get_running_loop()
        if e.path is not None:
            await loop.create_unix_connection(lambda: protocol, e.path)
            return

        async def connect(sockaddr: Any) -> None:
            await loop.create_connection(
                lambda: protocol,
                sockaddr[0],
                sockaddr[1],
                ssl=e.ssl,
                server_hostname=e.host if e.ssl is not None else None,
            )

        await lookup.connect_first(e.host, e.port, unresolved, connect)

    async def close(self) -> None:
        if self._protocol is not None:
            self._protocol._fail(RedisConnectionError("the connection was closed"))
            self._protocol = None
        self.client_id = None

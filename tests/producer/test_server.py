"""``OneWrite`` sends a response's header block and its body in one write, without ever
delaying bytes past the current event-loop turn or changing their order."""

from __future__ import annotations

import asyncio
import socket
import types
from typing import Any

import uvicorn

from producer.httpbody import body_received
from producer.server import HOLD_BODY_BYTES, OneWrite, server_config
from producer.settings import GatewaySettings

HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"


class Recorder:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def writelines(self, lines: Any) -> None:
        self.writes.append(b"".join(lines))

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> str:
        return f"extra {name}"


def run(body: Any) -> Recorder:
    recorder = Recorder()

    async def go() -> None:
        await body(OneWrite(recorder), recorder)  # type: ignore[arg-type]

    asyncio.run(go())
    return recorder


def test_a_header_block_and_its_body_go_out_in_one_write():
    async def body(t: OneWrite, r: Recorder) -> None:
        t.write(HEAD)
        t.write(b"{}")
        assert r.writes == [HEAD + b"{}"]

    run(body)


def test_a_header_block_alone_goes_out_at_the_end_of_the_turn():
    async def body(t: OneWrite, r: Recorder) -> None:
        t.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        assert r.writes == []
        await asyncio.sleep(0)
        assert r.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]

    run(body)


def test_a_large_body_follows_its_header_block_without_being_copied():
    big = b"x" * (HOLD_BODY_BYTES + 1)

    async def body(t: OneWrite, r: Recorder) -> None:
        t.write(HEAD)
        t.write(big)
        assert r.writes == [HEAD, big]

    run(body)


def test_closing_sends_what_is_held_first():
    async def body(t: OneWrite, r: Recorder) -> None:
        t.write(HEAD)
        t.close()
        assert r.writes == [HEAD] and r.closed

    run(body)


def test_other_bytes_pass_straight_through_and_everything_else_is_the_transports():
    async def body(t: OneWrite, r: Recorder) -> None:
        t.write(b"more body")
        t.write(HEAD)
        t.writelines([b"a", b"b"])
        assert r.writes == [b"more body", HEAD, b"ab"]
        assert t.get_extra_info("peername") == "extra peername"

    run(body)


# -- HeaderDeadline marks a request whose body is already in (``BODY_RECEIVED``) ------------


def test_a_body_that_came_with_its_headers_is_marked_received_and_a_late_one_is_not():
    """The infer path arms no body timer for a marked request (``producer.httpbody``): the
    mark must mean that ``receive`` cannot wait, so only a body wholly in is marked."""
    seen: list[tuple[bool, bytes]] = []
    entered = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": message["type"] + ".complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        marked = body_received(scope)
        entered.set()
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        seen.append((marked, body))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def go() -> None:
        app.state = types.SimpleNamespace()  # type: ignore[attr-defined]  # no gateway
        server = uvicorn.Server(server_config(app, GatewaySettings()))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()  # connections wait in the backlog until the server accepts them
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        reader, writer = await asyncio.open_connection(*sock.getsockname())
        head = b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: 4\r\n\r\n"
        writer.write(head + b"abcd")
        await reader.readuntil(b"ok")
        entered.clear()
        writer.write(head + b"ab")
        await entered.wait()
        writer.write(b"cd")
        await reader.readuntil(b"ok")
        writer.close()
        server.should_exit = True
        await serving

    asyncio.run(go())
    assert seen == [(True, b"abcd"), (False, b"abcd")]

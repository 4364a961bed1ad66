"""A webhook receiver on a loopback port, for the webhook tests and benchmark.

A real HTTP server in a thread: every POST is recorded (headers, body, when it arrived) and
answered as ``answers`` says: a list of status codes used up one per request (then 200), or
``hold``, which keeps the request open until ``release()`` (a receiver that is slow to answer
while the test kills the gateway)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from standardwebhooks import Webhook


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float
    """``time.time()`` when it arrived."""
    answered: int
    """The status it was (or, while held, will be) answered with."""

    @property
    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def webhook_id(self) -> str:
        return self.headers["webhook-id"]

    def verified(self, secret: str) -> Any:
        """The body, after the signature checked out with the Standard Webhooks library."""
        return Webhook(secret).verify(self.body, self.headers)


class Receiver:
    def __init__(self) -> None:
        self.received: list[Received] = []
        self.answers: list[int] = []
        """Status codes of the next requests, in order; 200 once used up."""
        self.hold = False
        self._released = threading.Event()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="receiver")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/hook"

    def release(self) -> None:
        self.hold = False
        self._released.set()

    def accepted(self) -> list[Received]:
        return [r for r in self.received if 200 <= r.answered < 300]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                with receiver._lock:
                    status = receiver.answers.pop(0) if receiver.answers else 200
                    hold = receiver.hold
                    receiver.received.append(
                        Received(
                            self.path,
                            {k.lower(): v for k, v in self.headers.items()},
                            body,
                            time.time(),
                            status,
                        )
                    )
                if hold:
                    receiver._released.wait(60)
                self.send_response(status)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler

    def start(self) -> Receiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)


@contextmanager
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    try:
        yield r
    finally:
        r.stop()

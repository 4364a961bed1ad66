"""The infer path's header reading: one pass over the ASGI scope, read as Starlette reads it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from producer.errors import RequestTimeout
from producer.httpbody import (
    BODY_RECEIVED,
    body_received,
    no_cache,
    read_inference_body,
    request_headers,
)
from producer.inflight import InflightBytes
from producer.settings import GatewaySettings


def test_headers_are_read_by_lower_case_name_and_the_first_of_a_repeated_one_wins():
    scope = {
        "headers": [
            (b"content-type", b"application/json"),
            (b"cache-control", b"no-cache"),
            (b"cache-control", b"max-age=5"),
            (b"x-name", "caf\u00e9".encode("latin-1")),
        ]
    }
    headers = request_headers(scope)
    assert headers["content-type"] == "application/json"
    assert headers["cache-control"] == "no-cache" and no_cache(headers)
    assert headers["x-name"] == "caf\u00e9"  # latin-1, as HTTP/1.1 header bytes are
    assert headers.get("traceparent") is None


def _receive(*messages: dict[str, Any]) -> Any:
    """An ASGI ``receive`` that hands out ``messages``, then waits for ever."""
    queue = list(messages)

    async def receive() -> dict[str, Any]:
        if queue:
            return queue.pop(0)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    return receive


def _read(received: bool, *messages: dict[str, Any]) -> tuple[bytes, int | None]:
    settings = GatewaySettings(body_timeout_s=0.05)
    hold = InflightBytes(1 << 20).hold(0)
    headers = {"content-type": "application/json"}
    return asyncio.run(
        read_inference_body(headers, _receive(*messages), hold, settings, received=received)
    )


def test_a_received_body_is_read_whole_and_an_incomplete_one_still_times_out():
    """``received`` (the server saw the whole body before the app read it) only drops the
    body timer; the body is read the same, and without the mark a body that stops arriving
    still gets 408 after ``--body-timeout-s``."""
    whole = {"type": "http.request", "body": b"{}", "more_body": False}
    assert _read(True, whole) == (b"{}", None)
    assert _read(False, whole) == (b"{}", None)
    part = {"type": "http.request", "body": b"{", "more_body": True}
    with pytest.raises(RequestTimeout, match="received 1 bytes"):
        _read(False, part)


def test_only_a_true_mark_in_the_scope_counts_as_received():
    assert body_received({BODY_RECEIVED: True})
    assert not body_received({})
    assert not body_received({BODY_RECEIVED: "yes"})

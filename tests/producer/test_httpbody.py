"""The infer path's header reading: one pass over the ASGI scope, read as Starlette reads it."""

from __future__ import annotations

from producer.httpbody import no_cache, request_headers


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
